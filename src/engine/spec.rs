//! Speculative decoding in the engine (n-gram prompt lookup, vLLM's `ngram` method): drafts
//! are proposed before a step for the requests whose next tokens are plain argmaxes, the
//! scheduler gives them to the step as extra query tokens after the last token, every one of
//! those rows is reduced to its argmax, and the drafts equal to the argmax before them are
//! kept with the argmax after the last kept one.
//!
//! NOTE: a request's output is the same with and without drafts, token for token: each row's
//! argmax is that of its logits, and a row's logits do not depend on how many rows of its
//! request (or of others) the step computes (batch invariance: the CPU backend's matmuls,
//! quantized ones included, and its attention compute a row the same way in any batch;
//! `tests/speculative.rs` checks the outputs on the real models). Sampled requests, and those
//! whose logits are edited (penalties, logit bias, bad words, `min_tokens`, structured output)
//! or who ask for log-probabilities, decode one token a step as before.

use super::Engine;
use super::request::RequestState;
use crate::sampling::rows::{row_sampling, samples_anywhere};
use crate::sched::Request;

impl Engine {
    /// Sets this step's drafts: an n-gram lookup over each eligible running request's tokens.
    pub(super) fn propose_drafts(&mut self) {
        let Some(cfg) = self.speculative else {
            return;
        };
        if cfg
            .disable_by_batch_size
            .is_some_and(|b| self.scheduler.num_running() >= b)
        {
            return;
        }
        for id in self.scheduler.running_ids().to_vec() {
            let (Some(st), Some(req)) = (self.states.get(&id), self.scheduler.request(id)) else {
                continue;
            };
            if !plain_argmax(st, req, self.config.vocab_size) {
                continue;
            }
            let drafts = cfg.propose(&req.tokens);
            if !drafts.is_empty() {
                self.scheduler.set_draft_tokens(id, drafts);
            }
        }
    }
}

/// Whether every next token of the request, whatever the tokens before it, is the argmax of
/// the raw logits: greedy, and nothing that edits the logits now or may after more output.
fn plain_argmax(st: &RequestState, req: &Request, vocab: usize) -> bool {
    let p = &st.params;
    samples_anywhere(p)
        && st.matcher.is_none()
        && p.repetition_penalty == 1.0
        && p.presence_penalty == 0.0
        && p.frequency_penalty == 0.0
        && st.bad_words.is_empty()
        && req.output().len() >= p.min_tokens
        && row_sampling(p, st.seed, req.prompt(), req.output(), &[], vocab).is_plain_greedy()
}
