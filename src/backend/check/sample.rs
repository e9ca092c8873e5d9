//! Choosing tokens where the logits are: `argmax_rows`, and `sample_rows` sampling (edits,
//! temperature, top-k, top-p, min-p, the draw) and log-probabilities.

use super::util::rand_vec;
use crate::backend::Backend;
use crate::sampling::sampler::{logprobs_of, rank_of};
use crate::sampling::{Choice, LogitEdit, RowSampling};
use anyhow::Result;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::Rng;

pub(super) struct Argmax {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) logits: Vec<f32>,
}

impl Argmax {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let Argmax { rows, cols, logits } = self;
        let lb = be.upload_f32(logits)?;
        let ids = be.argmax_rows(&lb, *rows, *cols)?;
        Ok(ids.into_iter().map(|i| i as f32).collect())
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let Argmax { rows, cols, logits } = self;
        (0..*rows)
            .map(|r| crate::backend::argmax(&logits[r * cols..(r + 1) * cols]) as f64)
            .collect()
    }
}

/// Random sampling on the device (`sample_rows`): one token per row, each row with its
/// own temperature, top-k, top-p, min-p and draw.
pub(super) struct Sample {
    pub(super) cols: usize,
    pub(super) logits: Vec<f32>,
    pub(super) rows: Vec<RowSampling>,
}

impl Sample {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let Sample { cols, logits, rows } = self;
        let mut lb = be.upload_f32(logits)?;
        let choices = be.sample_rows(&mut lb, *cols, rows)?;
        Ok(choices.into_iter().map(|c| c.token as f32).collect())
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let Sample { cols, logits, rows } = self;
        logits
            .chunks(*cols)
            .zip(rows)
            .map(|(x, s)| sample_reference(&s.edited(x), s).0 as f64)
            .collect()
    }
}

/// Log-probabilities on the device (`sample_rows` with [`RowSampling::logprobs`]), of rows
/// sampled, greedy, edited or given a token to score: the tokens and ranks (`ids`, exact)
/// or the log-probabilities (f32's tolerance), of the same rows.
pub(super) struct Logprobs {
    pub(super) cols: usize,
    pub(super) logits: Vec<f32>,
    pub(super) rows: Vec<RowSampling>,
    pub(super) ids: bool,
}

impl Logprobs {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let Logprobs {
            cols,
            logits,
            rows,
            ids,
        } = self;
        let mut lb = be.upload_f32(logits)?;
        let words = logprob_words(&be.sample_rows(&mut lb, *cols, rows)?, *ids);
        Ok(words.into_iter().map(|v| v as f32).collect())
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let Logprobs {
            cols,
            logits,
            rows,
            ids,
        } = self;
        let choices: Vec<Choice> = logits
            .chunks(*cols)
            .zip(rows)
            .map(|(x, s)| {
                let token = s
                    .score
                    .unwrap_or_else(|| sample_reference(&s.edited(x), s).0 as u32);
                Choice {
                    token,
                    logprobs: s.logprobs.map(|k| logprobs_of(x, token, k as usize)),
                    rank: rank_of(x, token),
                }
            })
            .collect();
        logprob_words(&choices, *ids)
    }
}

/// The token the device sampler must draw from `x`, from the definitions in f64 (a sort, no
/// radix select, no integers): top-k on the logits (ties: lowest ids), top-p over what is left
/// most likely first, min-p, then the draw over what is left in id order. Tokens below 2^-40 of
/// the most likely one are out, as on the device. Also returns how close the row came to a
/// boundary (a top-p cut or the draw's edges, relative to the mass; a min-p test, relative to
/// min-p): a case keeps its rows only where that margin leaves f32 rounding no say.
fn sample_reference(x: &[f32], s: &RowSampling) -> (usize, f64) {
    let max = x
        .iter()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if s.is_greedy() || !max.is_finite() {
        return (crate::backend::argmax(x), f64::INFINITY);
    }
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    let p: Vec<f64> = x
        .iter()
        .map(|&v| {
            let q = ((f64::from(key(v)) - f64::from(max)) / f64::from(s.temperature)).exp();
            if q >= 2f64.powi(-40) { q } else { 0.0 }
        })
        .collect();
    let mut keep: Vec<usize> = (0..x.len()).collect();
    keep.sort_by(|&a, &b| key(x[b]).total_cmp(&key(x[a])).then(a.cmp(&b)));
    if s.top_k > 0 {
        keep.truncate(s.top_k as usize);
    }
    let mut margin = f64::INFINITY;
    if s.top_p < 1.0 {
        let z: f64 = keep.iter().map(|&i| p[i]).sum();
        let target = f64::from(s.top_p) * z;
        let mut cum = 0.0;
        let mut cut = keep.len();
        for (j, &i) in keep.iter().enumerate() {
            let before = cum;
            cum += p[i];
            if cum >= target && p[i] > 0.0 {
                margin = margin.min((cum - target).min(target - before) / z);
                cut = j + 1;
                break;
            }
        }
        keep.truncate(cut);
    }
    if s.min_p > 0.0 {
        for &i in &keep {
            margin = margin.min((p[i] / f64::from(s.min_p) - 1.0).abs());
        }
        keep.retain(|&i| p[i] >= f64::from(s.min_p));
    }
    keep.retain(|&i| p[i] > 0.0);
    keep.sort_unstable();
    let total: f64 = keep.iter().map(|&i| p[i]).sum();
    let t = s.u53 as f64 / (1u64 << 53) as f64 * total;
    let mut cum = 0.0;
    for &i in &keep {
        let before = cum;
        cum += p[i];
        if cum > t {
            return (i, margin.min((t - before).min(cum - t) / total));
        }
    }
    (crate::backend::argmax(x), 0.0)
}

/// How far a sampling case keeps each row from a boundary. The device's probabilities are within
/// about 2e-6 of the exact ones (expf of an argument rounded in f32, up to 13 in magnitude
/// here), so their sums are too.
const SAMPLE_MARGIN: f64 = 5e-6;

/// Edits of a row `x` that change its choice: its 12 most likely tokens raised to a head
/// (2 to 0 above the rest, so that the penalties leave them in the running), all seen (the
/// repetition penalty), some in the output once or twice (presence and frequency), the most
/// likely banned, two biased (+0.5, -1), and 5 tokens anywhere biased by -4; half of the rows
/// shifted below 0.
fn sample_edits(r: &mut ChaCha8Rng, x: &mut [f32]) -> Vec<LogitEdit> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    let top = x[order[0]];
    for (j, &i) in order.iter().take(12).enumerate() {
        x[i] = top + 2.0 - 0.17 * j as f32;
    }
    // half of the rows entirely negative, where the repetition penalty multiplies
    if r.next_u32().is_multiple_of(2) {
        x.iter_mut().for_each(|v| *v -= top + 3.0);
    }
    let mut edits: Vec<LogitEdit> = (0..12.min(x.len()))
        .map(|j| LogitEdit {
            token: order[j] as u32,
            bias: [0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, -1.0][j % 8],
            banned: j == 0,
            seen: true,
            count: j as u32 % 3,
        })
        .collect();
    for _ in 0..5 {
        let token = r.next_u32() % x.len() as u32;
        if !edits.iter().any(|e| e.token == token) {
            edits.push(LogitEdit {
                token,
                bias: -4.0,
                ..Default::default()
            });
        }
    }
    edits.sort_unstable_by_key(|e| e.token);
    edits
}

/// A `sample_rows` case: `rows` over random logits in [-scale, scale] with `cols` columns
/// (`ties` tokens of each row given the row's largest logit; a row whose template has edits
/// gets [`sample_edits`] of its logits), each row's draw and logits drawn again until the row is
/// [`SAMPLE_MARGIN`] away from every boundary.
fn sample_case(
    r: &mut ChaCha8Rng,
    cols: usize,
    scale: f32,
    ties: usize,
    rows: &[RowSampling],
) -> Sample {
    let mut logits = Vec::with_capacity(rows.len() * cols);
    let mut out = Vec::with_capacity(rows.len());
    for s in rows {
        let mut s = s.clone();
        let row = loop {
            let mut x: Vec<f32> = rand_vec(r, cols).iter().map(|v| v * scale).collect();
            let top = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            for j in 0..ties {
                x[(j * 7919 + 13) % cols] = top;
            }
            if !s.edits.is_empty() {
                s.edits = sample_edits(r, &mut x);
            }
            s.u53 = r.next_u64() >> 11;
            if sample_reference(&s.edited(&x), &s).1 > SAMPLE_MARGIN {
                break x;
            }
        };
        logits.extend(row);
        out.push(s);
    }
    Sample {
        cols,
        logits,
        rows: out,
    }
}

/// What a [`Logprobs`] compares of each row: the token, its rank and the top tokens
/// (`ids`), or the token's log-probability and the top ones'. A row without log-probabilities
/// gives its token alone.
fn logprob_words(choices: &[Choice], ids: bool) -> Vec<f64> {
    let mut out = Vec::new();
    for c in choices {
        match (&c.logprobs, ids) {
            (None, _) => out.push(c.token as f64),
            (Some(lp), true) => {
                out.extend([c.token as f64, c.rank as f64, lp.top.len() as f64]);
                out.extend(lp.top.iter().map(|t| t.0 as f64));
            }
            (Some(lp), false) => {
                out.push(lp.logprob as f64);
                out.extend(lp.top.iter().map(|t| t.1 as f64));
            }
        }
    }
    out
}

/// The two [`Logprobs`] of `rows` made by [`sample_case`] (its margins keep the draws
/// clear of f32 rounding), each asking for its own count of top log-probabilities.
fn logprobs_cases(
    r: &mut ChaCha8Rng,
    cols: usize,
    scale: f32,
    ties: usize,
    rows: &[RowSampling],
) -> [Logprobs; 2] {
    let Sample { logits, rows, .. } = sample_case(r, cols, scale, ties, rows);
    let case = |ids| Logprobs {
        cols,
        logits: logits.clone(),
        rows: rows.clone(),
        ids,
    };
    [case(true), case(false)]
}

/// The table's rows of this family, drawn from `r` in order.
pub(super) fn cases<C: From<Argmax> + From<Sample> + From<Logprobs>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
    // argmax: random rows, plus a row of ties, a row with NaN and -inf, and a row where
    // nothing beats -inf
    let (rows, cols) = (5, 50_000);
    let mut logits = rand_vec(r, rows * cols);
    for v in &mut logits[cols..2 * cols] {
        *v = 1.0;
    }
    logits[2 * cols] = f32::NAN;
    logits[2 * cols + 1] = f32::NEG_INFINITY;
    logits[3 * cols - 2] = 7.0;
    for (i, v) in logits[4 * cols..].iter_mut().enumerate() {
        *v = if i % 3 == 1 {
            f32::NAN
        } else {
            f32::NEG_INFINITY
        };
    }
    out.push((
        "argmax".into(),
        format!("{rows}x{cols} (ties, NaN)"),
        0.0,
        C::from(Argmax { rows, cols, logits }),
    ));
    // sampling on the device: each stage alone and together, ties across the top-k and top-p
    // cuts, greedy and top-k 1 rows among random ones, a peaked row; then many small rows
    let row = |temperature: f32, top_k: u32, top_p: f32, min_p: f32| RowSampling {
        temperature,
        top_k,
        top_p,
        min_p,
        ..RowSampling::GREEDY
    };
    // edits made for each row by `sample_case`, with these penalties
    let edited = |s: RowSampling, repetition: f32, presence: f32, frequency: f32| RowSampling {
        repetition_penalty: repetition,
        presence_penalty: presence,
        frequency_penalty: frequency,
        edits: vec![LogitEdit::default()],
        ..s
    };
    let cols = 50_000;
    let rows = [
        row(1.0, 0, 1.0, 0.0),
        row(0.7, 50, 1.0, 0.0),
        row(1.3, 0, 0.9, 0.0),
        row(0.9, 0, 1.0, 0.1),
        row(0.8, 1000, 0.8, 0.05),
        RowSampling::GREEDY,
        row(1.0, 1, 1.0, 0.0),
        row(2.0, 200, 0.95, 0.01),
        edited(RowSampling::GREEDY, 1.3, 0.5, 0.2),
        edited(row(0.8, 50, 1.0, 0.0), 1.2, 0.3, 0.1),
        edited(row(1.0, 0, 0.9, 0.0), 1.0, 0.0, 0.0),
    ];
    out.push((
        "sample".into(),
        format!(
            "{}x{cols}: T, top-k, top-p, min-p, greedy, bias, bans, penalties",
            rows.len()
        ),
        0.0,
        C::from(sample_case(r, cols, 6.0, 0, &rows)),
    ));
    let ties = [
        row(1.0, 20, 1.0, 0.0),
        row(1.0, 40, 0.5, 0.0),
        row(0.5, 0, 0.3, 0.0),
    ];
    out.push((
        "sample".into(),
        format!("{}x{cols}: 30 tokens tied for first", ties.len()),
        0.0,
        C::from(sample_case(r, cols, 6.0, 30, &ties)),
    ));
    let peaked = [row(1.0, 0, 1.0, 0.0), row(0.6, 0, 0.99, 0.0)];
    out.push((
        "sample".into(),
        format!("{}x{cols}: logits up to 40", peaked.len()),
        0.0,
        C::from(sample_case(r, cols, 40.0, 0, &peaked)),
    ));
    let small: Vec<RowSampling> = (0..48)
        .map(|i| {
            let mut pick = |n: u32| r.next_u32() % n;
            let s = row(
                [0.5, 1.0, 1.5][pick(3) as usize],
                [0, 0, 5, 100][pick(4) as usize],
                [1.0, 0.9, 0.6][pick(3) as usize],
                [0.0, 0.0, 0.2][i % 3],
            );
            if i % 4 == 3 {
                edited(s, 1.1, 0.2, 0.4)
            } else {
                s
            }
        })
        .collect();
    out.push((
        "sample".into(),
        format!("{}x100: random settings", small.len()),
        0.0,
        C::from(sample_case(r, 100, 3.0, 0, &small)),
    ));
    // log-probabilities on the device: sampled, greedy and edited rows (whose raw logits are
    // kept for them), rows without any between them, prompt tokens scored; ties across the
    // top 20; rows shorter than the count asked
    let lp = |k: u32, s: RowSampling| RowSampling {
        logprobs: Some(k),
        ..s
    };
    let score = |k: u32, token: u32| RowSampling {
        score: Some(token),
        ..lp(k, RowSampling::GREEDY)
    };
    let cols = 20_000;
    let rows = [
        lp(5, row(1.0, 0, 1.0, 0.0)),
        lp(20, RowSampling::GREEDY),
        lp(0, row(0.8, 50, 0.9, 0.0)),
        lp(3, edited(row(1.0, 0, 0.9, 0.0), 1.2, 0.3, 0.1)),
        row(1.0, 0, 1.0, 0.0),
        lp(20, edited(RowSampling::GREEDY, 1.3, 0.5, 0.2)),
        score(4, 7),
        score(0, cols as u32 - 1),
    ];
    let plain = [
        lp(20, row(1.0, 20, 1.0, 0.0)),
        lp(20, RowSampling::GREEDY),
        score(20, 3),
    ];
    for (what, cols, ties, rows) in [
        ("sampled, greedy, edited, scored", cols, 0, &rows[..]),
        ("30 tokens tied for first", cols, 30, &plain[..]),
        ("rows of 12", 12, 0, &plain[..]),
    ] {
        let [ids, values] = logprobs_cases(r, cols, 6.0, ties, rows);
        let name = format!("{}x{cols}: {what}", rows.len());
        out.push((
            "logprobs".into(),
            format!("{name}: tokens, ranks"),
            0.0,
            C::from(ids),
        ));
        out.push((
            "logprobs".into(),
            format!("{name}: values"),
            1e-5,
            C::from(values),
        ));
    }
}
