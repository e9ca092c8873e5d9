//! Speculative decoding in the engine (n-gram prompt lookup, vLLM's `ngram` method): drafts
//! are proposed before a step, the scheduler gives them to the step as extra query tokens
//! after the last token, every one of those rows gives a token (`complete_step`), and the
//! drafts equal to the token before them are kept with the token after the last kept one.
//!
//! NOTE: a request's output is the same with and without drafts, token for token: each row
//! is sampled as the request's next token would be after the drafts before it (its logit
//! edits, and its seeded draw for that position), and a row's logits do not depend on how many
//! rows of its request (or of others) the step computes (batch invariance: the CPU backend's
//! matmuls, quantized ones included, and its attention compute a row the same way in any
//! batch; `tests/speculative.rs` checks the outputs on the real models). Only requests with
//! structured output decode one token a step: their grammar would have to take the drafts
//! back.

use super::Engine;
use crate::sampling::rows::samples_anywhere;

impl Engine {
    /// Sets this step's drafts: an n-gram lookup over each running request's tokens, or none
    /// (also clearing those proposed for a step that did not run the request).
    pub(super) fn propose_drafts(&mut self) {
        let Some(cfg) = self.speculative else {
            return;
        };
        let on = cfg
            .disable_by_batch_size
            .is_none_or(|b| self.scheduler.num_running() < b);
        for id in self.scheduler.running_ids().to_vec() {
            let (Some(st), Some(req)) = (self.states.get(&id), self.scheduler.request(id)) else {
                continue;
            };
            // NOTE: a grammar's matcher would have to take rejected drafts back.
            let drafts = if on && samples_anywhere(&st.params) {
                cfg.propose(&req.tokens)
            } else {
                Vec::new()
            };
            self.scheduler.set_draft_tokens(id, drafts);
        }
    }
}
