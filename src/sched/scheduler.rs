//! The scheduling policy: one token budget per step, running requests first, preemption when
//! blocks run out (recompute, or swap to host memory), swapped requests resumed before new ones
//! are admitted, cached prefixes taken at admission.

use super::request::{FinishReason, Request, RequestId, RequestStatus};
use crate::kv::{BlockId, CachedPrefix, KvCacheManager};
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// Iteration-level batching: finished requests leave and waiting ones join at every step.
    #[default]
    Continuous,
    /// A baseline for benchmarks: a batch is formed, runs until its longest request ends, then
    /// the next batch is formed (as static-batching systems do).
    Static,
}

/// What happens to a preempted request's K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PreemptionMode {
    /// Freed; the request is computed again from its tokens when it resumes (vLLM v1).
    #[default]
    Recompute,
    /// Copied to host blocks and back when it resumes (vLLM v0's swap); recompute when the
    /// host pool is full.
    Swap,
}

impl PreemptionMode {
    /// `recompute` or `swap` (a flag's value).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "recompute" => Ok(PreemptionMode::Recompute),
            "swap" => Ok(PreemptionMode::Swap),
            _ => Err(format!("unknown preemption mode '{s}' (recompute or swap)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PreemptionMode::Recompute => "recompute",
            PreemptionMode::Swap => "swap",
        }
    }
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub policy: SchedulingPolicy,
    pub preemption_mode: PreemptionMode,
    /// Steps kept in flight at once (pipeline parallelism's stages; 1 otherwise). With more
    /// than one, a step takes at most its share of the unfinished requests, so that the steps
    /// in flight split them evenly (as vLLM's virtual engines each hold a share).
    pub steps_in_flight: usize,
    /// The most distinct LoRA adapters among the running requests (`--max-loras`); the base
    /// model does not count.
    pub max_loras: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: 8192,
            policy: SchedulingPolicy::Continuous,
            preemption_mode: PreemptionMode::Recompute,
            steps_in_flight: 1,
            max_loras: usize::MAX,
        }
    }
}

/// One request's share of a step.
#[derive(Debug, Clone)]
pub struct ScheduledRequest {
    pub id: RequestId,
    /// Tokens whose K/V were in the cache before this step.
    pub num_computed_tokens: usize,
    /// Tokens computed in this step: positions `num_computed_tokens .. + num_new_tokens`.
    pub num_new_tokens: usize,
    pub block_table: Vec<BlockId>,
    /// This chunk reaches the request's last known token, so a new token is sampled from the
    /// logits of its last row. False for a prompt chunk that is not the last.
    pub sample: bool,
    /// Draft tokens computed after the last known token (speculative decoding): the step's
    /// last `draft_tokens.len()` positions. Each of the `1 + len` rows gives a token; the
    /// drafts equal to the tokens before them are kept, with the token after the last of them.
    pub draft_tokens: Vec<u32>,
}

#[derive(Debug, Clone, Default)]
pub struct SchedulerOutput {
    pub scheduled: Vec<ScheduledRequest>,
    pub num_batched_tokens: usize,
    /// Requests preempted while building this step.
    pub preempted: Vec<RequestId>,
    /// Device blocks to copy to host blocks before the step runs (swapped out).
    pub swap_out: Vec<(BlockId, u32)>,
    /// Host blocks to copy to device blocks before the step runs (swapped in), after
    /// `swap_out`.
    pub swap_in: Vec<(u32, BlockId)>,
}

impl SchedulerOutput {
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }
}

/// What happened to a request in `update_from_output`: one event per token it gained (more
/// than one in a step where drafts were accepted).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub id: RequestId,
    pub token: u32,
    pub finished: Option<FinishReason>,
    /// The request's output length with this token.
    pub num_output_tokens: usize,
}

pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    /// Swapped out, in the order they were preempted (resumed first in, first out).
    swapped: VecDeque<RequestId>,
    /// In admission order: the last one is the first to be preempted.
    running: Vec<RequestId>,
    /// Static policy: the current batch still accepts requests.
    batch_open: bool,
    num_preemptions: usize,
    /// Requests in a step that was scheduled and whose results are not back yet (pipeline
    /// parallelism keeps several steps in flight): they are neither scheduled again nor
    /// preempted until [`Scheduler::update_from_output`] has seen that step.
    in_flight: HashSet<RequestId>,
}

impl Scheduler {
    /// NOTE: `max_model_len` is capped at what the KV pool holds, so that one request alone can
    /// always make progress once the others are preempted.
    pub fn new(mut config: SchedulerConfig, kv: KvCacheManager) -> Self {
        assert!(config.max_num_batched_tokens > 0 && config.max_num_seqs > 0);
        config.max_model_len = config.max_model_len.min(kv.capacity_tokens());
        Scheduler {
            config,
            kv,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            swapped: VecDeque::new(),
            running: Vec::new(),
            batch_open: true,
            num_preemptions: 0,
            in_flight: HashSet::new(),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// Queues a request. Its prompt must be non-empty and shorter than `max_model_len` (at most
    /// as long, where it generates nothing).
    pub fn add_request(&mut self, req: Request) -> Result<(), String> {
        if req.tokens.is_empty() {
            return Err("the prompt is empty".into());
        }
        // NOTE: a request that generates nothing (`max_tokens` 0: an embedding's prefill)
        // may fill the context; any other needs room for one token.
        let room = usize::from(req.max_tokens > 0);
        if req.num_tokens() + room > self.config.max_model_len {
            let why = if room > 0 {
                " (with room for at least one generated token)"
            } else {
                ""
            };
            return Err(format!(
                "the prompt has {} tokens but the maximum context length is {}{why}",
                req.num_tokens(),
                self.config.max_model_len
            ));
        }
        if self.requests.contains_key(&req.id) {
            return Err(format!("duplicate request id {}", req.id));
        }
        self.waiting.push_back(req.id);
        self.requests.insert(req.id, req);
        Ok(())
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests whose K/V are in host memory, waiting to resume.
    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// The running requests (those holding KV blocks), in admission order.
    pub fn running_ids(&self) -> &[RequestId] {
        &self.running
    }

    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.swapped.is_empty()
    }

    /// Forgets every cached prefix (after the weights change).
    pub fn reset_prefix_cache(&mut self) {
        self.kv.reset_prefix_cache();
    }

    /// Preemptions since the scheduler was made.
    pub fn num_preemptions(&self) -> usize {
        self.num_preemptions
    }

    /// Builds one step: running requests first (preempting the most recently admitted ones
    /// when blocks run out), then waiting ones, within the token budget and `max_num_seqs`.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;
        // (request, tokens computed, the drafts among them)
        let mut grants: Vec<(RequestId, usize, Vec<u32>)> = Vec::new();
        let share = if self.config.steps_in_flight > 1 {
            let unfinished = self.running.len() + self.waiting.len() + self.swapped.len();
            unfinished.div_ceil(self.config.steps_in_flight).max(1)
        } else {
            usize::MAX
        };

        let mut blocked = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 && grants.len() < share {
            let id = self.running[i];
            if self.in_flight.contains(&id) {
                i += 1;
                continue;
            }
            let r = self.requests.get_mut(&id).unwrap();
            let computed = r.num_computed_tokens;
            let mut drafts = std::mem::take(&mut r.draft_tokens);
            let n = (r.num_tokens() - computed).min(budget);
            debug_assert!(n > 0, "a running request always has a token to compute");
            // NOTE: drafts follow a decoding request's last token, within the budget and so
            // that every token they could bring stays within max_tokens and the context; they
            // are dropped rather than preempt anyone.
            let room = (budget - 1)
                .min(r.max_tokens.saturating_sub(r.output().len() + 1))
                .min(self.config.max_model_len.saturating_sub(r.num_tokens() + 1));
            let n_draft = if computed + 1 == r.num_tokens() {
                drafts.len().min(room)
            } else {
                0
            };
            if n_draft > 0
                && self
                    .kv
                    .allocate_slots(id, &self.requests[&id].tokens, computed + 1 + n_draft)
            {
                drafts.truncate(n_draft);
                grants.push((id, 1 + n_draft, drafts));
                budget -= 1 + n_draft;
                i += 1;
                continue;
            }
            let scheduled = loop {
                if self
                    .kv
                    .allocate_slots(id, &self.requests[&id].tokens, computed + n)
                {
                    break true;
                }
                // NOTE: recompute preemption: the victim loses its blocks and starts over later
                // from its prompt plus its output so far, which gives the same tokens.
                // NOTE: a request in flight is not a victim: its step still uses its blocks.
                // `id` itself is not in flight, so there is always one.
                let at = self
                    .running
                    .iter()
                    .rposition(|v| !self.in_flight.contains(v))
                    .expect("the request being scheduled is running");
                // NOTE: rather than preempt itself while others are in flight, a request waits
                // for their steps: they can be preempted (the most recent first) once back.
                // Preempting itself there lets two requests that do not fit together preempt
                // each other in turn forever, each admitted while the other was in flight.
                if self.running[at] == id && !self.in_flight.is_empty() {
                    blocked = true;
                    break false;
                }
                let victim = self.running.remove(at);
                self.preempt(victim, &mut out);
                out.preempted.push(victim);
                if victim == id {
                    break false;
                }
            };
            if !scheduled {
                break;
            }
            grants.push((id, n, Vec::new()));
            budget -= n;
            i += 1;
        }

        // NOTE: nothing is admitted while a running request waits for blocks.
        let may_admit = !blocked
            && match self.config.policy {
                SchedulingPolicy::Continuous => out.preempted.is_empty(),
                SchedulingPolicy::Static => {
                    if self.running.is_empty() {
                        self.batch_open = true;
                    }
                    self.batch_open && out.preempted.is_empty()
                }
            };
        // The adapters of the running requests: one outside them joins only while fewer than
        // max_loras are there. NOTE: a swapped request's adapter always fits: nothing is
        // admitted while one is swapped out, so the adapters since have only left.
        let mut loras: HashSet<u32> = self
            .running
            .iter()
            .map(|id| self.requests[id].lora)
            .filter(|&l| l != 0)
            .collect();
        let max_loras = self.config.max_loras;
        let fits =
            |loras: &HashSet<u32>, l: u32| l == 0 || loras.contains(&l) || loras.len() < max_loras;
        if may_admit {
            // Swapped requests resume first, with their K/V copied back.
            while let Some(&id) = self.swapped.front() {
                if budget == 0
                    || self.running.len() >= self.config.max_num_seqs
                    || grants.len() >= share
                {
                    break;
                }
                let r = &self.requests[&id];
                let n = (r.num_tokens() - r.num_computed_tokens).min(budget);
                let Some(pairs) = self.kv.swap_in(id, &r.tokens, r.num_computed_tokens + n) else {
                    break;
                };
                out.swap_in.extend(pairs);
                self.swapped.pop_front();
                loras.extend(Some(r.lora).filter(|&l| l != 0));
                self.running.push(id);
                self.requests.get_mut(&id).unwrap().status = RequestStatus::Running;
                grants.push((id, n, Vec::new()));
                budget -= n;
            }
        }
        // NOTE: nothing new is admitted while a swapped request waits for blocks.
        if may_admit && self.swapped.is_empty() {
            // NOTE: a request whose adapter does not fit waits, and the requests behind it
            // with adapters wait too (those for the base model go on): so the adapters
            // running drain, and it is not starved by a stream of requests for them.
            let mut lora_waits = false;
            let mut i = 0;
            while let Some(&id) = self.waiting.get(i) {
                if budget == 0
                    || self.running.len() >= self.config.max_num_seqs
                    || grants.len() >= share
                {
                    break;
                }
                let r = &self.requests[&id];
                if r.lora != 0 && (lora_waits || !fits(&loras, r.lora)) {
                    lora_waits = true;
                    i += 1;
                    continue;
                }
                debug_assert_eq!(
                    r.num_computed_tokens, 0,
                    "a waiting request holds no blocks"
                );
                // NOTE: the leading full blocks already in the cache are taken, not computed.
                let prefix = match r.cache_root {
                    Some(root) => self.kv.cached_prefix(&r.tokens, root),
                    None => CachedPrefix::default(),
                };
                let hit = prefix.num_blocks() * self.kv.block_size();
                let n = (r.num_tokens() - hit).min(budget);
                if !self.kv.admit(id, &r.tokens, hit + n, r.cache_root, prefix) {
                    break;
                }
                if r.cache_root.is_some() {
                    self.kv.record_prefix_query(r.num_tokens(), hit);
                }
                self.waiting.remove(i);
                loras.extend(Some(r.lora).filter(|&l| l != 0));
                self.running.push(id);
                let r = self.requests.get_mut(&id).unwrap();
                r.status = RequestStatus::Running;
                r.num_computed_tokens = hit;
                grants.push((id, n, Vec::new()));
                budget -= n;
            }
            if self.config.policy == SchedulingPolicy::Static && !self.running.is_empty() {
                // The batch is formed: nobody joins until it has run to its end.
                self.batch_open = false;
            }
        }

        for (id, n, drafts) in grants {
            self.in_flight.insert(id);
            let r = &self.requests[&id];
            out.scheduled.push(ScheduledRequest {
                id,
                num_computed_tokens: r.num_computed_tokens,
                num_new_tokens: n,
                block_table: self.kv.block_table(id).to_vec(),
                sample: r.num_computed_tokens + n == r.num_tokens() + drafts.len(),
                draft_tokens: drafts,
            });
            out.num_batched_tokens += n;
        }
        out
    }

    fn preempt(&mut self, id: RequestId, out: &mut SchedulerOutput) {
        self.num_preemptions += 1;
        let r = self.requests.get_mut(&id).unwrap();
        r.num_preemptions += 1;
        if self.config.preemption_mode == PreemptionMode::Swap
            && let Some(pairs) = self.kv.swap_out(id)
        {
            out.swap_out.extend(pairs);
            r.status = RequestStatus::Swapped;
            self.swapped.push_back(id);
            return;
        }
        self.kv.free(id);
        r.num_computed_tokens = 0;
        r.status = RequestStatus::Preempted;
        self.waiting.push_front(id);
    }

    /// Applies a step's results: advances computed tokens, appends the tokens each sampled
    /// request gained (`sampled` holds them for every scheduled request with `sample == true`:
    /// one, or with drafts the kept drafts and the token after them) and finishes the requests
    /// that hit a stop token or their length limit, freeing their blocks. Tokens after one that
    /// finishes a request are dropped.
    pub fn update_from_output(
        &mut self,
        out: &SchedulerOutput,
        sampled: &HashMap<RequestId, Vec<u32>>,
    ) -> Vec<TokenEvent> {
        let mut events = Vec::new();
        for s in &out.scheduled {
            self.in_flight.remove(&s.id);
            let Some(r) = self.requests.get_mut(&s.id) else {
                continue;
            };
            if r.is_finished() {
                continue;
            }
            let tokens = sampled.get(&s.id).filter(|_| s.sample);
            // NOTE: the K/V of the drafts that were not kept are not the request's: the
            // positions are computed again with the right tokens (the slots stay allocated).
            let kept = tokens.map_or(0, |t| t.len().clamp(1, s.draft_tokens.len() + 1) - 1);
            debug_assert!(tokens.is_none_or(|t| t[..kept] == s.draft_tokens[..kept]));
            r.num_computed_tokens =
                s.num_computed_tokens + s.num_new_tokens - (s.draft_tokens.len() - kept);
            let tokens = tokens.map_or(&[][..], |t| &t[..(kept + 1).min(t.len())]);
            let mut finished = None;
            for &token in tokens {
                r.tokens.push(token);
                let n_out = r.num_tokens() - r.prompt_len;
                finished = if r.stop_token_ids.contains(&token) {
                    Some(FinishReason::Stop)
                } else if n_out >= r.max_tokens || r.num_tokens() >= self.config.max_model_len {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                events.push(TokenEvent {
                    id: s.id,
                    token,
                    finished,
                    num_output_tokens: n_out,
                });
                if finished.is_some() {
                    break;
                }
            }
            if let Some(reason) = finished {
                self.finish_request(s.id, reason);
            }
        }
        events
    }

    /// Proposes draft tokens for a running request's next step (speculative decoding); they
    /// are scheduled if it decodes then, as far as the budget and its limits allow.
    pub fn set_draft_tokens(&mut self, id: RequestId, drafts: Vec<u32>) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.draft_tokens = drafts;
        }
    }

    /// Forgets that `out`'s requests are in flight, after its step failed: they are scheduled
    /// again from where they were before it.
    pub fn step_failed(&mut self, out: &SchedulerOutput) {
        for s in &out.scheduled {
            self.in_flight.remove(&s.id);
        }
    }

    /// Requests in steps whose results are not back yet.
    pub fn num_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Ends a request now (a stop string, an abort): its blocks return to the pool at once.
    /// Returns false if the request was unknown or already finished.
    pub fn finish_request(&mut self, id: RequestId, reason: FinishReason) -> bool {
        match self.requests.get_mut(&id) {
            Some(r) if !r.is_finished() => r.status = RequestStatus::Finished(reason),
            _ => return false,
        }
        self.kv.free(id);
        self.running.retain(|&x| x != id);
        self.waiting.retain(|&x| x != id);
        self.swapped.retain(|&x| x != id);
        true
    }

    /// The LoRA adapters (slots, the base model's 0 left out) of the running requests, and of
    /// those waiting or swapped out.
    pub fn lora_slots(&self) -> (BTreeSet<u32>, BTreeSet<u32>) {
        let slots = |ids: &mut dyn Iterator<Item = &RequestId>| -> BTreeSet<u32> {
            ids.map(|id| self.requests[id].lora)
                .filter(|&l| l != 0)
                .collect()
        };
        (
            slots(&mut self.running.iter()),
            slots(&mut self.waiting.iter().chain(&self.swapped)),
        )
    }

    /// Whether an unfinished request uses the LoRA adapter in `slot`.
    pub fn uses_lora(&self, slot: u32) -> bool {
        self.requests
            .values()
            .any(|r| r.lora == slot && !r.is_finished())
    }

    /// Forgets a finished request (after its output was delivered).
    pub fn remove_finished(&mut self, id: RequestId) -> Option<Request> {
        match self.requests.get(&id) {
            Some(r) if r.is_finished() => self.requests.remove(&id),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One token per sampled request, as a step without drafts gives.
    fn one(m: HashMap<RequestId, u32>) -> HashMap<RequestId, Vec<u32>> {
        m.into_iter().map(|(id, t)| (id, vec![t])).collect()
    }

    fn sched(blocks: usize, bs: usize, budget: usize, max_seqs: usize) -> Scheduler {
        let cfg = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: max_seqs,
            max_model_len: 10_000,
            policy: SchedulingPolicy::Continuous,
            preemption_mode: PreemptionMode::Recompute,
            steps_in_flight: 1,
            max_loras: usize::MAX,
        };
        Scheduler::new(cfg, KvCacheManager::new(blocks, bs, false))
    }

    fn cached(blocks: usize, bs: usize, budget: usize) -> Scheduler {
        let cfg = SchedulerConfig {
            max_num_batched_tokens: budget,
            ..SchedulerConfig::default()
        };
        Scheduler::new(cfg, KvCacheManager::new(blocks, bs, true))
    }

    /// A request that generates nothing (an embedding's prefill) may fill the context; one that
    /// generates needs room for a token. Its prompt is computed in chunks under the budget and
    /// it stays until the caller ends it (no token comes for it).
    #[test]
    fn prefill_only_requests_fill_the_context() {
        let mut s = sched(64, 4, 8, 4);
        s.config.max_model_len = 20;
        assert!(
            s.add_request(Request::new(1, vec![1; 20], 1, vec![]))
                .is_err()
        );
        assert!(
            s.add_request(Request::new(2, vec![1; 21], 0, vec![]))
                .is_err()
        );
        s.add_request(Request::new(3, vec![1; 20], 0, vec![]))
            .unwrap();
        let mut chunks = Vec::new();
        while s.request(3).unwrap().num_computed_tokens < 20 {
            let out = s.schedule();
            chunks.push(out.scheduled[0].num_new_tokens);
            assert!(s.update_from_output(&out, &one(HashMap::new())).is_empty());
        }
        assert_eq!(chunks, vec![8, 8, 4]);
        assert!(s.finish_request(3, FinishReason::Stop));
        assert!(!s.has_unfinished());
    }

    /// At most max_loras adapters run at once; the base model does not count; a request whose
    /// adapter waits is not overtaken by later requests with adapters (no starvation), only by
    /// requests for the base model.
    #[test]
    fn a_step_holds_at_most_max_loras_adapters_and_waiting_ones_are_not_starved() {
        let mut s = sched(256, 4, 64, 16);
        s.config.max_loras = 2;
        let lora = |id, l, max| {
            let mut r = Request::new(id, vec![1; 3], max, vec![]);
            r.lora = l;
            r
        };
        // adapters 1 and 2 run; 3 waits; 1 again (after 3) waits too; the base goes on
        s.add_request(lora(1, 1, 4)).unwrap();
        s.add_request(lora(2, 2, 4)).unwrap();
        s.add_request(lora(3, 3, 4)).unwrap();
        s.add_request(lora(4, 1, 4)).unwrap();
        s.add_request(lora(5, 0, 4)).unwrap();
        let mut first_step_of = HashMap::new();
        let mut step = 0;
        while s.has_unfinished() {
            let out = s.schedule();
            assert!(!out.is_empty(), "no progress");
            let running: HashSet<u32> = out
                .scheduled
                .iter()
                .map(|r| s.request(r.id).unwrap().lora)
                .filter(|&l| l != 0)
                .collect();
            assert!(running.len() <= 2, "step {step}: adapters {running:?}");
            for r in &out.scheduled {
                first_step_of.entry(r.id).or_insert(step);
            }
            let sampled = fake_sampled(&out);
            s.update_from_output(&out, &one(sampled));
            step += 1;
        }
        let at = |id| first_step_of[&id];
        assert_eq!((at(1), at(2), at(5)), (0, 0, 0));
        assert!(at(3) > 0 && at(4) >= at(3), "{first_step_of:?}");
    }

    /// A fake model: the next token is a function of the request id and position only, so the
    /// "correct" output of each request is known whatever the batching.
    fn fake_token(id: RequestId, pos: usize) -> u32 {
        ((id as usize * 31 + pos * 7) % 50 + 10) as u32
    }

    /// The fake model's token for every sampled request of a step.
    fn fake_sampled(out: &SchedulerOutput) -> HashMap<RequestId, u32> {
        out.scheduled
            .iter()
            .filter(|r| r.sample)
            .map(|r| {
                (
                    r.id,
                    fake_token(r.id, r.num_computed_tokens + r.num_new_tokens),
                )
            })
            .collect()
    }

    fn run_to_end(s: &mut Scheduler, max_steps: usize) -> usize {
        let mut steps = 0;
        while s.has_unfinished() {
            let out = s.schedule();
            assert!(!out.is_empty(), "no progress possible");
            assert!(out.num_batched_tokens <= s.config.max_num_batched_tokens);
            assert!(out.scheduled.len() <= s.config.max_num_seqs);
            let sampled = fake_sampled(&out);
            s.update_from_output(&out, &one(sampled));
            s.kv.check_invariants();
            steps += 1;
            assert!(steps < max_steps, "did not finish");
        }
        steps
    }

    #[test]
    fn chunked_prefill_and_decode_share_a_step() {
        let mut s = sched(100, 4, 10, 8);
        s.add_request(Request::new(1, vec![1; 3], 5, vec![]))
            .unwrap();
        let out = s.schedule();
        assert_eq!(out.scheduled[0].num_new_tokens, 3);
        assert!(out.scheduled[0].sample);
        s.update_from_output(&out, &one(HashMap::from([(1, 7)])));
        s.add_request(Request::new(2, vec![1; 25], 5, vec![]))
            .unwrap();
        let out = s.schedule();
        // request 1 decodes one token, request 2 gets the rest of the budget as a prompt chunk
        assert_eq!(out.scheduled.len(), 2);
        assert_eq!(
            (out.scheduled[0].id, out.scheduled[0].num_new_tokens),
            (1, 1)
        );
        assert_eq!(
            (out.scheduled[1].id, out.scheduled[1].num_new_tokens),
            (2, 9)
        );
        assert!(
            !out.scheduled[1].sample,
            "a middle prompt chunk samples nothing"
        );
    }

    #[test]
    fn preempts_the_most_recent_and_recomputes() {
        // 6 usable blocks of 4 tokens; three requests of 8 prompt tokens fill them exactly.
        let mut s = sched(7, 4, 100, 8);
        for id in 1..=3 {
            s.add_request(Request::new(id, vec![5; 8], 6, vec![]))
                .unwrap();
        }
        let out = s.schedule();
        assert_eq!(out.scheduled.len(), 3);
        let sampled = HashMap::from([(1, 1), (2, 2), (3, 3)]);
        s.update_from_output(&out, &one(sampled));
        // the next decode needs a new block for each: request 3 (last admitted) is preempted
        let out = s.schedule();
        assert_eq!(out.preempted, vec![3]);
        assert_eq!(s.request(3).unwrap().num_computed_tokens, 0);
        assert_eq!(
            s.request(3).unwrap().output(),
            &[3],
            "its output is kept for recompute"
        );
        assert_eq!(s.num_preemptions(), 1);
        // that step is not run: its requests are scheduled again
        s.step_failed(&out);
        run_to_end(&mut s, 1000);
        assert_eq!(s.kv.pool().num_free(), 6);
    }

    #[test]
    fn a_request_in_flight_is_neither_scheduled_again_nor_preempted() {
        // 6 usable blocks of 4 tokens; prompts of 8 tokens take 2 each
        let mut s = sched(7, 4, 100, 8);
        for id in 1..=2 {
            s.add_request(Request::new(id, vec![5; 8], 4, vec![]))
                .unwrap();
        }
        let a = s.schedule();
        assert_eq!(a.scheduled.len(), 2);
        s.add_request(Request::new(3, vec![6; 8], 4, vec![]))
            .unwrap();
        // while step a runs, only the new request can go
        let b = s.schedule();
        assert_eq!(b.scheduled.iter().map(|r| r.id).collect::<Vec<_>>(), [3]);
        assert_eq!(s.num_in_flight(), 3);
        assert!(s.schedule().is_empty(), "everything is in flight");
        s.update_from_output(&a, &one(HashMap::from([(1, 1), (2, 2)])));
        // request 1 needs a third block and none is free: the victim is request 2, the last
        // admitted one that is not in flight (request 3's step still writes its blocks)
        let c = s.schedule();
        assert_eq!(c.preempted, vec![2]);
        assert_eq!(c.scheduled.iter().map(|r| r.id).collect::<Vec<_>>(), [1]);
        assert_eq!(s.request(3).unwrap().status, RequestStatus::Running);
        s.update_from_output(&b, &one(HashMap::from([(3, 3)])));
        s.update_from_output(&c, &one(HashMap::from([(1, 4)])));
        assert_eq!(s.num_in_flight(), 0);
        run_to_end(&mut s, 100);
        assert_eq!(s.kv.pool().num_free(), 6);
    }

    /// Two requests of 20 tokens cannot be in a pool of 27 blocks together. With two steps in
    /// flight each was admitted while the other ran, and each then preempted itself for want
    /// of blocks, forever (found by the proptest below); now the one that needs blocks waits
    /// for the other's step and preempts it.
    #[test]
    fn requests_that_do_not_fit_together_finish_with_steps_in_flight() {
        for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
            let mut s = sched(28, 1, 9, 3);
            s.config.steps_in_flight = 2;
            s.config.preemption_mode = mode;
            s.kv = KvCacheManager::new(28, 1, false).with_swap_space(14);
            for (i, (p, m)) in [(13, 3), (9, 1), (11, 1), (20, 1), (20, 1)]
                .iter()
                .enumerate()
            {
                s.add_request(Request::new(i as u64, vec![3; *p], *m, vec![]))
                    .unwrap();
            }
            let mut queue: VecDeque<SchedulerOutput> = VecDeque::new();
            let mut steps = 0;
            while s.has_unfinished() {
                let out = s.schedule();
                let stalled = out.is_empty();
                if !stalled {
                    queue.push_back(out);
                }
                if queue.len() == 2 || stalled {
                    let out = queue.pop_front().expect("progress");
                    let sampled = fake_sampled(&out);
                    s.update_from_output(&out, &one(sampled));
                }
                steps += 1;
                assert!(steps < 200, "{mode:?}: no end after {steps} steps");
            }
        }
    }

    #[test]
    fn steps_in_flight_split_the_requests_evenly() {
        let mut s = sched(100, 4, 100, 8);
        s.config.steps_in_flight = 2;
        for id in 1..=5 {
            s.add_request(Request::new(id, vec![5; 3], 4, vec![]))
                .unwrap();
        }
        let ids = |o: &SchedulerOutput| o.scheduled.iter().map(|r| r.id).collect::<Vec<_>>();
        let a = s.schedule();
        let b = s.schedule();
        assert_eq!((ids(&a), ids(&b)), (vec![1, 2, 3], vec![4, 5]));
        s.update_from_output(&a, &one(HashMap::from([(1, 1), (2, 1), (3, 1)])));
        // the next step takes the requests of step a, while b is in flight
        let c = s.schedule();
        assert_eq!(ids(&c), [1, 2, 3]);
    }

    #[test]
    fn swap_preemption_keeps_the_computed_tokens_and_copies_them_back() {
        // as above, with a host pool: request 3 is swapped out, not recomputed
        let cfg = SchedulerConfig {
            max_num_batched_tokens: 100,
            preemption_mode: PreemptionMode::Swap,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(cfg, KvCacheManager::new(7, 4, false).with_swap_space(8));
        for id in 1..=3 {
            s.add_request(Request::new(id, vec![5; 8], 6, vec![]))
                .unwrap();
        }
        let out = s.schedule();
        let table3 = out.scheduled[2].block_table.clone();
        s.update_from_output(&out, &one(HashMap::from([(1, 1), (2, 2), (3, 3)])));
        let out = s.schedule();
        assert_eq!(out.preempted, vec![3]);
        assert_eq!(
            out.swap_out.iter().map(|p| p.0).collect::<Vec<_>>(),
            table3,
            "every block of request 3 goes to the host"
        );
        assert_eq!(s.request(3).unwrap().num_computed_tokens, 8);
        assert_eq!(s.request(3).unwrap().status, RequestStatus::Swapped);
        assert_eq!(s.num_swapped(), 1);
        s.step_failed(&out);
        // it resumes with its blocks copied back and computes only its new token
        let mut resumed = false;
        while s.has_unfinished() {
            let out = s.schedule();
            if let Some(r) = out.scheduled.iter().find(|r| r.id == 3)
                && !out.swap_in.is_empty()
            {
                assert_eq!(out.swap_in.len(), 2);
                assert_eq!(r.num_computed_tokens, 8);
                assert_eq!(r.num_new_tokens, 1);
                resumed = true;
            }
            let sampled = out
                .scheduled
                .iter()
                .filter(|r| r.sample)
                .map(|r| (r.id, 9))
                .collect();
            s.update_from_output(&out, &one(sampled));
            s.kv.check_invariants();
        }
        assert!(resumed);
        assert_eq!(s.request(3).unwrap().output().len(), 6);
        assert_eq!(s.kv.pool().num_free(), 6);
        assert_eq!(s.kv.num_free_host_blocks(), 8);
    }

    #[test]
    fn stop_token_and_length_finish() {
        let mut s = sched(50, 4, 64, 8);
        s.add_request(Request::new(1, vec![1, 2], 10, vec![99]))
            .unwrap();
        s.add_request(Request::new(2, vec![1, 2], 2, vec![99]))
            .unwrap();
        let out = s.schedule();
        let ev = s.update_from_output(&out, &one(HashMap::from([(1, 99), (2, 5)])));
        assert_eq!(ev[0].finished, Some(FinishReason::Stop));
        assert_eq!(ev[1].finished, None);
        let out = s.schedule();
        let ev = s.update_from_output(&out, &one(HashMap::from([(2, 6)])));
        assert_eq!(ev[0].finished, Some(FinishReason::Length));
        assert!(!s.has_unfinished());
        assert_eq!(s.kv.pool().num_free(), 49);
    }

    #[test]
    fn abort_frees_blocks_at_once() {
        let mut s = sched(50, 4, 64, 8);
        s.add_request(Request::new(1, vec![1; 20], 10, vec![]))
            .unwrap();
        let out = s.schedule();
        s.update_from_output(&out, &one(HashMap::from([(1, 3)])));
        assert!(s.kv.pool().num_free() < 49);
        assert!(s.finish_request(1, FinishReason::Abort));
        assert_eq!(s.kv.pool().num_free(), 49);
        assert!(!s.finish_request(1, FinishReason::Abort));
        assert!(s.schedule().is_empty());
    }

    #[test]
    fn static_policy_waits_for_the_longest_request() {
        let cfg = SchedulerConfig {
            max_num_batched_tokens: 100,
            max_num_seqs: 2,
            max_model_len: 1000,
            policy: SchedulingPolicy::Static,
            preemption_mode: PreemptionMode::Recompute,
            steps_in_flight: 1,
            max_loras: usize::MAX,
        };
        let mut s = Scheduler::new(cfg, KvCacheManager::new(100, 4, false));
        s.add_request(Request::new(1, vec![1; 4], 1, vec![]))
            .unwrap();
        s.add_request(Request::new(2, vec![1; 4], 5, vec![]))
            .unwrap();
        s.add_request(Request::new(3, vec![1; 4], 1, vec![]))
            .unwrap();
        let mut step = 0;
        let mut first_step_of_3 = None;
        while s.has_unfinished() {
            let out = s.schedule();
            if out.scheduled.iter().any(|r| r.id == 3) && first_step_of_3.is_none() {
                first_step_of_3 = Some(step);
            }
            let sampled = out.scheduled.iter().map(|r| (r.id, 7)).collect();
            s.update_from_output(&out, &one(sampled));
            step += 1;
        }
        // request 1 ends after step 0, but 3 must wait until 2 (5 tokens: steps 0..=4) ends
        assert_eq!(first_step_of_3, Some(5));
    }

    #[test]
    fn a_cached_prompt_computes_only_its_last_block() {
        let mut s = cached(100, 4, 64);
        let prompt: Vec<u32> = (0..30).collect();
        let req = |id| Request::new(id, prompt.clone(), 2, vec![]).with_cache_root(Some(0));
        s.add_request(req(1)).unwrap();
        run_to_end(&mut s, 100);
        s.add_request(req(2)).unwrap();
        let out = s.schedule();
        assert_eq!(out.scheduled[0].num_computed_tokens, 28);
        assert_eq!(out.scheduled[0].num_new_tokens, 2);
        assert!(out.scheduled[0].sample);
        let st = s.kv().prefix_cache_stats();
        assert_eq!((st.queries, st.hits), (60, 28));
        // a request without a root neither finds nor is counted
        s.add_request(Request::new(3, prompt.clone(), 2, vec![]))
            .unwrap();
        let out = s.schedule();
        let r3 = out.scheduled.iter().find(|r| r.id == 3).unwrap();
        assert_eq!(r3.num_computed_tokens, 0);
        assert_eq!(s.kv().prefix_cache_stats().queries, 60);
    }

    #[test]
    fn requests_admitted_in_one_step_share_their_prompt() {
        let mut s = cached(100, 4, 64);
        let prompt: Vec<u32> = (0..30).collect();
        for id in 1..=2 {
            s.add_request(Request::new(id, prompt.clone(), 3, vec![]).with_cache_root(Some(0)))
                .unwrap();
        }
        let out = s.schedule();
        assert_eq!(out.scheduled[1].num_computed_tokens, 28);
        assert_eq!(
            out.scheduled[0].block_table[..7],
            out.scheduled[1].block_table[..7]
        );
        // 7 shared full blocks and one partial block each
        assert_eq!(s.kv().usage().blocks_used, 9);
        s.kv().check_invariants();
        s.step_failed(&out);
        run_to_end(&mut s, 100);
        assert_eq!(s.kv().pool().num_free(), 99);
    }

    #[test]
    fn a_preempted_request_resumes_from_its_cached_blocks() {
        // 9 usable blocks of 4 tokens; three requests of 8 prompt tokens and 8 outputs
        let mut s = cached(10, 4, 100);
        for id in 1..=3 {
            s.add_request(Request::new(id, vec![id as u32; 8], 8, vec![]).with_cache_root(Some(0)))
                .unwrap();
        }
        let mut preempted_at = None;
        for step in 0.. {
            let out = s.schedule();
            if !out.preempted.is_empty() {
                assert_eq!(out.preempted, vec![3]);
                // its 3 full blocks went to the cached list, tail first; requests 1 and 2 each
                // took one (nothing plain was left): the tail went, the head survives
                assert_eq!(s.kv().pool().num_cached_free(), 1);
                preempted_at = Some(step);
            }
            let sampled = out
                .scheduled
                .iter()
                .filter(|r| r.sample)
                .map(|r| (r.id, 9))
                .collect();
            s.update_from_output(&out, &one(sampled));
            s.kv().check_invariants();
            if !s.has_unfinished() {
                break;
            }
        }
        assert!(preempted_at.is_some());
        // queries: three prompts of 8, then request 3 again with 8 + 5 tokens; hits: its head
        let st = s.kv().prefix_cache_stats();
        assert_eq!((st.queries, st.hits), (8 * 3 + 13, 4));
        assert_eq!(s.request(3).unwrap().output().len(), 8);
    }

    proptest! {
        /// Random arrivals, aborts and a small pool: every request ends with exactly the tokens
        /// the fake model gives it alone, no block is owned twice, and all blocks come back.
        #[test]
        fn any_interleaving_gives_the_same_tokens(
            prompts in proptest::collection::vec((1usize..40, 1usize..12), 1..20),
            aborts in proptest::collection::vec(0u64..20, 0..4),
            blocks in 14usize..40, bs in 1usize..6, budget in 8usize..64, max_seqs in 1usize..8,
            caching in any::<bool>(),
            host_blocks in proptest::option::of(0usize..30),
            depth in 1usize..4,
        ) {
            let mut s = sched(blocks, bs, budget, max_seqs);
            s.config.steps_in_flight = depth;
            s.kv = KvCacheManager::new(blocks, bs, caching);
            if let Some(h) = host_blocks {
                s.config.preemption_mode = PreemptionMode::Swap;
                s.kv = KvCacheManager::new(blocks, bs, caching).with_swap_space(h);
            }
            for (i, (p, m)) in prompts.iter().enumerate() {
                let req = Request::new(i as u64, vec![3; *p], *m, vec![]);
                let _ = s.add_request(req.with_cache_root(caching.then_some(0)));
            }
            // up to `depth` steps in flight (pipeline parallelism), their results applied oldest
            // first; a request is in one of them at most
            let mut queue: VecDeque<SchedulerOutput> = VecDeque::new();
            let mut steps = 0;
            while s.has_unfinished() {
                if steps == 3 {
                    for &a in &aborts { s.finish_request(a, FinishReason::Abort); }
                    if !s.has_unfinished() && queue.is_empty() { break; }
                }
                let mut stalled = true;
                if queue.len() < depth {
                    let out = s.schedule();
                    prop_assert!(out.num_batched_tokens <= budget);
                    for q in &queue {
                        for r in &out.scheduled {
                            prop_assert!(q.scheduled.iter().all(|x| x.id != r.id));
                        }
                    }
                    if !out.is_empty() {
                        queue.push_back(out);
                        stalled = false;
                    } else {
                        prop_assert!(!queue.is_empty(), "no progress possible");
                    }
                }
                // the oldest step's results come back when the queue is full, or when nothing
                // more could be scheduled
                if queue.len() == depth || stalled {
                    let Some(out) = queue.pop_front() else { continue };
                    let sampled = fake_sampled(&out);
                    s.update_from_output(&out, &one(sampled));
                }
                s.kv.check_invariants();
                steps += 1;
                prop_assert!(steps < 5000);
            }
            while let Some(out) = queue.pop_front() {
                s.update_from_output(&out, &one(HashMap::new()));
            }
            prop_assert_eq!(s.num_in_flight(), 0);
            prop_assert_eq!(s.kv.pool().num_free(), blocks - 1);
            for (i, (p, m)) in prompts.iter().enumerate() {
                let Some(r) = s.request(i as u64) else { continue };
                if r.status == RequestStatus::Finished(FinishReason::Abort) { continue; }
                // the context (capped by the pool) may end a request before max_tokens
                let m = (*m).min(s.config().max_model_len - p);
                let want: Vec<u32> = (0..m).map(|k| fake_token(i as u64, p + k)).collect();
                prop_assert_eq!(r.output(), &want[..]);
            }
        }
    }

    /// The fake model's tokens for a step with drafts: each row's token, kept while the draft
    /// before it was right.
    fn fake_verified(out: &SchedulerOutput) -> HashMap<RequestId, Vec<u32>> {
        out.scheduled
            .iter()
            .filter(|r| r.sample)
            .map(|r| {
                let last = r.num_computed_tokens + r.num_new_tokens - r.draft_tokens.len();
                let mut got = Vec::new();
                for i in 0..=r.draft_tokens.len() {
                    let t = fake_token(r.id, last + i);
                    got.push(t);
                    if r.draft_tokens.get(i) != Some(&t) {
                        break;
                    }
                }
                (r.id, got)
            })
            .collect()
    }

    /// Drafts right at some positions and wrong at others, under a tight pool (preemption)
    /// and budget: every request ends with the fake model's tokens, as without drafts, in
    /// fewer steps; the K/V of rejected drafts are recomputed (computed tokens never pass the
    /// known ones).
    #[test]
    fn drafts_keep_the_outputs_and_save_steps() {
        let run = |drafts: bool| {
            let mut s = sched(9, 4, 12, 4);
            for id in 0..4u64 {
                let prompt = vec![1; 3 + id as usize * 2];
                s.add_request(Request::new(id, prompt, 12, vec![])).unwrap();
            }
            let mut steps = 0;
            while s.has_unfinished() {
                if drafts {
                    for id in s.running_ids().to_vec() {
                        let r = s.request(id).unwrap();
                        let next = r.num_tokens();
                        // right, right, wrong, right: 4 drafts
                        let d = (0..4)
                            .map(|i| fake_token(id, next + i) + u32::from(i == 2))
                            .collect();
                        s.set_draft_tokens(id, d);
                    }
                }
                let out = s.schedule();
                assert!(out.num_batched_tokens <= 12);
                for r in &out.scheduled {
                    assert!(
                        r.draft_tokens.is_empty() || r.num_new_tokens == 1 + r.draft_tokens.len()
                    );
                }
                s.update_from_output(&out, &fake_verified(&out));
                for &id in s.running_ids() {
                    let r = s.request(id).unwrap();
                    assert!(r.num_computed_tokens < r.num_tokens());
                }
                s.kv.check_invariants();
                steps += 1;
                assert!(steps < 500);
            }
            let outputs: Vec<Vec<u32>> = (0..4)
                .map(|id| s.request(id).unwrap().output().to_vec())
                .collect();
            (outputs, steps, s.num_preemptions())
        };
        let (plain, plain_steps, _) = run(false);
        let (spec, spec_steps, preempted) = run(true);
        assert_eq!(plain, spec);
        for (id, o) in spec.iter().enumerate() {
            let p = 3 + id * 2;
            let want: Vec<u32> = (0..12).map(|k| fake_token(id as u64, p + k)).collect();
            assert_eq!(o, &want);
        }
        assert!(
            spec_steps < plain_steps,
            "{spec_steps} steps with drafts, {plain_steps} without"
        );
        assert!(preempted > 0, "the pool is meant to force preemption");
    }

    /// A stop token among the kept drafts ends the request there; drafts never reach past
    /// max_tokens.
    #[test]
    fn drafts_stop_at_a_stop_token_and_at_max_tokens() {
        let mut s = sched(100, 4, 64, 4);
        s.add_request(Request::new(1, vec![5; 4], 3, vec![]))
            .unwrap();
        s.add_request(Request::new(2, vec![5; 4], 10, vec![42]))
            .unwrap();
        let out = s.schedule();
        s.update_from_output(&out, &one(HashMap::from([(1, 6), (2, 6)])));
        s.set_draft_tokens(1, vec![7, 8, 9, 10]);
        s.set_draft_tokens(2, vec![7, 42, 9]);
        let out = s.schedule();
        // request 1 has 2 tokens to go: one draft at most
        assert_eq!(out.scheduled[0].draft_tokens, vec![7]);
        assert_eq!(out.scheduled[1].draft_tokens, vec![7, 42, 9]);
        let ev = s.update_from_output(
            &out,
            &HashMap::from([(1, vec![7, 8]), (2, vec![7, 42, 9, 11])]),
        );
        let got: Vec<(RequestId, u32, Option<FinishReason>, usize)> = ev
            .iter()
            .map(|e| (e.id, e.token, e.finished, e.num_output_tokens))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, 7, None, 2),
                (1, 8, Some(FinishReason::Length), 3),
                (2, 7, None, 2),
                (2, 42, Some(FinishReason::Stop), 3),
            ]
        );
        assert!(!s.has_unfinished());
    }
}
