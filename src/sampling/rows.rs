//! Sampling as the device does it: a batch's rows each with their parameters as words
//! ([`RowSampling`]) for `Backend::sample_rows`, and what comes back per row ([`Choice`]). The
//! engine builds them from a request's [`super::SamplingParams`]; every backend's sampling
//! kernel is checked against [`RowSampling::edited`] and the host sampler.

use super::SamplingParams;
use super::sampler::{TokenLogprobs, uniform_bits};
use std::collections::HashMap;

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

/// Whether a request's next token can be chosen where the logits are ([`RowSampling`]: the
/// host sampler's logit bias, banned tokens and penalties, then greedy or its temperature,
/// top-k, top-p and min-p with its draw, and the raw log-probabilities): no structured output,
/// whose grammar is on the host.
pub fn samples_anywhere(p: &SamplingParams) -> bool {
    p.structured.is_none()
}

/// How a request that [`samples_anywhere`] chooses its next token, as the host sampler would:
/// the edits of its logit bias, the tokens it may not choose yet (`banned`) and its penalties
/// over `prompt` and `output` (tokens past `vocab` ignored), then greedy (also top-k 1) as the
/// argmax, or a draw of `(seed, step)` with `step` the output's length; the log-probabilities
/// it asks for, or the chosen token's alone where `best_of` ranks its sequences by them.
pub fn row_sampling(
    p: &SamplingParams,
    seed: u64,
    prompt: &[u32],
    output: &[u32],
    banned: &[u32],
    vocab: usize,
) -> RowSampling {
    let mut edits: HashMap<u32, LogitEdit> = HashMap::new();
    fn edit(edits: &mut HashMap<u32, LogitEdit>, t: u32) -> &mut LogitEdit {
        edits.entry(t).or_insert(LogitEdit {
            token: t,
            ..Default::default()
        })
    }
    for (&t, &b) in &p.logit_bias {
        edit(&mut edits, t).bias += b;
    }
    for &t in banned {
        edit(&mut edits, t).banned = true;
    }
    if p.repetition_penalty != 1.0 {
        for &t in prompt.iter().chain(output) {
            edit(&mut edits, t).seen = true;
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        for &t in output {
            edit(&mut edits, t).count += 1;
        }
    }
    let mut edits: Vec<LogitEdit> = edits
        .into_values()
        .filter(|e| (e.token as usize) < vocab)
        .collect();
    edits.sort_unstable_by_key(|e| e.token);
    let mut row = RowSampling {
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        edits,
        logprobs: p
            .logprobs
            .or((p.best_of() > p.n).then_some(0))
            .map(|k| k as u32),
        ..RowSampling::GREEDY
    };
    if !p.chooses_argmax() {
        row.temperature = p.temperature;
        row.top_k = p
            .effective_top_k()
            .map_or(0, |k| k.min(u32::MAX as usize) as u32);
        row.top_p = p.top_p;
        row.min_p = p.min_p;
        row.u53 = uniform_bits(seed, output.len());
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Restrict;
    use crate::sampling::sampler::sample_restricted;
    use rand_chacha::ChaCha8Rng;
    use rand_chacha::rand_core::{Rng, SeedableRng};

    /// The edits a row carries to the device, applied as the kernel applies them, choose the
    /// token the host sampler chooses for a greedy request with the same bias, bans and
    /// penalties (tokens past the vocabulary ignored by both).
    #[test]
    fn device_edits_give_the_host_samplers_greedy_choice() {
        let mut r = ChaCha8Rng::seed_from_u64(4);
        let vocab = 300;
        let mut differs = 0;
        for trial in 0..300 {
            let logits: Vec<f32> = (0..vocab)
                .map(|_| (r.next_u32() % 2000) as f32 / 250.0 - 4.0)
                .collect();
            let mut ids = |n: usize| -> Vec<u32> {
                (0..n).map(|_| r.next_u32() % (vocab as u32 + 5)).collect()
            };
            let (prompt, output, banned) = (ids(40), ids(trial % 30), ids(trial % 3));
            let mut params = SamplingParams {
                repetition_penalty: [1.0, 1.3, 0.8][trial % 3],
                presence_penalty: [0.0, 0.5, -0.4][trial % 3],
                frequency_penalty: [0.3, 0.0, 0.2][trial % 3],
                ..SamplingParams::greedy()
            };
            for t in ids(trial % 4) {
                params.logit_bias.insert(t, 2.5);
            }
            let row = row_sampling(&params, 1, &prompt, &output, &banned, vocab);
            assert!(row.is_greedy());
            let device = crate::backend::argmax(&row.edited(&logits)) as u32;
            let restrict = Restrict {
                banned: &banned,
                allowed: None,
            };
            let host = sample_restricted(&logits, &params, &prompt, &output, &restrict, 1, 0);
            assert_eq!(device, host.token_id, "trial {trial}");
            differs += usize::from(device != crate::backend::argmax(&logits) as u32);
        }
        assert!(
            differs > 100,
            "the edits changed only {differs} of 300 choices"
        );
    }
}
