//! Choosing the next token from one row of logits.
//!
//! The order follows vLLM v1 / HF:
//!
//! ```text
//! raw logits ──► log-probs (log_softmax of the raw logits, for the response only)
//!     │
//!     ▼
//! repetition penalty (prompt + output) ─► presence/frequency penalties (output)
//!     │
//!     ├─ greedy ──► argmax (ties: lowest id)
//!     ▼
//! p_i = exp((x_i - x_max) / T)   (one pass; p_max = 1)
//!     ─► top_k ─► top_p ─► min_p ─► draw u ~ U[0,1) from ChaCha8(seed, stream = step)
//! ```
//!
//! The draw depends only on `(seed, step)`, so a seeded request gives the same tokens whatever
//! else is in the batch, and after preemption and recompute.

use std::borrow::Cow;
use std::cmp::Ordering;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

use super::params::SamplingParams;

/// Log-probabilities at one generated position (of the raw model distribution).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token.
    pub token_id: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The `logprobs` most likely tokens and their log-probabilities, most likely first
    /// (ties: lowest id first).
    pub top: Vec<(u32, f32)>,
}

/// The outcome of [`sample`] for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token_id: u32,
    /// Present when `params.logprobs` is `Some`.
    pub logprobs: Option<TokenLogprobs>,
}

/// Chooses the next token of one sequence.
///
/// `logits`: one row of raw model logits `[vocab]`. `prompt_ids` / `output_ids`: the sequence so
/// far (for the penalties; ids outside the vocabulary are ignored). `seed`: the request's seed
/// (the engine draws one when `params.seed` is `None`). `step`: index of this output token
/// (0 for the first generated token).
///
/// `params` should have passed [`SamplingParams::validate`]; out-of-range values do not panic
/// but give unspecified (still deterministic) choices. NaN logits are treated as -inf. An empty
/// row gives token 0.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    prompt_ids: &[u32],
    output_ids: &[u32],
    seed: u64,
    step: usize,
) -> SampledToken {
    let token_id = choose(logits, params, prompt_ids, output_ids, seed, step);
    let logprobs = params
        .logprobs
        .map(|k| raw_logprobs(logits, token_id, k));
    SampledToken { token_id, logprobs }
}

fn choose(
    logits: &[f32],
    params: &SamplingParams,
    prompt_ids: &[u32],
    output_ids: &[u32],
    seed: u64,
    step: usize,
) -> u32 {
    let has_repetition = params.repetition_penalty != 1.0;
    let has_additive = (params.presence_penalty != 0.0 || params.frequency_penalty != 0.0)
        && !output_ids.is_empty();
    let x: Cow<[f32]> = if has_repetition || has_additive {
        Cow::Owned(apply_penalties(logits, params, prompt_ids, output_ids))
    } else {
        Cow::Borrowed(logits)
    };
    let top_k = params.effective_top_k();
    if params.is_greedy() || top_k == Some(1) {
        return argmax(&x);
    }
    sample_random(&x, params, top_k, uniform(seed, step))
}

/// HF/vLLM repetition penalty (each distinct token of prompt + output once: a positive logit is
/// divided by the penalty, a negative one multiplied), then the OpenAI presence and frequency
/// penalties over the output: `logit -= presence * (count > 0) + frequency * count`.
fn apply_penalties(
    logits: &[f32],
    params: &SamplingParams,
    prompt_ids: &[u32],
    output_ids: &[u32],
) -> Vec<f32> {
    let mut x = logits.to_vec();
    let vocab = x.len();
    let rp = params.repetition_penalty;
    if rp != 1.0 {
        // One bit per vocabulary entry: a token seen several times is penalised once.
        let mut seen = vec![0u64; vocab.div_ceil(64)];
        for &id in prompt_ids.iter().chain(output_ids) {
            let i = id as usize;
            if i >= vocab {
                continue;
            }
            let bit = 1u64 << (i % 64);
            if seen[i / 64] & bit != 0 {
                continue;
            }
            seen[i / 64] |= bit;
            let l = x[i];
            x[i] = if l > 0.0 { l / rp } else { l * rp };
        }
    }
    let (presence, frequency) = (params.presence_penalty, params.frequency_penalty);
    if (presence != 0.0 || frequency != 0.0) && !output_ids.is_empty() {
        let mut ids = output_ids.to_vec();
        ids.sort_unstable();
        for run in ids.chunk_by(|a, b| a == b) {
            if let Some(l) = x.get_mut(run[0] as usize) {
                *l -= presence + frequency * run.len() as f32;
            }
        }
    }
    x
}

/// Index of the largest value; ties go to the lowest index, NaN never wins, and a row with
/// nothing above -inf gives 0.
fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// A uniform draw in [0, 1) that depends only on `(seed, step)`.
fn uniform(seed: u64, step: usize) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(step as u64);
    // 53 random bits: every value is exactly representable and < 1.
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Descending probability, then ascending id: a total order, so the result of the selection and
/// sorting below does not depend on the input order.
fn by_prob_desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

fn sample_random(x: &[f32], params: &SamplingParams, top_k: Option<usize>, u: f64) -> u32 {
    let max = x
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let inv_t = 1.0 / params.temperature;
    // Unnormalised probabilities relative to the most likely token (p_max = exp(0) = 1), one
    // pass. Tokens whose probability underflows to 0 (or NaN logits) can never be drawn; leaving
    // them out makes the selections below cheaper and changes nothing else.
    let mut cands: Vec<(f32, u32)> = Vec::with_capacity(x.len());
    for (i, &v) in x.iter().enumerate() {
        let p = ((v - max) * inv_t).exp();
        if p > 0.0 {
            cands.push((p, i as u32));
        }
    }
    if cands.is_empty() {
        // Only -inf/NaN logits, or +inf ones: nothing to normalise.
        return argmax(x);
    }

    if let Some(k) = top_k
        && k < cands.len()
    {
        // O(V) partition instead of a full sort: the first k are the k most likely.
        cands.select_nth_unstable_by(k - 1, by_prob_desc);
        cands.truncate(k);
    }
    if params.top_p < 1.0 {
        let keep = nucleus_len(&mut cands, params.top_p);
        cands.truncate(keep);
    }
    if params.min_p > 0.0 {
        // p / p_max >= min_p, with p_max = 1. The most likely token always stays (min_p <= 1),
        // and since the test is a ratio it is not affected by the renormalisation after
        // top_k / top_p.
        let min_p = params.min_p;
        cands.retain(|&(p, _)| p >= min_p);
        if cands.is_empty() {
            return argmax(x);
        }
    }

    let total: f64 = cands.iter().map(|&(p, _)| f64::from(p)).sum();
    let target = u * total;
    let mut cum = 0.0f64;
    for &(p, id) in &cands {
        cum += f64::from(p);
        if cum > target {
            return id;
        }
    }
    // Rounding put the target at the very end.
    cands.last().map_or(0, |&(_, id)| id)
}

/// Length of the smallest most-likely-first prefix of `cands` whose probability reaches `top_p`
/// of the whole (at least 1). Reorders `cands` so that this prefix comes first, sorted.
///
/// NOTE: instead of sorting the whole vocabulary, it sorts the top `m` candidates (found with an
/// O(V) selection) and grows `m` only when the nucleus is not inside them; the nucleus is
/// usually a few dozen tokens.
fn nucleus_len(cands: &mut [(f32, u32)], top_p: f32) -> usize {
    let n = cands.len();
    if n == 0 {
        return 0;
    }
    let z: f64 = cands.iter().map(|&(p, _)| f64::from(p)).sum();
    let target = f64::from(top_p) * z;
    let mut m = n.min(64);
    loop {
        if m < n {
            cands.select_nth_unstable_by(m - 1, by_prob_desc);
        }
        cands[..m].sort_unstable_by(by_prob_desc);
        let mut cum = 0.0f64;
        for (i, &(p, _)) in cands[..m].iter().enumerate() {
            cum += f64::from(p);
            if cum >= target {
                return i + 1;
            }
        }
        if m == n {
            return n;
        }
        m = m.saturating_mul(8).min(n);
    }
}

/// Log-probabilities of the raw logits: the chosen token's and the `k` largest.
fn raw_logprobs(logits: &[f32], chosen: u32, k: usize) -> TokenLogprobs {
    // NaN counts as -inf; +inf as the largest finite value (so no inf - inf below).
    let clean = |v: f32| {
        if v.is_nan() {
            f32::NEG_INFINITY
        } else {
            v.min(f32::MAX)
        }
    };
    let max = logits
        .iter()
        .map(|&v| clean(v))
        .fold(f32::NEG_INFINITY, f32::max);
    // log Σ exp(l - max), accumulated in f64.
    let log_sum = if max == f32::NEG_INFINITY {
        0.0
    } else {
        let s: f64 = logits
            .iter()
            .map(|&v| f64::from((clean(v) - max).exp()))
            .sum();
        s.ln() as f32
    };
    let logprob = |v: f32| -> f32 {
        if max == f32::NEG_INFINITY {
            // Nothing but -inf: call it uniform rather than NaN.
            -(logits.len() as f32).ln()
        } else {
            clean(v) - max - log_sum
        }
    };

    // The k largest logits, kept sorted (descending, ties by lowest id) in a small vector:
    // one pass, and most entries are rejected by one comparison with the smallest kept.
    let mut top: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &v) in logits.iter().enumerate() {
            let v = clean(v);
            if top.len() == k && top.last().is_some_and(|&(w, _)| v <= w) {
                continue;
            }
            let pos = top.partition_point(|&(w, _)| w >= v);
            top.insert(pos, (v, i as u32));
            top.truncate(k);
        }
    }
    let chosen_logprob = logits
        .get(chosen as usize)
        .map_or(f32::NEG_INFINITY, |&v| logprob(v));
    TokenLogprobs {
        token_id: chosen,
        logprob: chosen_logprob,
        top: top.into_iter().map(|(v, id)| (id, logprob(v))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p.validate().unwrap();
        p
    }

    /// Deterministic pseudo-random logits (a simple LCG, so the test has no RNG dependence).
    fn random_logits(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    fn softmax(x: &[f32], t: f32) -> Vec<f64> {
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = x
            .iter()
            .map(|&v| ((v as f64 - m) / t as f64).exp())
            .collect();
        let z: f64 = e.iter().sum();
        e.into_iter().map(|v| v / z).collect()
    }

    fn frequencies(logits: &[f32], p: &SamplingParams, draws: usize, seed: u64) -> Vec<f64> {
        let mut counts = vec![0usize; logits.len()];
        for step in 0..draws {
            counts[sample(logits, p, &[], &[], seed, step).token_id as usize] += 1;
        }
        counts
            .into_iter()
            .map(|c| c as f64 / draws as f64)
            .collect()
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let g = SamplingParams::greedy();
        assert_eq!(sample(&[0.1, 3.0, -2.0, 2.9], &g, &[], &[], 0, 0).token_id, 1);
        assert_eq!(sample(&[1.0, 5.0, 5.0, 5.0], &g, &[], &[], 0, 0).token_id, 1);
        assert_eq!(sample(&[f32::NAN, -1.0, -3.0], &g, &[], &[], 0, 0).token_id, 1);
        for seed in 0..20 {
            let x = random_logits(1000, seed, 10.0);
            let want = argmax(&x);
            assert_eq!(sample(&x, &g, &[], &[], seed, 3).token_id, want);
            // Independent of seed and step.
            assert_eq!(sample(&x, &g, &[], &[], seed + 1, 9).token_id, want);
        }
    }

    #[test]
    fn top_k_1_and_tiny_top_p_equal_greedy() {
        let k1 = params(|p| {
            p.top_k = 1;
            p.temperature = 1.5;
        });
        let tiny_p = params(|p| {
            p.top_p = 1e-6;
            p.temperature = 1.5;
        });
        for seed in 0..50 {
            let x = random_logits(5000, seed, 3.0);
            let want = argmax(&x);
            for step in 0..5 {
                assert_eq!(sample(&x, &k1, &[], &[], seed, step).token_id, want);
                assert_eq!(sample(&x, &tiny_p, &[], &[], seed, step).token_id, want);
            }
        }
        // Ties: both go to the lowest id, like greedy.
        let x = [0.0, 4.0, 4.0, 1.0];
        for step in 0..20 {
            assert_eq!(sample(&x, &k1, &[], &[], 7, step).token_id, 1);
            assert_eq!(sample(&x, &tiny_p, &[], &[], 7, step).token_id, 1);
        }
    }

    #[test]
    fn draws_depend_only_on_seed_and_step() {
        let x = vec![0.0f32; 1000]; // uniform over 1000 tokens
        let p = SamplingParams::default();
        let a: Vec<u32> = (0..64)
            .map(|s| sample(&x, &p, &[], &[], 42, s).token_id)
            .collect();
        let b: Vec<u32> = (0..64)
            .map(|s| sample(&x, &p, &[], &[], 42, s).token_id)
            .collect();
        assert_eq!(a, b);
        // Out of order (as after preemption) gives the same token per step.
        for s in (0..64).rev() {
            assert_eq!(sample(&x, &p, &[], &[], 42, s).token_id, a[s]);
        }
        let distinct: std::collections::BTreeSet<u32> = a.iter().copied().collect();
        assert!(distinct.len() > 50, "steps should vary: {distinct:?}");
        let c: Vec<u32> = (0..64)
            .map(|s| sample(&x, &p, &[], &[], 43, s).token_id)
            .collect();
        assert_ne!(a, c, "another seed gives other draws");
    }

    /// Binomial tolerance: the empirical frequency of a token of probability p over N draws has
    /// standard deviation sqrt(p (1 - p) / N) (<= 0.0035 for N = 20000). We allow 5 sigma (plus a
    /// little for p near 0); the draws are seeded, so the test is deterministic, and a wrong
    /// distribution (e.g. a missing temperature, which moves the probabilities by > 0.05) fails.
    fn assert_matches(freq: &[f64], want: &[f64], n: usize) {
        for (i, (&f, &p)) in freq.iter().zip(want).enumerate() {
            let sigma = (p * (1.0 - p) / n as f64).sqrt();
            assert!(
                (f - p).abs() <= 5.0 * sigma + 1e-3,
                "token {i}: frequency {f:.4} vs probability {p:.4} (freq {freq:?}, want {want:?})"
            );
        }
    }

    #[test]
    fn frequencies_match_softmax_with_temperature() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 1.5];
        const N: usize = 20_000;
        for (t, seed) in [(1.0f32, 1u64), (0.7, 2), (2.0, 3)] {
            let p = params(|p| p.temperature = t);
            let freq = frequencies(&logits, &p, N, seed);
            assert_matches(&freq, &softmax(&logits, t), N);
        }
    }

    #[test]
    fn top_k_top_p_min_p_exclude_tokens() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 1.5];
        // probabilities at T = 1: [0.164, 0.445, 0.099, 0.022, 0.270] (sorted: 1, 4, 0, 2, 3)
        let full = softmax(&logits, 1.0);
        const N: usize = 20_000;
        let renorm = |keep: &[usize]| -> Vec<f64> {
            let z: f64 = keep.iter().map(|&i| full[i]).sum();
            (0..5)
                .map(|i| if keep.contains(&i) { full[i] / z } else { 0.0 })
                .collect()
        };

        let p = params(|p| p.top_k = 2);
        let freq = frequencies(&logits, &p, N, 11);
        assert_eq!(freq[0] + freq[2] + freq[3], 0.0);
        assert_matches(&freq, &renorm(&[1, 4]), N);

        // 0.445 + 0.270 = 0.715 < 0.8 <= 0.715 + 0.164: the nucleus is {1, 4, 0}.
        let p = params(|p| p.top_p = 0.8);
        let freq = frequencies(&logits, &p, N, 12);
        assert_eq!(freq[2] + freq[3], 0.0);
        assert_matches(&freq, &renorm(&[1, 4, 0]), N);

        // min_p 0.3: threshold 0.3 * 0.445 = 0.134, so tokens 2 (0.099) and 3 go.
        let p = params(|p| p.min_p = 0.3);
        let freq = frequencies(&logits, &p, N, 13);
        assert_eq!(freq[2] + freq[3], 0.0);
        assert_matches(&freq, &renorm(&[1, 4, 0]), N);

        // Combined: top_k 3 keeps {1, 4, 0}; top_p 0.6 over their renormalised probabilities
        // [0.507, 0.307, 0.186] keeps {1, 4}; min_p 0.7 then keeps only {1} (0.270 / 0.445 = 0.61).
        let p = params(|p| {
            p.top_k = 3;
            p.top_p = 0.6;
        });
        let freq = frequencies(&logits, &p, N, 14);
        assert_matches(&freq, &renorm(&[1, 4]), N);
        let p = params(|p| {
            p.top_k = 3;
            p.top_p = 0.6;
            p.min_p = 0.7;
        });
        let freq = frequencies(&logits, &p, 2000, 15);
        assert_eq!(freq[1], 1.0);
    }

    #[test]
    fn top_p_on_a_large_vocab_matches_a_full_sort() {
        // Flat-ish distributions make the nucleus larger than the first window of 64.
        for (seed, scale, top_p) in [(1u64, 0.5f32, 0.9f32), (2, 4.0, 0.95), (3, 0.01, 0.5)] {
            let x = random_logits(151_936, seed, scale);
            let mut cands: Vec<(f32, u32)> = x
                .iter()
                .enumerate()
                .map(|(i, &v)| (v.exp(), i as u32))
                .collect();
            let mut sorted = cands.clone();
            sorted.sort_by(by_prob_desc);
            let z: f64 = sorted.iter().map(|c| c.0 as f64).sum();
            let mut cum = 0.0;
            let want = sorted
                .iter()
                .position(|c| {
                    cum += c.0 as f64;
                    cum >= top_p as f64 * z
                })
                .unwrap()
                + 1;
            let got = nucleus_len(&mut cands, top_p);
            assert!(
                got.abs_diff(want) <= 1,
                "seed {seed}: nucleus {got} vs {want}"
            );
            let mut got_set: Vec<u32> = cands[..got].iter().map(|c| c.1).collect();
            let mut want_set: Vec<u32> = sorted[..got].iter().map(|c| c.1).collect();
            got_set.sort_unstable();
            want_set.sort_unstable();
            assert_eq!(got_set, want_set);
        }
    }

    #[test]
    fn repetition_penalty_changes_the_argmax() {
        let g = |f: fn(&mut SamplingParams)| params(|p| {
            p.temperature = 0.0;
            f(p)
        });
        // Positive logit divided: 2.0 / 1.2 = 1.67 < 1.9.
        let p = g(|p| p.repetition_penalty = 1.2);
        let x = [2.0, 1.9, 0.0];
        assert_eq!(sample(&x, &p, &[], &[], 0, 0).token_id, 0);
        assert_eq!(sample(&x, &p, &[0], &[], 0, 0).token_id, 1);
        assert_eq!(sample(&x, &p, &[], &[0], 0, 0).token_id, 1);
        // Applied once per distinct token: 2.0 / 1.2 (not / 1.2^3) still beats 1.5.
        let x = [2.0, 1.5];
        assert_eq!(sample(&x, &p, &[0, 0], &[0], 0, 0).token_id, 0);
        // Negative logit multiplied: -1.0 * 1.2 = -1.2 < -1.1.
        let x = [-1.0, -1.1];
        assert_eq!(sample(&x, &p, &[0], &[], 0, 0).token_id, 1);
        // A penalty < 1 rewards repetition.
        let p = g(|p| p.repetition_penalty = 0.5);
        assert_eq!(sample(&[1.0, 1.9], &p, &[0], &[], 0, 0).token_id, 0);
        // Ids outside the vocabulary are ignored.
        assert_eq!(sample(&[1.0, 1.9], &p, &[7, 1 << 31], &[9], 0, 0).token_id, 1);
    }

    #[test]
    fn presence_and_frequency_penalties_change_the_argmax() {
        let x = [2.0, 1.5, 1.0];
        let p = params(|p| {
            p.temperature = 0.0;
            p.presence_penalty = 0.6;
        });
        // Output tokens only: the prompt does not count.
        assert_eq!(sample(&x, &p, &[0], &[], 0, 0).token_id, 0);
        assert_eq!(sample(&x, &p, &[], &[0], 0, 0).token_id, 1);
        // Presence does not grow with the count: 2.0 - 0.6 = 1.4 vs 1.5 - 0.6 = 0.9.
        assert_eq!(sample(&x, &p, &[], &[0, 0, 0, 1], 0, 0).token_id, 0);
        let p = params(|p| {
            p.temperature = 0.0;
            p.frequency_penalty = 0.2;
        });
        // 2.0 - 0.2 * 2 = 1.6 > 1.5; 2.0 - 0.2 * 3 = 1.4 < 1.5.
        assert_eq!(sample(&x, &p, &[], &[0, 0], 0, 0).token_id, 0);
        assert_eq!(sample(&x, &p, &[], &[0, 2, 0, 0], 0, 0).token_id, 1);
        // Negative values encourage repetition.
        let p = params(|p| {
            p.temperature = 0.0;
            p.presence_penalty = -1.0;
        });
        assert_eq!(sample(&x, &p, &[], &[2], 0, 0).token_id, 2);
    }

    #[test]
    fn logprobs_are_of_the_raw_distribution() {
        let x = random_logits(10, 5, 4.0);
        let lp = |p: &SamplingParams| sample(&x, p, &[1, 2], &[3], 9, 0).logprobs.unwrap();
        let base = lp(&params(|p| p.logprobs = Some(10)));
        let sum: f64 = base.top.iter().map(|&(_, l)| (l as f64).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-5, "sum {sum}");
        assert_eq!(base.top.len(), 10);
        assert!(base.top.windows(2).all(|w| w[0].1 >= w[1].1));
        // Against a float64 log_softmax.
        let want = softmax(&x, 1.0);
        for &(id, l) in &base.top {
            assert!((l as f64 - want[id as usize].ln()).abs() < 1e-5);
        }
        let chosen = base.token_id as usize;
        assert!((base.logprob as f64 - want[chosen].ln()).abs() < 1e-5);
        // Temperature and penalties change the choice, not the reported log-probs.
        let other = lp(&params(|p| {
            p.logprobs = Some(10);
            p.temperature = 0.3;
            p.repetition_penalty = 1.5;
            p.presence_penalty = 1.0;
        }));
        assert_eq!(other.top, base.top);
        // logprobs = 0: only the chosen token.
        let none = lp(&params(|p| p.logprobs = Some(0)));
        assert!(none.top.is_empty());
        assert!(none.logprob <= 0.0);
        // No logprobs requested: none computed.
        assert!(
            sample(&x, &SamplingParams::default(), &[], &[], 0, 0)
                .logprobs
                .is_none()
        );
    }

    #[test]
    fn logprobs_on_a_large_vocab() {
        let x = random_logits(151_936, 77, 8.0);
        let p = params(|p| {
            p.logprobs = Some(20);
            p.temperature = 0.0;
        });
        let out = sample(&x, &p, &[], &[], 0, 0);
        let lp = out.logprobs.unwrap();
        assert_eq!(lp.top.len(), 20);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let mut idx: Vec<usize> = (0..x.len()).collect();
        idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        let want: Vec<u32> = idx[..20].iter().map(|&i| i as u32).collect();
        assert_eq!(ids, want);
        // Greedy picks the top one, whose log-prob is the first of the list.
        assert_eq!(out.token_id, want[0]);
        assert_eq!(lp.logprob, lp.top[0].1);
        let total: f64 = softmax(&x, 1.0).iter().sum();
        assert!((total - 1.0).abs() < 1e-9);
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        for &(id, l) in &lp.top {
            assert!((l as f64 - (x[id as usize] as f64 - lse)).abs() < 1e-4);
        }
    }

    #[test]
    fn degenerate_rows_do_not_panic() {
        let all = [
            SamplingParams::default(),
            SamplingParams::greedy(),
            params(|p| {
                p.top_k = 3;
                p.top_p = 0.5;
                p.min_p = 0.5;
                p.logprobs = Some(5);
                p.repetition_penalty = 1.3;
                p.frequency_penalty = 1.0;
            }),
        ];
        for p in &all {
            let s = sample(&[], p, &[0], &[1], 0, 0);
            assert_eq!(s.token_id, 0);
            let s = sample(&[f32::NAN; 4], p, &[], &[], 0, 0);
            assert!(s.token_id < 4);
            let s = sample(&[f32::NEG_INFINITY; 4], p, &[], &[], 0, 0);
            assert!(s.token_id < 4);
            if let Some(lp) = s.logprobs {
                assert!(lp.top.iter().all(|t| t.1.is_finite()));
            }
            let s = sample(&[0.0, f32::INFINITY, 1.0], p, &[], &[], 0, 0);
            assert_eq!(s.token_id, 1);
            if let Some(lp) = s.logprobs {
                assert!(!lp.logprob.is_nan());
            }
            // -inf entries (masked tokens) are never drawn.
            let x = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0];
            for step in 0..50 {
                let t = sample(&x, p, &[], &[], 3, step).token_id;
                assert!(t == 1 || t == 3);
            }
        }
        // A tiny but non-zero temperature behaves like greedy without overflow.
        let p = params(|p| p.temperature = 1e-4);
        assert_eq!(sample(&[1.0, 1.001, 0.5], &p, &[], &[], 0, 0).token_id, 1);
    }
}
