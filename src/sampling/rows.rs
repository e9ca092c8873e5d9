//! Sampling as the device does it: a batch's rows each with their parameters as words
//! ([`RowSampling`]) for `Backend::sample_rows`, and what comes back per row ([`Choice`]). The
//! engine builds them from a request's [`super::SamplingParams`]; every backend's sampling
//! kernel is checked against [`RowSampling::edited`] and the host sampler.

use super::sampler::TokenLogprobs;

/// What [`crate::backend::Backend::sample_rows`] brings back for one row.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The token chosen (or scored: [`RowSampling::score`]).
    pub token: u32,
    /// With [`RowSampling::logprobs`]: the raw log-probabilities, as
    /// [`super::sampler::logprobs_of`] gives them.
    pub logprobs: Option<TokenLogprobs>,
    /// With them, the token's rank among all ([`super::sampler::rank_of`]).
    pub rank: u32,
}

impl Choice {
    pub fn token(token: u32) -> Choice {
        Choice {
            token,
            logprobs: None,
            rank: 0,
        }
    }
}

/// How one logits row becomes a token on the device ([`crate::backend::Backend::sample_rows`]), as the host
/// sampler would choose it: its edits (logit bias, banned tokens, penalties), then greedy, or
/// temperature, top-k, top-p and min-p with the host's uniform draw for the row's
/// `(seed, step)`; or a given token scored (`score`). The raw log-probabilities come back where
/// asked. Structured output is not here: rows that need it are sampled on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct RowSampling {
    /// 0: greedy (the argmax, ties to the lowest id).
    pub temperature: f32,
    /// 0: every token.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// The draw u in [0, 1) as 53 bits: u = `u53` / 2^53.
    pub u53: u64,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// The tokens whose logits change before the choice, each once, in increasing order.
    pub edits: Vec<LogitEdit>,
    /// `Some(k)`: the log-probability of the token chosen, its rank, and the `k` (at most
    /// [`super::params::MAX_LOGPROBS`]) most likely tokens' come back too, of the
    /// raw logits (before the edits and the temperature, as vLLM reports them).
    pub logprobs: Option<u32>,
    /// A token to score rather than choose (`prompt_logprobs`: the prompt's next token).
    pub score: Option<u32>,
}

/// What happens to one token's logit before a row is sampled, in this order: `bias` added,
/// set to -inf if `banned`, the repetition penalty if `seen` (in the prompt or the output), the
/// presence and frequency penalties if the output holds it `count` times.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LogitEdit {
    pub token: u32,
    pub bias: f32,
    pub banned: bool,
    pub seen: bool,
    pub count: u32,
}

impl RowSampling {
    pub const GREEDY: RowSampling = RowSampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        u53: 0,
        repetition_penalty: 1.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        edits: Vec::new(),
        logprobs: None,
        score: None,
    };

    pub fn is_greedy(&self) -> bool {
        // NOTE: NaN too (never valid; the kernel takes the argmax then).
        self.temperature.is_nan() || self.temperature <= 0.0 || self.top_k == 1
    }

    /// Greedy on the raw logits, the token alone: what every backend's `argmax_rows` gives.
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy() && self.edits.is_empty() && self.logprobs.is_none() && self.score.is_none()
    }

    /// The sampling kernel's parameter words: temperature, top_k, top_p, min_p (f32 bits), the
    /// draw's low and high words.
    pub fn words(&self) -> [u32; 6] {
        [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.u53 as u32,
            (self.u53 >> 32) as u32,
        ]
    }

    /// The edit kernel's words of this row's edits: row, token, bias, flags (1: banned, 2:
    /// seen), count, then the row's repetition, presence and frequency penalties.
    pub fn edit_words(&self, row: u32) -> impl Iterator<Item = u32> + '_ {
        self.edits.iter().flat_map(move |e| {
            [
                row,
                e.token,
                e.bias.to_bits(),
                u32::from(e.banned) | (u32::from(e.seen) << 1),
                e.count,
                self.repetition_penalty.to_bits(),
                self.presence_penalty.to_bits(),
                self.frequency_penalty.to_bits(),
            ]
        })
    }

    /// `logits` (one row) with the edits applied, as the edit kernel and the host sampler
    /// apply them (f32, in the same order).
    pub fn edited(&self, logits: &[f32]) -> Vec<f32> {
        let mut x = logits.to_vec();
        for e in &self.edits {
            let Some(l) = x.get_mut(e.token as usize) else {
                continue;
            };
            let mut v = *l + e.bias;
            if e.banned {
                v = f32::NEG_INFINITY;
            }
            let rp = self.repetition_penalty;
            if e.seen && rp != 1.0 {
                v = if v > 0.0 { v / rp } else { v * rp };
            }
            if e.count != 0 {
                v -= self.presence_penalty + self.frequency_penalty * e.count as f32;
            }
            *l = v;
        }
        x
    }
}
