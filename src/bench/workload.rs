//! Workloads: the prompt and output lengths of N requests, drawn from a seed, and the prompts
//! themselves (token ids for the engine, text for a server). No data set is downloaded.
//!
//! Four kinds (`--workload`):
//! - `fixed`: every request has `input_len` prompt tokens and `output_len` output tokens;
//! - `uniform`: lengths uniform over `len·(1−r) ..= len·(1+r)` (`r` = `--range-ratio`, 0.5);
//! - `sharegpt`: a ShareGPT-like long tail: log-normal lengths whose median is `input_len`
//!   (default 100) and `output_len` (default 64), with σ = [`SHAREGPT_SIGMA_INPUT`] and
//!   [`SHAREGPT_SIGMA_OUTPUT`], clamped to `4 ..= max_input_len` (default 10 × the median) and
//!   `4 ..= max_output_len` (default 4 × the median). With the defaults the prompts have a mean
//!   of about 160 tokens and a p99 near 1000; the outputs a mean of about 80 and a p99 near 256;
//! - `prefix`: many requests sharing one of a few long system prompts: request `i` is shared
//!   prefix `i % num_prefixes` (`prefix_len` tokens) then `input_len` tokens of its own, and
//!   `output_len` output tokens (for the prefix cache).

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// σ of ln(prompt length) in the ShareGPT-like workload.
pub const SHAREGPT_SIGMA_INPUT: f64 = 1.0;
/// σ of ln(output length) in the ShareGPT-like workload.
pub const SHAREGPT_SIGMA_OUTPUT: f64 = 0.7;
/// Shortest prompt and output the ShareGPT-like workload draws.
pub const SHAREGPT_MIN_LEN: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    Fixed,
    Uniform,
    Sharegpt,
    Prefix,
}

impl WorkloadKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Fixed => "fixed",
            WorkloadKind::Uniform => "uniform",
            WorkloadKind::Sharegpt => "sharegpt",
            WorkloadKind::Prefix => "prefix",
        }
    }
}

/// A workload, fully resolved (no defaults left open), as written into the JSON results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub kind: WorkloadKind,
    pub num_prompts: usize,
    /// Fixed: the prompt length; uniform: the centre of the range; sharegpt: the median.
    pub input_len: usize,
    /// Fixed: the output length; uniform: the centre of the range; sharegpt: the median.
    pub output_len: usize,
    /// Uniform: half-width of the range as a fraction of the centre.
    pub range_ratio: f64,
    /// Sharegpt: longest prompt drawn.
    pub max_input_len: usize,
    /// Sharegpt: longest output drawn.
    pub max_output_len: usize,
    /// Prefix: the shared prompts every request starts with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_prefixes: Option<SharedPrefixes>,
    pub seed: u64,
}

/// `count` shared prompts of `len` tokens; request `i` starts with prompt `i % count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedPrefixes {
    pub len: usize,
    pub count: usize,
}

/// Mixed into the seed of the shared prefixes, so they are not any request's own tokens.
const PREFIX_SEED: u64 = 0x5052_4546_4958;

/// Request `index`'s prompt of `prompt_len` tokens: its shared prefix (if any) then its own.
pub fn request_tokens(
    prefixes: Option<SharedPrefixes>,
    seed: u64,
    index: usize,
    prompt_len: usize,
    vocab: &[u32],
) -> Vec<u32> {
    match prefixes {
        None => prompt_tokens(seed, index, prompt_len, vocab),
        Some(p) => {
            let head = p.len.min(prompt_len);
            let mut t = prompt_tokens(seed ^ PREFIX_SEED, index % p.count, head, vocab);
            t.extend(prompt_tokens(seed, index, prompt_len - head, vocab));
            t
        }
    }
}

/// As [`request_tokens`], as text for a server (about one token per word).
pub fn request_text(
    prefixes: Option<SharedPrefixes>,
    seed: u64,
    index: usize,
    prompt_len: usize,
) -> String {
    match prefixes {
        None => prompt_text(seed, index, prompt_len),
        Some(p) => {
            let head = p.len.min(prompt_len);
            let own = prompt_text(seed, index, prompt_len - head);
            let shared = prompt_text(seed ^ PREFIX_SEED, index % p.count, head);
            if own.is_empty() {
                shared
            } else {
                format!("{shared} {own}")
            }
        }
    }
}

impl Workload {
    /// A workload with the documented defaults for its kind where a length is not given.
    pub fn new(
        kind: WorkloadKind,
        num_prompts: usize,
        input_len: Option<usize>,
        output_len: Option<usize>,
        seed: u64,
    ) -> Self {
        let (di, d_o) = match kind {
            WorkloadKind::Sharegpt => (100, 64),
            WorkloadKind::Fixed | WorkloadKind::Uniform | WorkloadKind::Prefix => (128, 128),
        };
        let input_len = input_len.unwrap_or(di).max(1);
        let output_len = output_len.unwrap_or(d_o).max(1);
        Workload {
            kind,
            num_prompts,
            input_len,
            output_len,
            range_ratio: 0.5,
            max_input_len: input_len * 10,
            max_output_len: output_len * 4,
            shared_prefixes: None,
            seed,
        }
    }

    /// Draws every request's lengths. The same workload (seed included) gives the same list.
    pub fn generate(&self) -> Vec<RequestLens> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        (0..self.num_prompts)
            .map(|_| match self.kind {
                WorkloadKind::Fixed => RequestLens {
                    prompt_len: self.input_len,
                    output_len: self.output_len,
                },
                WorkloadKind::Prefix => RequestLens {
                    prompt_len: self.shared_prefixes.map_or(0, |p| p.len) + self.input_len,
                    output_len: self.output_len,
                },
                WorkloadKind::Uniform => RequestLens {
                    prompt_len: uniform_around(&mut rng, self.input_len, self.range_ratio),
                    output_len: uniform_around(&mut rng, self.output_len, self.range_ratio),
                },
                WorkloadKind::Sharegpt => RequestLens {
                    prompt_len: log_normal_len(
                        &mut rng,
                        self.input_len,
                        SHAREGPT_SIGMA_INPUT,
                        self.max_input_len,
                    ),
                    output_len: log_normal_len(
                        &mut rng,
                        self.output_len,
                        SHAREGPT_SIGMA_OUTPUT,
                        self.max_output_len,
                    ),
                },
            })
            .collect()
    }
}

/// One request of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestLens {
    pub prompt_len: usize,
    /// Output tokens asked for (`max_tokens`, with EOS ignored so that it is also the count
    /// produced).
    pub output_len: usize,
}

/// A uniform draw in [0, 1) from the top 53 bits.
fn unit(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// An integer uniform over `lo ..= hi`.
fn uniform_int(rng: &mut ChaCha8Rng, lo: usize, hi: usize) -> usize {
    let span = (hi - lo + 1) as f64;
    lo + ((unit(rng) * span) as usize).min(hi - lo)
}

fn uniform_around(rng: &mut ChaCha8Rng, centre: usize, ratio: f64) -> usize {
    let lo = ((centre as f64 * (1.0 - ratio)).round() as usize).max(1);
    let hi = ((centre as f64 * (1.0 + ratio)).round() as usize).max(lo);
    uniform_int(rng, lo, hi)
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1 = 1.0 - unit(rng); // (0, 1]: ln is finite
    let u2 = unit(rng);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn log_normal_len(rng: &mut ChaCha8Rng, median: usize, sigma: f64, cap: usize) -> usize {
    let x = median as f64 * (sigma * normal(rng)).exp();
    let lo = SHAREGPT_MIN_LEN.min(median);
    (x.round() as usize).clamp(lo, cap.max(lo))
}

/// Arrival offsets in seconds for a Poisson process of `rate` requests/s (exponential gaps),
/// starting at 0; all zero when the rate is infinite.
pub fn poisson_arrivals(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    if !rate.is_finite() || rate <= 0.0 {
        return vec![0.0; n];
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xA5A5_5A5A_0F0F_F0F0);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += -(1.0 - unit(&mut rng)).ln() / rate;
            }
            t
        })
        .collect()
}

/// Common English words, each one token (with its leading space) in the BPE vocabularies of
/// Llama-, Qwen- and GPT-style tokenizers, so that a prompt of N words is about N tokens for
/// every server being compared.
#[rustfmt::skip]
pub const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "with", "as", "by", "at",
    "from", "his", "her", "they", "this", "which", "you", "one", "all", "were", "we", "when",
    "there", "can", "an", "your", "their", "said", "each", "she", "do", "how", "will", "up",
    "other", "about", "out", "many", "then", "them", "these", "so", "some", "would", "make",
    "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number",
    "no", "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "its",
    "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part", "over",
    "new", "sound", "take", "only", "little", "work", "know", "place", "year", "live", "back",
    "give", "most", "very", "after", "thing", "our", "just", "name", "good", "sentence", "man",
    "think", "say", "great", "where", "help", "through", "much", "before", "line", "right", "too",
    "mean", "old", "any", "same", "tell", "boy", "follow", "came", "want", "show", "also",
    "around", "form", "three", "small", "set", "put", "end", "does", "another", "well", "large",
    "must", "big", "even", "such", "because", "turn", "here", "why", "ask", "went", "men", "read",
    "need", "land", "different", "home", "us", "move", "try", "kind", "hand", "picture", "again",
    "change", "off", "play", "spell", "air", "away", "animal", "house", "point", "page", "letter",
    "mother", "answer", "found", "study", "still", "learn", "should", "world", "high", "every",
    "near", "add", "food", "between", "own", "below", "country", "plant", "last", "school",
    "father", "keep", "tree", "never", "start", "city", "earth", "eye", "light", "thought", "head",
    "under", "story", "saw", "left", "few", "while", "along", "might", "close", "something",
    "seem", "next", "hard", "open", "example", "begin", "life", "always", "those", "both", "paper",
    "together", "got", "group", "often", "run", "important", "until", "children", "side", "feet",
    "car", "mile", "night", "walk", "white", "sea", "began", "grow", "took", "river", "four",
    "carry", "state", "once", "book", "hear", "stop", "without", "second", "later", "miss", "idea",
    "enough", "eat", "face", "watch", "far", "really", "almost", "let", "above", "girl",
    "sometimes", "mountain", "cut", "young", "talk", "soon", "list", "song", "being", "leave",
    "family",
];

/// Seed of request `index`'s prompt: a function of the workload seed and the index only.
fn prompt_seed(seed: u64, index: usize) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index as u64).wrapping_add(1)
}

/// Request `index`'s prompt as text: `len` words drawn from [`WORDS`], space-separated.
pub fn prompt_text(seed: u64, index: usize, len: usize) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(prompt_seed(seed, index));
    let mut s = String::with_capacity(len * 6);
    for i in 0..len {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[uniform_int(&mut rng, 0, WORDS.len() - 1)]);
    }
    s
}

/// Request `index`'s prompt as exactly `len` token ids drawn from `vocab` (the ids of
/// [`WORDS`] in the model's tokenizer: see [`word_token_ids`]).
pub fn prompt_tokens(seed: u64, index: usize, len: usize, vocab: &[u32]) -> Vec<u32> {
    assert!(!vocab.is_empty(), "no token ids to draw prompts from");
    let mut rng = ChaCha8Rng::seed_from_u64(prompt_seed(seed, index));
    (0..len)
        .map(|_| vocab[uniform_int(&mut rng, 0, vocab.len() - 1)])
        .collect()
}

/// The token ids of [`WORDS`] (with a leading space) under `encode`: words that are one token
/// give that token; the others give their last token. Duplicates are removed.
pub fn word_token_ids(
    mut encode: impl FnMut(&str) -> anyhow::Result<Vec<u32>>,
) -> anyhow::Result<Vec<u32>> {
    let mut ids = Vec::new();
    for w in WORDS {
        if let Some(&id) = encode(&format!(" {w}"))?.last()
            && !ids.contains(&id)
        {
            ids.push(id);
        }
    }
    anyhow::ensure!(!ids.is_empty(), "the tokenizer gives no token for any word");
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::stats::percentile;

    fn sorted(v: impl Iterator<Item = usize>) -> Vec<f64> {
        let mut v: Vec<f64> = v.map(|x| x as f64).collect();
        v.sort_by(f64::total_cmp);
        v
    }

    #[test]
    fn same_seed_same_workload_other_seed_other_workload() {
        for kind in [
            WorkloadKind::Fixed,
            WorkloadKind::Uniform,
            WorkloadKind::Sharegpt,
        ] {
            let w = Workload::new(kind, 300, None, None, 7);
            assert_eq!(w.generate(), w.generate());
            assert_eq!(w.generate().len(), 300);
            if kind != WorkloadKind::Fixed {
                let other = Workload {
                    seed: 8,
                    ..w.clone()
                };
                assert_ne!(w.generate(), other.generate(), "{kind:?}");
            }
        }
        assert_eq!(prompt_text(3, 5, 40), prompt_text(3, 5, 40));
        assert_ne!(prompt_text(3, 5, 40), prompt_text(3, 6, 40));
        assert_eq!(prompt_text(3, 5, 40).split(' ').count(), 40);
        let vocab = [10, 11, 12, 13];
        assert_eq!(
            prompt_tokens(1, 2, 33, &vocab),
            prompt_tokens(1, 2, 33, &vocab)
        );
        assert_eq!(prompt_tokens(1, 2, 33, &vocab).len(), 33);
    }

    #[test]
    fn fixed_is_exact() {
        let w = Workload::new(WorkloadKind::Fixed, 50, Some(17), Some(9), 1);
        assert!(
            w.generate()
                .iter()
                .all(|r| r.prompt_len == 17 && r.output_len == 9)
        );
    }

    #[test]
    fn uniform_covers_its_range_and_nothing_else() {
        let w = Workload::new(WorkloadKind::Uniform, 4000, Some(100), Some(40), 2);
        let reqs = w.generate();
        let p: Vec<usize> = reqs.iter().map(|r| r.prompt_len).collect();
        let o: Vec<usize> = reqs.iter().map(|r| r.output_len).collect();
        assert_eq!(
            (*p.iter().min().unwrap(), *p.iter().max().unwrap()),
            (50, 150)
        );
        assert_eq!(
            (*o.iter().min().unwrap(), *o.iter().max().unwrap()),
            (20, 60)
        );
        let mean = p.iter().sum::<usize>() as f64 / p.len() as f64;
        assert!((mean - 100.0).abs() < 2.0, "mean {mean}");
        // each tenth of the range gets about a tenth of the draws
        for k in 0..10 {
            let n = p
                .iter()
                .filter(|&&x| (50 + k * 10..60 + k * 10).contains(&x))
                .count();
            assert!((300..500).contains(&n), "bucket {k}: {n}");
        }
    }

    #[test]
    fn sharegpt_has_the_documented_median_caps_and_long_tail() {
        let w = Workload::new(WorkloadKind::Sharegpt, 5000, None, None, 3);
        assert_eq!((w.input_len, w.output_len), (100, 64));
        assert_eq!((w.max_input_len, w.max_output_len), (1000, 256));
        let reqs = w.generate();
        let p = sorted(reqs.iter().map(|r| r.prompt_len));
        let o = sorted(reqs.iter().map(|r| r.output_len));
        let (p50, o50) = (percentile(&p, 50.0), percentile(&o, 50.0));
        assert!((p50 - 100.0).abs() <= 6.0, "prompt median {p50}");
        assert!((o50 - 64.0).abs() <= 4.0, "output median {o50}");
        // bounds
        assert!(p[0] >= 4.0 && *p.last().unwrap() <= 1000.0);
        assert!(o[0] >= 4.0 && *o.last().unwrap() <= 256.0);
        // a long tail: the mean is well above the median, p99 is several times the median,
        // and the caps are reached (but rarely)
        let pmean = p.iter().sum::<f64>() / p.len() as f64;
        assert!((145.0..185.0).contains(&pmean), "prompt mean {pmean}");
        assert!(percentile(&p, 99.0) > 6.0 * p50);
        assert!(percentile(&o, 99.0) > 3.0 * o50);
        let capped = p.iter().filter(|&&x| x == 1000.0).count();
        assert!((5..150).contains(&capped), "{capped} prompts at the cap");
        // log-normal: ln(length) has σ close to the documented one (before clamping)
        let ln: Vec<f64> = p
            .iter()
            .filter(|&&x| x > 4.0 && x < 1000.0)
            .map(|x| x.ln())
            .collect();
        let m = ln.iter().sum::<f64>() / ln.len() as f64;
        let sd = (ln.iter().map(|x| (x - m).powi(2)).sum::<f64>() / ln.len() as f64).sqrt();
        assert!((sd - SHAREGPT_SIGMA_INPUT).abs() < 0.1, "σ {sd}");
    }

    #[test]
    fn poisson_gaps_have_the_right_mean() {
        let a = poisson_arrivals(4001, 5.0, 9);
        assert_eq!(a[0], 0.0);
        assert!(a.windows(2).all(|w| w[1] >= w[0]));
        let mean_gap = a[4000] / 4000.0;
        assert!((mean_gap - 0.2).abs() < 0.01, "mean gap {mean_gap}");
        assert_eq!(poisson_arrivals(3, f64::INFINITY, 9), vec![0.0; 3]);
        assert_eq!(a, poisson_arrivals(4001, 5.0, 9));
    }

    #[test]
    fn word_ids_take_one_token_per_word() {
        // a toy tokenizer: one id per word, longer words split in two
        let ids = word_token_ids(|w| {
            let h = w.bytes().map(u32::from).sum::<u32>();
            Ok(if w.len() > 8 { vec![1, h] } else { vec![h] })
        })
        .unwrap();
        assert!(!ids.contains(&1));
        let mut dedup = ids.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), ids.len());
    }
}
