//! Choosing the next token from one row of logits.
//!
//! The order follows vLLM v1 / HF:
//!
//! ```text
//! raw logits ──► log-probs (log_softmax of the raw logits, for the response only)
//!     │
//!     ▼
//! logit_bias; tokens banned (min_tokens, bad_words) or not allowed (structured output): -inf
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
    sample_restricted(
        logits,
        params,
        prompt_ids,
        output_ids,
        &Restrict::default(),
        seed,
        step,
    )
}

/// The tokens a sequence may not choose at one step.
#[derive(Debug, Clone, Copy, Default)]
pub struct Restrict<'a> {
    /// These cannot be chosen (the stop tokens before `min_tokens`, a bad word's last token).
    pub banned: &'a [u32],
    /// Only these can be chosen (structured output): a bitmask, bit `i % 32` of word `i / 32`
    /// for token `i`; tokens past its end are not allowed.
    pub allowed: Option<&'a [u32]>,
}

/// [`sample`], restricted to the tokens `restrict` leaves.
pub fn sample_restricted(
    logits: &[f32],
    params: &SamplingParams,
    prompt_ids: &[u32],
    output_ids: &[u32],
    restrict: &Restrict,
    seed: u64,
    step: usize,
) -> SampledToken {
    let x: Cow<[f32]> =
        if params.logit_bias.is_empty() && restrict.banned.is_empty() && restrict.allowed.is_none()
        {
            Cow::Borrowed(logits)
        } else {
            let mut x = logits.to_vec();
            for (&id, &b) in &params.logit_bias {
                if let Some(l) = x.get_mut(id as usize) {
                    *l += b;
                }
            }
            for &id in restrict.banned {
                if let Some(l) = x.get_mut(id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
            if let Some(mask) = restrict.allowed {
                for (i, l) in x.iter_mut().enumerate() {
                    let word = mask.get(i / 32).copied().unwrap_or(0);
                    if word >> (i % 32) & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            Cow::Owned(x)
        };
    let token_id = choose(&x, params, prompt_ids, output_ids, seed, step);
    let logprobs = params.logprobs.map(|k| raw_logprobs(logits, token_id, k));
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
    if params.chooses_argmax() {
        return argmax(&x);
    }
    sample_random(&x, params, params.effective_top_k(), uniform(seed, step))
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
    // Two simple passes (a vectorised max, then a search that stops early) beat one pass that
    // carries the index along.
    let max = max_ignoring_nan(x);
    if max == f32::NEG_INFINITY {
        return 0;
    }
    const BLOCK: usize = 64;
    for (b, block) in x.chunks(BLOCK).enumerate() {
        // No early exit inside a block, so this test vectorises.
        if block.iter().fold(false, |hit, &v| hit | (v == max))
            && let Some(j) = block.iter().position(|&v| v == max)
        {
            return (b * BLOCK + j) as u32;
        }
    }
    0
}

/// A uniform draw in [0, 1) that depends only on `(seed, step)`.
fn uniform(seed: u64, step: usize) -> f64 {
    uniform_bits(seed, step) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The draw of [`uniform`] as 53 bits (u = bits / 2^53): what a device sampler is given, so
/// that it draws with the u the host would.
pub fn uniform_bits(seed: u64, step: usize) -> u64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(step as u64);
    // 53 random bits: every value is exactly representable and < 1.
    rng.next_u64() >> 11
}

/// Thresholds tried (relative to p_max = 1) to find a small candidate set that surely holds the
/// top-p nucleus, before falling back to every token with p > 0.
const NUCLEUS_THRESHOLDS: [f32; 4] = [1e-2, 1e-4, 1e-6, 1e-9];

/// top_k up to this size is found with one pass over a small sorted vector; larger with
/// `select_nth_unstable`.
const SMALL_TOP_K: usize = 64;

fn sample_random(x: &[f32], params: &SamplingParams, top_k: Option<usize>, u: f64) -> u32 {
    let max = max_ignoring_nan(x);
    if !max.is_finite() {
        // Only -inf/NaN logits, or +inf ones: nothing to normalise; take the argmax.
        return argmax(x);
    }
    let inv_t = 1.0 / params.temperature;
    let prob = |v: f32| exp_nonpos((v - max) * inv_t);

    let chosen = match top_k.filter(|&k| k < x.len()) {
        Some(k) => {
            // Select on the logits (same order as the probabilities), then exponentiate only k.
            let cands: Vec<Cand> = top_k_logits(x, k)
                .into_iter()
                .map(|(v, id)| (prob(v), id))
                .filter(|&(p, _)| p > 0.0)
                .map(|(p, id)| Cand::new(p, id))
                .collect();
            let z: f64 = cands.iter().map(|c| f64::from(c.p())).sum();
            draw_candidates(cands, params, f64::from(params.top_p) * z, u)
        }
        None if params.top_p < 1.0 => {
            let p = probs(x, max, inv_t, 0.0);
            let target = f64::from(params.top_p) * sum_f64(&p);
            draw_candidates(top_p_superset(&p, target), params, target, u)
        }
        None => {
            // min_p: p / p_max >= min_p with p_max = 1 (the most likely token always stays).
            let p = probs(x, max, inv_t, params.min_p);
            draw_weights(&p, u).map(|i| i as u32)
        }
    };
    chosen.unwrap_or_else(|| argmax(x))
}

/// Unnormalised probabilities relative to the most likely token, `exp((x - max) / T)` (so
/// p_max = exp(0) = 1 exactly), with those below `min_p` (and NaN logits) set to 0.
///
/// NOTE: kept out of line so that it is compiled as one vectorised loop.
#[inline(never)]
fn probs(x: &[f32], max: f32, inv_t: f32, min_p: f32) -> Vec<f32> {
    x.iter()
        .map(|&v| {
            let q = exp_nonpos((v - max) * inv_t);
            if q >= min_p { q } else { 0.0 }
        })
        .collect()
}

/// A candidate token, packed so that sorting the integers ascending orders by probability
/// descending, then by id ascending (a total order: the result does not depend on the input
/// order). High half: `!p.to_bits()` (for p >= 0 the bits grow with p); low half: the id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Cand(u64);

impl Cand {
    fn new(p: f32, id: u32) -> Self {
        Self((u64::from(!p.to_bits()) << 32) | u64::from(id))
    }

    fn p(self) -> f32 {
        f32::from_bits(!((self.0 >> 32) as u32))
    }

    fn id(self) -> u32 {
        self.0 as u32
    }
}

/// Candidates that surely include the top-p nucleus of `p` (whose most-likely-first prefix must
/// reach `target`), usually far fewer than the vocabulary.
///
/// NOTE: the nucleus is a most-likely-first prefix, so if the tokens with p >= tau already hold
/// `target`, the nucleus is among them, and only those need sorting.
fn top_p_superset(p: &[f32], target: f64) -> Vec<Cand> {
    let tau = NUCLEUS_THRESHOLDS
        .into_iter()
        .find(|&tau| masked_sum_f64(p, tau) >= target)
        .unwrap_or(0.0);
    // Blocks with no candidate (nearly all, for a peaked distribution) are skipped after a
    // vectorised test; inside the others, a branch-free compaction (the test is taken at random,
    // which a branch would mispredict).
    const BLOCK: usize = 64;
    let mut out = Vec::new();
    let mut buf = [Cand(0); BLOCK];
    for (b, block) in p.chunks(BLOCK).enumerate() {
        if !block.iter().fold(false, |hit, &q| hit | (q >= tau)) {
            continue;
        }
        let mut n = 0;
        for (j, &q) in block.iter().enumerate() {
            buf[n] = Cand::new(q, (b * BLOCK + j) as u32);
            n += usize::from(q >= tau && q > 0.0);
        }
        out.extend_from_slice(&buf[..n]);
    }
    out
}

/// Applies top_p (when < 1: the smallest most-likely-first prefix whose mass reaches `target`,
/// at least one token) and min_p to candidates (p relative to p_max = 1).
fn truncate_candidates(mut cands: Vec<Cand>, params: &SamplingParams, target: f64) -> Vec<Cand> {
    if params.top_p < 1.0 {
        cands.sort_unstable();
        let mut cum = 0.0f64;
        let keep = cands
            .iter()
            .position(|c| {
                cum += f64::from(c.p());
                cum >= target
            })
            .map_or(cands.len(), |i| i + 1);
        cands.truncate(keep.max(1));
    }
    if params.min_p > 0.0 {
        // A ratio test, so the renormalisation after top_k / top_p does not affect it.
        let min_p = params.min_p;
        cands.retain(|c| c.p() >= min_p);
    }
    cands
}

/// [`truncate_candidates`], then one draw proportional to p.
fn draw_candidates(cands: Vec<Cand>, params: &SamplingParams, target: f64, u: f64) -> Option<u32> {
    let cands = truncate_candidates(cands, params, target);
    let total: f64 = cands.iter().map(|c| f64::from(c.p())).sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let target = u * total;
    let mut cum = 0.0f64;
    for c in &cands {
        cum += f64::from(c.p());
        if cum > target {
            return Some(c.id());
        }
    }
    // Rounding put the target at the very end.
    cands.last().map(|c| c.id())
}

/// Draws an index with probability proportional to `w` (non-negative; 0 = excluded). `None` when
/// all weights are 0.
///
/// NOTE: block sums first, then a scan inside one block: the long sequential f64 scan over the
/// whole vocabulary would dominate otherwise.
fn draw_weights(w: &[f32], u: f64) -> Option<usize> {
    const BLOCK: usize = 256;
    let block_sums: Vec<f64> = w.chunks(BLOCK).map(sum_f64).collect();
    let total: f64 = block_sums.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let target = u * total;
    let mut cum = 0.0f64;
    for (b, (&s, block)) in block_sums.iter().zip(w.chunks(BLOCK)).enumerate() {
        if cum + s > target {
            let mut c = cum;
            let mut last = None;
            for (j, &p) in block.iter().enumerate() {
                if p > 0.0 {
                    last = Some(b * BLOCK + j);
                    c += f64::from(p);
                    if c > target {
                        return last;
                    }
                }
            }
            // Rounding: the block sum said the target is in here.
            return last;
        }
        cum += s;
    }
    w.iter().rposition(|&p| p > 0.0)
}

/// The `k` largest logits `(logit, id)` (k < len), ties broken towards the lowest id. NaN counts
/// as -inf. Unordered.
fn top_k_logits(x: &[f32], k: usize) -> Vec<(f32, u32)> {
    if k <= SMALL_TOP_K {
        return top_k_small(x, k);
    }
    let mut vals: Vec<f32> = x.iter().map(|&v| nan_to_neg_inf(v)).collect();
    let (_, &mut kth, _) = vals.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let mut out: Vec<(f32, u32)> = Vec::with_capacity(k);
    out.extend(
        x.iter()
            .enumerate()
            .filter(|&(_, &v)| v > kth)
            .map(|(i, &v)| (v, i as u32)),
    );
    // Ties with the k-th value fill the rest, lowest ids first.
    for (i, &v) in x.iter().enumerate() {
        if out.len() >= k {
            break;
        }
        if v == kth {
            out.push((v, i as u32));
        }
    }
    out
}

/// The `k` largest values `(value, id)`, sorted descending (ties: lowest id first), in one pass
/// over a small sorted vector. NaN counts as -inf.
///
/// NOTE: once k values are held, a block of 64 whose (vectorised) max does not beat the k-th is
/// skipped whole; that is nearly every block.
fn top_k_small(x: &[f32], k: usize) -> Vec<(f32, u32)> {
    const BLOCK: usize = 64;
    let mut top: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return top;
    }
    for (b, block) in x.chunks(BLOCK).enumerate() {
        if top.len() == k
            && let Some(&(kth, _)) = top.last()
            && max_ignoring_nan(block) <= kth
        {
            continue;
        }
        for (j, &v) in block.iter().enumerate() {
            let v = nan_to_neg_inf(v);
            if top.len() == k && top.last().is_some_and(|&(w, _)| v <= w) {
                continue;
            }
            // After the equal ones: earlier (lower) ids stay first.
            let pos = top.partition_point(|&(w, _)| w >= v);
            top.insert(pos, (v, (b * BLOCK + j) as u32));
            top.truncate(k);
        }
    }
    top
}

fn nan_to_neg_inf(v: f32) -> f32 {
    if v.is_nan() { f32::NEG_INFINITY } else { v }
}

/// Largest non-NaN value (-inf for an empty or all-NaN row). Eight independent lanes, so the
/// loop vectorises.
fn max_ignoring_nan(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    rest.iter()
        .chain(lanes.iter())
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// Σ w in f64, in eight lanes (deterministic; vectorises).
fn sum_f64(w: &[f32]) -> f64 {
    masked_sum_f64(w, f32::NEG_INFINITY)
}

/// Σ of the `w` that are >= `tau`, in f64, in eight lanes.
fn masked_sum_f64(w: &[f32], tau: f32) -> f64 {
    let mut lanes = [0.0f64; 8];
    let chunks = w.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (s, &v) in lanes.iter_mut().zip(c) {
            *s += if v >= tau { f64::from(v) } else { 0.0 };
        }
    }
    let tail: f64 = rest
        .iter()
        .map(|&v| if v >= tau { f64::from(v) } else { 0.0 })
        .sum();
    lanes.iter().sum::<f64>() + tail
}

/// exp(x) for x <= 0: within about 2 ulp of the exact value for x >= -87, and 0 below -87 (and
/// for NaN). Branch-free and without libm calls, so loops over it vectorise; exp(0) = 1 exactly.
///
/// Cephes' expf scheme: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-7 polynomial,
/// 2^n put in the exponent bits.
#[inline(always)]
fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n * LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to the nearest integer, which lands in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = if x >= -87.0 { x } else { -87.0 }; // also NaN -> -87
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND; // integer in [-126, 0]
    let ni = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let poly = ((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let er = poly * r * r + r + 1.0;
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    if x >= -87.0 { er * scale } else { 0.0 }
}

/// Log-probabilities of the raw logits: the chosen token's and the `k` largest.
/// The log-probability of token `id` under the raw logits (log-softmax, f64 accumulation).
pub fn token_logprob(logits: &[f32], id: u32) -> f32 {
    raw_logprobs(logits, id, 0).logprob
}

/// The log-probability of `token` under `logits` and the `k` most likely tokens' (ties: lowest
/// id first), of the raw distribution.
pub fn logprobs_of(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    raw_logprobs(logits, token, k)
}

/// The rank of `token` under `logits`: 1 + the count of logits above its own (1: the most
/// likely; a token past the row ranks below every finite logit).
pub fn rank_of(logits: &[f32], token: u32) -> u32 {
    let x = logits
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    1 + logits.iter().filter(|&&v| v > x).count() as u32
}

fn raw_logprobs(logits: &[f32], chosen: u32, k: usize) -> TokenLogprobs {
    // NaN counts as -inf; +inf as the largest finite value (so no inf - inf below).
    let clean = |v: f32| nan_to_neg_inf(v).min(f32::MAX);
    let max = max_ignoring_nan(logits).min(f32::MAX);
    // log Σ exp(l - max), accumulated in f64.
    let log_sum = if max == f32::NEG_INFINITY {
        0.0
    } else {
        let e: Vec<f32> = logits.iter().map(|&v| exp_nonpos(clean(v) - max)).collect();
        sum_f64(&e).ln() as f32
    };
    let logprob = |v: f32| -> f32 {
        if max == f32::NEG_INFINITY {
            // Nothing but -inf: call it uniform rather than NaN.
            -(logits.len() as f32).ln()
        } else {
            clean(v) - max - log_sum
        }
    };
    let chosen_logprob = logits
        .get(chosen as usize)
        .map_or(f32::NEG_INFINITY, |&v| logprob(v));
    TokenLogprobs {
        token_id: chosen,
        logprob: chosen_logprob,
        top: top_k_small(logits, k)
            .into_iter()
            .map(|(v, id)| (id, logprob(v)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cmp::Ordering;

    /// Descending probability (or logit), then ascending id: a total order, so selections and
    /// sorts give the same result whatever the input order.
    fn by_prob_desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
        b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
    }

    #[test]
    fn cand_orders_by_probability_then_id() {
        let mut c = [
            Cand::new(0.5, 3),
            Cand::new(1.0, 9),
            Cand::new(0.5, 1),
            Cand::new(1e-30, 0),
            Cand::new(0.75, 2),
        ];
        c.sort_unstable();
        let got: Vec<(f32, u32)> = c.iter().map(|c| (c.p(), c.id())).collect();
        assert_eq!(got, [(1.0, 9), (0.75, 2), (0.5, 1), (0.5, 3), (1e-30, 0)]);
        assert_eq!(Cand::new(0.3, u32::MAX).id(), u32::MAX);
    }

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p.validate().unwrap();
        p
    }

    /// Deterministic pseudo-random logits (a simple LCG, so the test has no RNG dependence).
    fn random_logits(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
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
        assert_eq!(
            sample(&[0.1, 3.0, -2.0, 2.9], &g, &[], &[], 0, 0).token_id,
            1
        );
        assert_eq!(
            sample(&[1.0, 5.0, 5.0, 5.0], &g, &[], &[], 0, 0).token_id,
            1
        );
        assert_eq!(
            sample(&[f32::NAN, -1.0, -3.0], &g, &[], &[], 0, 0).token_id,
            1
        );
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
        // From peaked to flat: the nucleus ranges from a few tokens to most of the vocabulary,
        // which exercises every threshold of the candidate pre-filter.
        for (seed, scale, top_p) in [
            (1u64, 0.5f32, 0.9f32),
            (2, 4.0, 0.95),
            (3, 0.01, 0.5),
            (4, 20.0, 0.9),
            (5, 40.0, 0.5),
            (6, 200.0, 0.99),
            (7, 1000.0, 0.999),
        ] {
            let x = random_logits(151_936, seed, scale);
            let max = max_ignoring_nan(&x);
            let p: Vec<f32> = x.iter().map(|&v| exp_nonpos(v - max)).collect();
            let target = top_p as f64 * sum_f64(&p);
            let sup = top_p_superset(&p, target);
            let nucleus: Vec<(f32, u32)> =
                truncate_candidates(sup.clone(), &params(|q| q.top_p = top_p), target)
                    .into_iter()
                    .map(|c| (c.p(), c.id()))
                    .collect();

            let mut sorted: Vec<(f32, u32)> =
                p.iter().enumerate().map(|(i, &q)| (q, i as u32)).collect();
            sorted.sort_by(by_prob_desc);
            let mut cum = 0.0;
            let want = sorted
                .iter()
                .position(|c| {
                    cum += c.0 as f64;
                    cum >= target
                })
                .unwrap()
                + 1;
            assert!(
                nucleus.len().abs_diff(want) <= 1,
                "seed {seed}: nucleus {} vs {want} (pre-filter kept {})",
                nucleus.len(),
                sup.len()
            );
            let n = nucleus.len().min(want);
            assert_eq!(nucleus[..n], sorted[..n], "seed {seed}");
        }
    }

    #[test]
    fn exp_nonpos_is_accurate() {
        let mut worst = 0.0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let want = (x as f64).exp();
            let got = exp_nonpos(x) as f64;
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 3e-7, "max relative error {worst}");
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(-0.0), 1.0);
        assert_eq!(exp_nonpos(-88.0), 0.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos(f32::NAN), 0.0);
    }

    #[test]
    fn top_k_selection_breaks_ties_by_lowest_id() {
        let x: Vec<f32> = (0..1000).map(|i| ((i * 7) % 10) as f32).collect();
        for k in [1, 5, 64, 65, 150, 999] {
            let mut got = top_k_logits(&x, k);
            got.sort_by(by_prob_desc);
            let mut want: Vec<(f32, u32)> =
                x.iter().enumerate().map(|(i, &v)| (v, i as u32)).collect();
            want.sort_by(by_prob_desc);
            want.truncate(k);
            assert_eq!(got, want, "k = {k}");
        }
    }

    #[test]
    fn repetition_penalty_changes_the_argmax() {
        let g = |f: fn(&mut SamplingParams)| {
            params(|p| {
                p.temperature = 0.0;
                f(p)
            })
        };
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
        assert_eq!(
            sample(&[1.0, 1.9], &p, &[7, 1 << 31], &[9], 0, 0).token_id,
            1
        );
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
            p.presence_penalty = -1.5;
        });
        assert_eq!(sample(&x, &p, &[], &[2], 0, 0).token_id, 2);
    }

    #[test]
    fn logit_bias_and_banned_tokens() {
        let x = [3.0, 2.0, 1.0, 0.0];
        let g = SamplingParams::greedy();
        let mut p = g.clone();
        p.logit_bias.insert(3, 3.5);
        assert_eq!(sample(&x, &p, &[], &[], 0, 0).token_id, 3);
        p.logit_bias.insert(3, -100.0);
        assert_eq!(sample(&x, &p, &[], &[], 0, 0).token_id, 0);
        let ban = |banned| Restrict {
            banned,
            allowed: None,
        };
        assert_eq!(
            sample_restricted(&x, &g, &[], &[], &ban(&[0, 1]), 0, 0).token_id,
            2
        );
        // Only tokens 1 and 3 allowed (bits 1 and 3).
        let allowed = Restrict {
            banned: &[],
            allowed: Some(&[0b1010]),
        };
        assert_eq!(
            sample_restricted(&x, &g, &[], &[], &allowed, 0, 0).token_id,
            1
        );
        // Ids outside the row are ignored; log-probs stay those of the raw logits.
        let mut p = g.clone();
        p.logprobs = Some(0);
        let t = sample_restricted(&x, &p, &[], &[], &ban(&[0, 99]), 0, 0);
        assert_eq!(t.token_id, 1);
        assert_eq!(t.logprobs.unwrap().logprob, token_logprob(&x, 1));
        // Sampled (not greedy) draws never pick a banned token.
        let p = SamplingParams {
            seed: Some(1),
            ..Default::default()
        };
        for step in 0..200 {
            let t = sample_restricted(&x, &p, &[], &[], &ban(&[0, 2]), 1, step).token_id;
            assert!(t == 1 || t == 3, "{t}");
        }
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

    /// Timings on a Qwen-sized vocabulary: `cargo test --lib --release bench_ -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn bench_large_vocab() {
        let x = random_logits(151_936, 1, 12.0);
        let cases: [(&str, SamplingParams); 6] = [
            ("greedy", SamplingParams::greedy()),
            ("T=1", SamplingParams::default()),
            ("top_k=50", params(|p| p.top_k = 50)),
            ("top_p=0.9", params(|p| p.top_p = 0.9)),
            (
                "top_k=50 top_p=0.9 min_p=0.05",
                params(|p| {
                    p.top_k = 50;
                    p.top_p = 0.9;
                    p.min_p = 0.05;
                }),
            ),
            (
                "penalties+logprobs=5",
                params(|p| {
                    p.repetition_penalty = 1.1;
                    p.frequency_penalty = 0.5;
                    p.logprobs = Some(5);
                }),
            ),
        ];
        let prompt: Vec<u32> = (0..2000).map(|i| i * 37 % 151_936).collect();
        // Closer to a language model: a bulk far below a few dozen plausible tokens.
        let mut peaked = random_logits(151_936, 2, 3.0);
        for i in 0..40 {
            peaked[i * 3701] = 22.0 - 0.3 * i as f32;
        }
        let output: Vec<u32> = (0..500).map(|i| i * 101 % 151_936).collect();
        for (logits, kind) in [(&peaked, "peaked"), (&x, "flat")] {
            for (name, p) in &cases {
                let n = 200;
                let t = std::time::Instant::now();
                for step in 0..n {
                    std::hint::black_box(sample(logits, p, &prompt, &output, 7, step));
                }
                let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
                println!("{kind:6} {name:32} {us:8.1} us/token");
            }
        }
    }
}
