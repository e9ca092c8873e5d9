//! Preparing a step: the scheduler's output flattened into one batch (token ids, positions,
//! slots, block tables, the rows whose logits are wanted), and how each logits row is reduced
//! (a token chosen where the logits are, or the row brought to the host).

use super::Engine;
use super::request::{PendingStep, banned_tokens, with_drafts};
use crate::backend::BatchInput;
use crate::kv::NULL_BLOCK;
use crate::sampling::RowSampling;
use crate::sampling::rows::{row_sampling, samples_anywhere};
use crate::sched::{RequestId, SchedulerOutput};

impl Engine {
    /// The flattened batch of a schedule (see ARCHITECTURE.md, "One engine step"), and what
    /// its results are for. On an error the schedule comes back with it.
    pub(super) fn prepare_step(
        &mut self,
        sched: SchedulerOutput,
    ) -> std::result::Result<(BatchInput, PendingStep), (anyhow::Error, SchedulerOutput)> {
        let bs = self.scheduler.kv().block_size();
        let max_blocks = sched
            .scheduled
            .iter()
            .map(|s| s.block_table.len())
            .max()
            .unwrap_or(1);
        let mut input = BatchInput {
            max_blocks,
            ..Default::default()
        };
        input.query_start.push(0);
        let mut sampling = Vec::new();
        // The logits row of each sampled request, and the prompt rows asked for by
        // `prompt_logprobs`: (request, position whose next token they score, row).
        let mut sample_rows = Vec::new();
        let mut prompt_rows: Vec<(RequestId, usize, usize)> = Vec::new();
        let mut pool_rows = Vec::new();
        let mut drafts = Vec::new();
        for s in &sched.scheduled {
            let Some(req) = self.scheduler.request(s.id) else {
                return Err((anyhow::anyhow!("scheduled request is unknown"), sched));
            };
            let range = s.num_computed_tokens..s.num_computed_tokens + s.num_new_tokens;
            let pool = self.pools.get(&s.id);
            for pos in pool.map_or(Vec::new(), |p| p.wanted(range.clone(), req.prompt_len)) {
                let row = input.token_ids.len() + (pos - range.start);
                input.logits_rows.push(row as u32);
                pool_rows.push((s.id, pos, input.logits_rows.len() - 1));
            }
            // NOTE: positions whose scores were taken before (a preempted request recomputes
            // its prompt) are not taken again.
            if let Some(st) = self.states.get(&s.id)
                && st.params.prompt_logprobs.is_some()
                && !st.prompt_logprobs_sent
            {
                let first = range.start.max(st.prompt_logprobs.len());
                let last = range.end.min(req.prompt_len.saturating_sub(1));
                for pos in first..last {
                    let row = input.token_ids.len() + (pos - range.start);
                    input.logits_rows.push(row as u32);
                    prompt_rows.push((s.id, pos, input.logits_rows.len() - 1));
                }
            }
            // NOTE: the drafts are the step's last positions, after the last known token.
            input
                .token_ids
                .extend_from_slice(&req.tokens[range.start..range.end - s.draft_tokens.len()]);
            input.token_ids.extend_from_slice(&s.draft_tokens);
            for pos in range {
                input.positions.push(pos as u32);
                input
                    .slot_mapping
                    .push(s.block_table[pos / bs] * bs as u32 + (pos % bs) as u32);
            }
            input.query_start.push(input.token_ids.len() as u32);
            input.lora_slots.push(req.lora);
            input
                .seq_lens
                .push((s.num_computed_tokens + s.num_new_tokens) as u32);
            input.block_tables.extend_from_slice(&s.block_table);
            input.block_tables.extend(std::iter::repeat_n(
                NULL_BLOCK,
                max_blocks - s.block_table.len(),
            ));
            if s.sample && pool.is_none() {
                // The last known token's row, and one per draft.
                let end = input.token_ids.len();
                sampling.push(s.id);
                sample_rows.push(input.logits_rows.len());
                drafts.push(s.draft_tokens.clone());
                input
                    .logits_rows
                    .extend((end - 1 - s.draft_tokens.len()..end).map(|r| r as u32));
            }
        }
        if let Err(e) = self.loras_to_device(&input.lora_slots) {
            return Err((e, sched));
        }
        self.stats.batched_tokens += input.token_ids.len() as u64;
        // NOTE: where a row is sampled depends on its request and the backend only, never on
        // the rest of the batch, so a seeded request gives the same tokens in any batch.
        let on_device = self.runner.samples_on_device();
        let mut reduce = vec![None; input.logits_rows.len()];
        for ((id, &first), drafts) in sampling.iter().zip(&sample_rows).zip(&drafts) {
            let (Some(st), Some(req)) = (self.states.get(id), self.scheduler.request(*id)) else {
                continue;
            };
            let p = &st.params;
            // NOTE: a backend that does not sample takes plain greedy rows only: no edits are
            // built for a random row that will be sampled on the host anyway.
            if !samples_anywhere(p) || !(on_device || p.chooses_argmax()) {
                continue;
            }
            // NOTE: a draft's row is sampled as the position after the drafts before it.
            for i in 0..=drafts.len() {
                let output = with_drafts(req.output(), drafts, i);
                let banned = banned_tokens(st, &output);
                let how = row_sampling(
                    &st.params,
                    st.seed,
                    req.prompt(),
                    &output,
                    &banned,
                    self.config.vocab_size,
                );
                if on_device || how.is_plain_greedy() {
                    reduce[first + i] = Some(how);
                }
            }
        }
        if on_device {
            for &(id, pos, row) in &prompt_rows {
                let (Some(st), Some(req)) = (self.states.get(&id), self.scheduler.request(id))
                else {
                    continue;
                };
                reduce[row] = Some(RowSampling {
                    score: Some(req.tokens[pos + 1]),
                    logprobs: st.params.prompt_logprobs.map(|k| k as u32),
                    ..RowSampling::GREEDY
                });
            }
        }
        Ok((
            input,
            PendingStep {
                sched,
                sampling,
                sample_rows,
                prompt_rows,
                pool_rows,
                drafts,
                reduce,
            },
        ))
    }
}
