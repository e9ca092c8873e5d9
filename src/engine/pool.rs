//! Requests of a model served for embeddings or scores (`--task embed`, `--task score`): a
//! prefill that generates nothing. Each step brings back the rows its pooling reads (every
//! row for mean pooling, the first or the last for CLS or last-token pooling) as the head
//! makes them; the request ends when its prompt is computed, with its rows pooled, cut to the
//! asked dimensions, normalized or squashed as the model's [`Pooler`] says.

use super::request::{Group, RequestError};
use super::{Engine, Prompt};
use crate::models::{Pooler, PoolingType, Task};
use crate::sampling::InvalidParam;
use crate::sched::{Request, RequestId};

/// What an embedding or score request may ask for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolingParams {
    /// Cut the embedding to its first `dimensions` values (Matryoshka models only).
    pub dimensions: Option<usize>,
    /// Keep only the prompt's last `k` tokens (vLLM's `truncate_prompt_tokens`); without it a
    /// prompt over the context is refused.
    pub truncate_prompt_tokens: Option<usize>,
}

/// A pooling request's rows so far.
pub(super) struct PoolState {
    pooling: PoolingType,
    dimensions: Option<usize>,
    /// The sum of the rows taken (mean), or the row (CLS, last).
    acc: Vec<f32>,
    /// Positions taken: a preempted request computes its prompt again, and rows before
    /// `next` are not taken twice.
    next: usize,
}

impl PoolState {
    /// The positions of `range` (of a prompt of `len` tokens) whose rows this pooling reads.
    pub(super) fn wanted(&self, range: std::ops::Range<usize>, len: usize) -> Vec<usize> {
        match self.pooling {
            PoolingType::Mean => (range.start.max(self.next)..range.end).collect(),
            PoolingType::Cls => (range.start == 0 && self.next == 0)
                .then_some(0)
                .into_iter()
                .collect(),
            PoolingType::Last => (range.end == len && self.next < len)
                .then_some(len - 1)
                .into_iter()
                .collect(),
        }
    }

    /// Takes the row of position `pos`.
    pub(super) fn take(&mut self, pos: usize, row: &[f32]) {
        if pos < self.next && self.pooling == PoolingType::Mean {
            return;
        }
        match self.pooling {
            PoolingType::Mean if !self.acc.is_empty() => {
                self.acc.iter_mut().zip(row).for_each(|(a, &x)| *a += x)
            }
            _ => self.acc = row.to_vec(),
        }
        self.next = pos + 1;
    }

    /// The request's result, once its `len` prompt rows are in.
    pub(super) fn finish(mut self, pooler: &Pooler, len: usize) -> Vec<f32> {
        if self.pooling == PoolingType::Mean {
            let n = len.max(1) as f32;
            self.acc.iter_mut().for_each(|a| *a /= n);
        }
        if let Some(d) = self.dimensions {
            self.acc.truncate(d);
        }
        if pooler.normalize {
            // NOTE: as sentence-transformers' Normalize (torch's F.normalize): a zero vector
            // stays zero.
            let norm = self
                .acc
                .iter()
                .map(|x| x * x)
                .sum::<f32>()
                .sqrt()
                .max(1e-12);
            self.acc.iter_mut().for_each(|a| *a /= norm);
        }
        if pooler.sigmoid {
            self.acc
                .iter_mut()
                .for_each(|a| *a = 1.0 / (1.0 + (-*a).exp()));
        }
        self.acc
    }
}

/// The cosine similarity of two vectors (0 where one is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let n = norm(a) * norm(b);
    if n > 0.0 { dot / n } else { 0.0 }
}

impl Engine {
    /// How this engine pools (`None`: it generates).
    pub fn pooler(&self) -> Option<&Pooler> {
        self.pooler.as_ref()
    }

    /// Validates and queues an embedding or score request: `prompt` whole (text is tokenized
    /// with the tokenizer's special tokens, as sentence-transformers does). Its one output
    /// carries the result in `pooled`.
    pub fn add_pooling_request(
        &mut self,
        prompt: Prompt,
        params: PoolingParams,
    ) -> Result<RequestId, RequestError> {
        let Some(pooler) = &self.pooler else {
            return Err(RequestError::InvalidPrompt(
                "this model is served for generation: embeddings and scores need --task embed or \
                 --task score"
                    .into(),
            ));
        };
        let invalid =
            |param, message: String| RequestError::InvalidParam(InvalidParam { param, message });
        if let Some(d) = params.dimensions {
            let width = pooler.width;
            match &pooler.matryoshka {
                _ if pooler.task != Task::Embed => {
                    return Err(invalid("dimensions", "dimensions is for embeddings".into()));
                }
                None => {
                    return Err(invalid(
                        "dimensions",
                        "this model does not support Matryoshka embeddings (its config.json has \
                         neither is_matryoshka nor matryoshka_dimensions): dimensions cannot be set"
                            .into(),
                    ));
                }
                Some(_) if d == 0 || d > width => {
                    return Err(invalid(
                        "dimensions",
                        format!("dimensions must be between 1 and {width}, got {d}"),
                    ));
                }
                Some(dims) if !dims.is_empty() && !dims.contains(&d) => {
                    return Err(invalid(
                        "dimensions",
                        format!("dimensions must be one of {dims:?}, got {d}"),
                    ));
                }
                Some(_) => {}
            }
        }
        let mut ids = match prompt {
            Prompt::Text(t) => self
                .tokenizer
                .encode_special(&t)
                .map_err(RequestError::Internal)?,
            Prompt::Tokens(t) => t,
        };
        let max_len = self.max_model_len();
        if let Some(k) = params.truncate_prompt_tokens {
            if k == 0 || k > max_len {
                return Err(invalid(
                    "truncate_prompt_tokens",
                    format!("truncate_prompt_tokens must be between 1 and {max_len}, got {k}"),
                ));
            }
            // NOTE: as vLLM: the last tokens are kept.
            ids.drain(..ids.len().saturating_sub(k));
        }
        if ids.is_empty() {
            return Err(RequestError::InvalidPrompt("the input is empty".into()));
        }
        let vocab = self.config.vocab_size as u32;
        if let Some(&bad) = ids.iter().find(|&&t| t >= vocab) {
            return Err(RequestError::InvalidPrompt(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        if ids.len() > max_len {
            return Err(RequestError::PromptTooLong(format!(
                "the input has {} tokens, but the maximum context length is {max_len} tokens \
                 (truncate_prompt_tokens cuts it to its last tokens)",
                ids.len()
            )));
        }
        let id = self.next_id;
        let len = ids.len();
        // NOTE: no prefix caching: mean pooling needs every row computed, and the request
        // keeps no K/V past its prefill.
        let req = Request::new(id, ids, 0, Vec::new());
        self.scheduler
            .add_request(req)
            .map_err(RequestError::PromptTooLong)?;
        self.next_id += 1;
        self.stats.prompt_tokens += len as u64;
        self.pools.insert(
            id,
            PoolState {
                pooling: pooler.pooling,
                dimensions: params.dimensions,
                acc: Vec::new(),
                next: 0,
            },
        );
        self.groups.insert(
            id,
            Group {
                seqs: vec![id],
                unfinished: 1,
                ranked: None,
            },
        );
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::OutputHead;

    fn pooler(normalize: bool, sigmoid: bool) -> Pooler {
        Pooler {
            task: Task::Embed,
            pooling: PoolingType::Mean,
            normalize,
            sigmoid,
            matryoshka: None,
            head: OutputHead::Hidden,
            width: 3,
        }
    }

    fn state(pooling: PoolingType) -> PoolState {
        PoolState {
            pooling,
            dimensions: None,
            acc: Vec::new(),
            next: 0,
        }
    }

    #[test]
    fn mean_pooling_over_chunks_takes_each_row_once() {
        let mut s = state(PoolingType::Mean);
        assert_eq!(s.wanted(0..2, 3), vec![0, 1]);
        s.take(0, &[1.0, 2.0, 3.0]);
        s.take(1, &[3.0, 2.0, -1.0]);
        // preempted and computed again from the start: rows 0 and 1 are not taken twice
        assert_eq!(s.wanted(0..3, 3), vec![2]);
        s.take(2, &[2.0, 5.0, 1.0]);
        assert_eq!(s.finish(&pooler(false, false), 3), vec![2.0, 3.0, 1.0]);
    }

    #[test]
    fn cls_and_last_take_one_row() {
        let mut s = state(PoolingType::Cls);
        assert_eq!(s.wanted(0..2, 4), vec![0]);
        s.take(0, &[3.0, 4.0, 0.0]);
        assert!(s.wanted(2..4, 4).is_empty());
        assert_eq!(s.finish(&pooler(true, false), 4), vec![0.6, 0.8, 0.0]);
        let mut s = state(PoolingType::Last);
        assert!(s.wanted(0..2, 4).is_empty());
        assert_eq!(s.wanted(2..4, 4), vec![3]);
        s.take(3, &[0.0]);
        assert_eq!(s.finish(&pooler(false, true), 4), vec![0.5]);
    }

    #[test]
    fn dimensions_cut_before_normalizing() {
        let mut s = state(PoolingType::Last);
        s.dimensions = Some(2);
        s.take(0, &[3.0, 4.0, 12.0]);
        assert_eq!(s.finish(&pooler(true, false), 1), vec![0.6, 0.8]);
    }
}
