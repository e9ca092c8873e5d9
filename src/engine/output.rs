//! Applying a step's results: each sampling request's token chosen (on the host where the
//! device did not), checked against its stops and appended, its prompt log-probabilities
//! kept, the scheduler told what finished, and the callers' [`StepOutput`]s made (`best_of`
//! samples ranked once all have ended).

use super::request::{
    Masked, PendingStep, PromptLogprob, StepOutput, StopReason, banned_tokens, prompt_logprob,
    with_drafts,
};
use super::{Engine, StepResult};
use crate::sampling::{Choice, Restrict, TokenLogprobs, sampler::sample_restricted, token_logprob};
use crate::sched::{FinishReason, RequestId};
use anyhow::{Context, Result, bail, ensure};
use std::collections::{HashMap, VecDeque};

impl Engine {
    /// Samples a step's tokens from its results and applies them: the scheduler's update, stop
    /// strings, detokenization, the outputs.
    pub(super) fn complete_step(
        &mut self,
        step: PendingStep,
        result: StepResult,
        mut masks: HashMap<RequestId, Masked>,
    ) -> Result<Vec<StepOutput>> {
        let PendingStep {
            sched,
            sampling,
            sample_rows,
            prompt_rows,
            pool_rows,
            drafts,
            reduce,
        } = step;
        let vocab = self.row_len;
        let StepResult {
            mut choices,
            logits,
        } = result;
        // Where each row's logits are in `logits` (rows that came back as a token have none).
        let mut host_row = Vec::with_capacity(reduce.len());
        let mut n = 0;
        for c in &choices {
            host_row.push(n);
            n += usize::from(c.is_none());
        }
        ensure!(
            choices.len() == reduce.len() && logits.len() == n * vocab,
            "the runner returned {} tokens and {} logits for {} rows",
            choices.len(),
            logits.len(),
            reduce.len()
        );

        // NOTE: a request aborted while its step was in flight has no state any more: its
        // results are dropped.
        for &(id, pos, row) in &prompt_rows {
            let (Some(req), Some(st)) = (self.scheduler.request(id), self.states.get_mut(&id))
            else {
                continue;
            };
            let scored = match choices[row].take() {
                Some(Choice {
                    logprobs: Some(logprobs),
                    rank,
                    ..
                }) => PromptLogprob {
                    logprobs,
                    rank: rank as usize,
                },
                Some(_) => bail!("the runner brought back no log-probabilities for a prompt row"),
                None => {
                    let row = host_row[row];
                    let row = &logits[row * vocab..(row + 1) * vocab];
                    let next = req.tokens[pos + 1];
                    let k = st.params.prompt_logprobs.unwrap_or(0);
                    prompt_logprob(row, next, k)
                }
            };
            st.prompt_logprobs.push(scored);
        }
        for &(id, pos, row) in &pool_rows {
            ensure!(choices[row].is_none(), "the runner reduced a pooling row");
            let row = host_row[row];
            if let Some(p) = self.pools.get_mut(&id) {
                p.take(pos, &logits[row * vocab..(row + 1) * vocab]);
            }
        }
        let mut sampled = HashMap::new();
        let mut logprobs: HashMap<RequestId, VecDeque<TokenLogprobs>> = HashMap::new();
        // `best_of`: each token's log-probability, added to its sample's score as its token is
        // taken (a token after a stop is not).
        let mut scores: HashMap<RequestId, VecDeque<f64>> = HashMap::new();
        // NOTE: a request with drafts has a row per draft after its first; row `i` is sampled
        // as the request's next token would be after the first `i` drafts (its edits and its
        // draw for that position), and the drafts are kept while each equals the token the row
        // before it gave. So the tokens are those of decoding one at a time, draw for draw;
        // for one candidate per position this is speculative sampling's rejection scheme (a
        // draft kept with its probability, else a draw from the rest).
        for ((id, &first), drafts) in sampling.iter().zip(&sample_rows).zip(&drafts) {
            let (Some(req), Some(st)) = (self.scheduler.request(*id), self.states.get_mut(id))
            else {
                continue;
            };
            let ranks = st.params.best_of() > st.params.n;
            let mut kept = Vec::with_capacity(drafts.len() + 1);
            let mut lps = VecDeque::new();
            let mut score = VecDeque::new();
            for i in 0..=drafts.len() {
                let row = first + i;
                let output = with_drafts(req.output(), drafts, i);
                let (token, lp) = match choices[row].take() {
                    Some(c) => {
                        self.stats.random_samples_on_device +=
                            u64::from(reduce[row].as_ref().is_some_and(|r| !r.is_greedy()));
                        if let (true, Some(lp)) = (ranks, &c.logprobs) {
                            score.push_back(lp.logprob as f64);
                        }
                        (c.token, c.logprobs.filter(|_| st.params.logprobs.is_some()))
                    }
                    None => {
                        let at = host_row[row] * vocab;
                        let logits_row = &logits[at..at + vocab];
                        let banned = banned_tokens(st, &output);
                        // NOTE: a grammar that fails midway lets the output end (its stop
                        // tokens only) rather than take the step down. Constrained requests
                        // have no drafts.
                        let mask = match masks.remove(id) {
                            Some(Ok(v)) => Some(v),
                            Some(Err(e)) => {
                                tracing::warn!("request {id}: structured output failed: {e}");
                                let mut v = llguidance::toktrie::SimpleVob::alloc(vocab);
                                st.stop_ids.iter().for_each(|&t| v.allow_token(t));
                                Some(v)
                            }
                            None => None,
                        };
                        let restrict = Restrict {
                            banned: &banned,
                            allowed: mask.as_ref().map(|m| m.as_slice()),
                        };
                        let tok = sample_restricted(
                            logits_row,
                            &st.params,
                            req.prompt(),
                            &output,
                            &restrict,
                            st.seed,
                            output.len(),
                        );
                        if let Some(m) = &mut st.matcher
                            && let Err(e) = m.consume_token(tok.token_id)
                        {
                            tracing::warn!("request {id}: structured output failed: {e:#}");
                        }
                        if ranks {
                            score.push_back(match &tok.logprobs {
                                Some(lp) => lp.logprob,
                                None => token_logprob(logits_row, tok.token_id),
                            } as f64);
                        }
                        (tok.token_id, tok.logprobs)
                    }
                };
                kept.push(token);
                lps.extend(lp);
                if drafts.get(i) != Some(&token) {
                    break;
                }
            }
            if !drafts.is_empty() {
                self.stats.spec_drafts += 1;
                self.stats.spec_draft_tokens += drafts.len() as u64;
                self.stats.spec_accepted_tokens += kept.len() as u64 - 1;
            }
            sampled.insert(*id, kept);
            if !lps.is_empty() {
                logprobs.insert(*id, lps);
            }
            if !score.is_empty() {
                scores.insert(*id, score);
            }
        }

        let events = self.scheduler.update_from_output(&sched, &sampled);
        let mut outputs = Vec::with_capacity(events.len());
        self.finish_pools(&sched, &mut outputs)?;
        // Requests a stop string ended in this step: their later tokens (kept drafts) are not
        // theirs.
        let mut ended = Vec::new();
        for ev in events {
            if ended.contains(&ev.id) {
                continue;
            }
            self.stats.generated_tokens += 1;
            let n_out = ev.num_output_tokens;
            let st = self
                .states
                .get_mut(&ev.id)
                .context("request state is missing")?;
            if let Some(v) = scores.get_mut(&ev.id).and_then(|q| q.pop_front()) {
                st.cum_logprob += v;
            }
            // NOTE: the token that ends a request (EOS, a stop token id) is not part of its
            // text, as in vLLM, also when special tokens are kept.
            let delta =
                if ev.finished == Some(FinishReason::Stop) && st.stop_ids.contains(&ev.token) {
                    String::new()
                } else {
                    st.detok.push(ev.token)?
                };
            let (mut text, stopped) = if n_out <= st.params.min_tokens {
                (st.stop.push_unchecked(&delta), false)
            } else {
                st.stop.push(&delta)
            };
            let mut finish = ev.finished;
            // NOTE: a grammar that is complete and allows nothing more ends the output here
            // (the mask would allow only EOS next).
            let grammar_done = finish.is_none()
                && !stopped
                && st
                    .matcher
                    .as_ref()
                    .is_some_and(|m| m.is_stopped() && !st.stop_ids.contains(&ev.token));
            let stopped = stopped || grammar_done;
            if grammar_done {
                text.push_str(&st.stop.flush());
            }
            if stopped {
                // NOTE: a stop string ends the request even when the token also hit a limit.
                self.scheduler.finish_request(ev.id, FinishReason::Stop);
                finish = Some(FinishReason::Stop);
            } else if finish.is_some() {
                let tail = st.detok.finish()?;
                text.push_str(&st.stop.push_unchecked(&tail));
                text.push_str(&st.stop.flush());
            }
            let req = self
                .scheduler
                .request(ev.id)
                .context("request is unknown")?;
            let prompt_logprobs = if st.params.prompt_logprobs.is_some() && !st.prompt_logprobs_sent
            {
                st.prompt_logprobs_sent = true;
                Some(std::mem::take(&mut st.prompt_logprobs))
            } else {
                None
            };
            let stop_reason = match st.stop.matched() {
                Some(m) => Some(StopReason::Text(m.to_string())),
                None if finish == Some(FinishReason::Stop)
                    && st.params.stop_token_ids.contains(&ev.token) =>
                {
                    Some(StopReason::Token(ev.token))
                }
                None => None,
            };
            let out = StepOutput {
                prompt_logprobs,
                stop_reason,
                request_id: st.group,
                index: st.index,
                new_token_ids: vec![ev.token],
                new_text: text,
                new_logprobs: logprobs
                    .get_mut(&ev.id)
                    .and_then(|q| q.pop_front())
                    .into_iter()
                    .collect(),
                finish_reason: finish,
                num_prompt_tokens: req.prompt_len,
                num_output_tokens: n_out,
                pooled: None,
            };
            let (group, cum_logprob) = (st.group, st.cum_logprob);
            if finish.is_some() {
                self.scheduler.remove_finished(ev.id);
                self.states.remove(&ev.id);
                ended.push(ev.id);
            }
            self.emit(group, out, cum_logprob, &mut outputs)?;
        }
        self.stats.steps += 1;
        // NOTE: an unloaded adapter's memory goes as soon as its last request ends.
        self.free_drained_loras();
        Ok(outputs)
    }

    /// Ends the pooling requests of `sched` whose prompts are now computed, with their results.
    fn finish_pools(
        &mut self,
        sched: &crate::sched::SchedulerOutput,
        outputs: &mut Vec<StepOutput>,
    ) -> Result<()> {
        for s in &sched.scheduled {
            let Some(req) = self.scheduler.request(s.id) else {
                continue;
            };
            if !self.pools.contains_key(&s.id) || req.num_computed_tokens < req.prompt_len {
                continue;
            }
            let len = req.prompt_len;
            let (pool, pooler) = (self.pools.remove(&s.id), self.pooler.as_ref());
            let (Some(pool), Some(pooler)) = (pool, pooler) else {
                continue;
            };
            let pooled = pool.finish(pooler, len);
            self.scheduler.finish_request(s.id, FinishReason::Stop);
            self.scheduler.remove_finished(s.id);
            let out = StepOutput {
                request_id: s.id,
                index: 0,
                new_token_ids: Vec::new(),
                new_text: String::new(),
                new_logprobs: Vec::new(),
                prompt_logprobs: None,
                finish_reason: Some(FinishReason::Stop),
                stop_reason: None,
                num_prompt_tokens: len,
                num_output_tokens: 0,
                pooled: Some(pooled),
            };
            self.emit(s.id, out, 0.0, outputs)?;
        }
        Ok(())
    }

    /// Passes a sample's output on, or keeps it while its request ranks `best_of` samples; ends
    /// the request when its last sample ends.
    fn emit(
        &mut self,
        group: RequestId,
        out: StepOutput,
        cum_logprob: f64,
        outputs: &mut Vec<StepOutput>,
    ) -> Result<()> {
        let g = self
            .groups
            .get_mut(&group)
            .context("request group is missing")?;
        let finished = out.finished();
        match &mut g.ranked {
            None => outputs.push(out),
            Some(r) => match r.kept.iter_mut().find(|(k, _)| k.index == out.index) {
                Some((k, score)) => {
                    k.new_token_ids.extend(out.new_token_ids);
                    k.new_text.push_str(&out.new_text);
                    k.new_logprobs.extend(out.new_logprobs);
                    k.finish_reason = out.finish_reason;
                    k.stop_reason = out.stop_reason;
                    k.num_output_tokens = out.num_output_tokens;
                    *score = cum_logprob;
                }
                None => r.kept.push((out, cum_logprob)),
            },
        }
        if finished {
            g.unfinished -= 1;
        }
        if g.unfinished > 0 {
            return Ok(());
        }
        let g = self
            .groups
            .remove(&group)
            .context("request group is missing")?;
        if let Some(mut r) = g.ranked {
            // The n most likely samples, best first (ties: the lower sample index).
            r.kept
                .sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.index.cmp(&b.0.index)));
            for (index, (mut out, _)) in r.kept.into_iter().take(r.n).enumerate() {
                out.index = index;
                outputs.push(out);
            }
        }
        Ok(())
    }
}
