//! Choosing tokens where the logits are on the GPU backends: the argmax of each row, and
//! `sample_rows` (edits, then greedy or temperature, top-k, top-p, min-p with the host's
//! draw, and the raw log-probabilities); the kernels are in kernels/sample.cu.

use super::{Arg, Elem, GpuBackend, GpuBuf, GpuRuntime, from_bytes, kernels, u32_arg};
use crate::backend::Backend;
use crate::sampling::sampler::TokenLogprobs;
use crate::sampling::{Choice, RowSampling};
use anyhow::{Result, bail, ensure};

impl<R: GpuRuntime> GpuBackend<R> {
    pub(super) fn argmax_rows_op(
        &self,
        logits: &GpuBuf<R>,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<u32>> {
        self.rt.bind()?;
        logits.expect(Elem::F32, "argmax")?;
        ensure!(logits.len >= rows * cols, "argmax: buffer too small");
        if rows == 0 {
            return Ok(Vec::new());
        }
        let out = self.argmax_on_device(logits, rows, cols)?;
        Ok(from_bytes::<u32>(&self.download_bytes(&out)?))
    }

    pub(super) fn sample_rows_op(
        &self,
        logits: &mut GpuBuf<R>,
        cols: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<Choice>> {
        self.rt.bind()?;
        logits.expect(Elem::F32, "sample")?;
        ensure!(logits.len >= rows.len() * cols, "sample: buffer too small");
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let edits: Vec<u32> = (0u32..)
            .zip(rows)
            .flat_map(|(r, s)| s.edit_words(r))
            .collect();
        if let Some(e) = edits
            .iter()
            .skip(1)
            .step_by(8)
            .find(|&&t| t as usize >= cols)
        {
            bail!("sample: an edit of token {e} in rows of {cols}");
        }
        // The rows whose log-probabilities come back: (row, k).
        let scored: Vec<(usize, u32)> = (0..rows.len())
            .filter_map(|i| rows[i].logprobs.map(|k| (i, k)))
            .collect();
        if let Some(&(_, k)) = scored.iter().find(|s| s.1 as usize > kernels::LOGPROBS_MAX) {
            bail!(
                "sample: {k} log-probabilities asked, at most {}",
                kernels::LOGPROBS_MAX
            );
        }
        // NOTE: log-probabilities are of the raw logits, so a scored row that has edits is
        // copied before they are applied; the others are read where they are.
        let raw = if scored.iter().any(|&(i, _)| !rows[i].edits.is_empty()) {
            let idx: Vec<u32> = scored.iter().map(|&(i, _)| i as u32).collect();
            let idx = self.upload_u32(&idx)?;
            let mut raw = self.alloc_f32(scored.len() * cols)?;
            self.gather_rows(logits, &idx, cols, &mut raw)?;
            Some(raw)
        } else {
            None
        };
        if !edits.is_empty() {
            let n = edits.len() / 8;
            let buf = self.upload_u32(&edits)?;
            self.launch(
                "logit_edits_f32",
                [u32_arg(n.div_ceil(256), "edits")?.bits() as u32, 1, 1],
                [256, 1, 1],
                0,
                &[
                    Arg::P(logits.ptr()),
                    Arg::P(buf.ptr()),
                    u32_arg(n, "edits")?,
                    u32_arg(cols, "cols")?,
                ],
            )?;
        }
        let tokens = if rows.iter().all(RowSampling::is_greedy) {
            self.argmax_on_device(logits, rows.len(), cols)?
        } else {
            let words: Vec<u32> = rows.iter().flat_map(RowSampling::words).collect();
            let params = self.upload_u32(&words)?;
            let out = self.alloc(rows.len(), Elem::U32, false)?;
            self.launch(
                "sample_f32",
                [u32_arg(rows.len(), "rows")?.bits() as u32, 1, 1],
                [kernels::SAMPLE_THREADS, 1, 1],
                0,
                &[
                    Arg::P(logits.ptr()),
                    Arg::P(params.ptr()),
                    Arg::P(out.ptr()),
                    u32_arg(cols, "cols")?,
                ],
            )?;
            out
        };
        let lp_words = if scored.is_empty() {
            Vec::new()
        } else {
            let params: Vec<u32> = scored
                .iter()
                .enumerate()
                .flat_map(|(j, &(i, k))| {
                    let src = if raw.is_some() { j } else { i };
                    [src as u32, i as u32, rows[i].score.unwrap_or(u32::MAX), k]
                })
                .collect();
            let params = self.upload_u32(&params)?;
            let out = self.alloc(scored.len() * kernels::LOGPROBS_WORDS, Elem::U32, false)?;
            self.launch(
                "logprobs_f32",
                [u32_arg(scored.len(), "rows")?.bits() as u32, 1, 1],
                [kernels::SAMPLE_THREADS, 1, 1],
                0,
                &[
                    Arg::P(raw.as_ref().unwrap_or(logits).ptr()),
                    Arg::P(params.ptr()),
                    Arg::P(tokens.ptr()),
                    Arg::P(out.ptr()),
                    u32_arg(cols, "cols")?,
                ],
            )?;
            from_bytes::<u32>(&self.download_bytes(&out)?)
        };
        let mut out: Vec<Choice> = from_bytes::<u32>(&self.download_bytes(&tokens)?)
            .into_iter()
            .map(Choice::token)
            .collect();
        for (&(i, k), w) in scored
            .iter()
            .zip(lp_words.chunks_exact(kernels::LOGPROBS_WORDS))
        {
            let lp = |j: usize| f32::from_bits(w[j]);
            out[i] = Choice {
                token: w[0],
                logprobs: Some(TokenLogprobs {
                    token_id: w[0],
                    logprob: lp(1),
                    top: (0..k.min(cols as u32) as usize)
                        .map(|j| (w[3 + 2 * j], lp(4 + 2 * j)))
                        .collect(),
                }),
                rank: w[2],
            };
        }
        Ok(out)
    }

    /// The argmax of each row, left on the device.
    fn argmax_on_device(&self, logits: &GpuBuf<R>, rows: usize, cols: usize) -> Result<GpuBuf<R>> {
        let out = self.alloc(rows, Elem::U32, false)?;
        self.launch(
            "argmax_f32",
            [u32_arg(rows, "rows")?.bits() as u32, 1, 1],
            [kernels::SAMPLE_THREADS, 1, 1],
            0,
            &[
                Arg::P(logits.ptr()),
                Arg::P(out.ptr()),
                u32_arg(cols, "cols")?,
            ],
        )?;
        Ok(out)
    }
}
