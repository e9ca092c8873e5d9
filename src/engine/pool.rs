//! Requests of a model served for embeddings or scores (`--task embed`, `--task score`): a
//! prefill that generates nothing. Each step brings back the rows its pooling reads (every
//! row for mean pooling, the first or the last for CLS or last-token pooling) as the head
//! makes them; the request ends when its prompt is computed, with its rows pooled, cut to the
//! asked dimensions, normalized or squashed as the model's [`Pooler`] says
//! (`Engine::add_pooling_request` queues them).

use crate::models::pooling::{Pooler, PoolingType};

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
    pub(super) pooling: PoolingType,
    pub(super) dimensions: Option<usize>,
    /// The sum of the rows taken (mean), or the row (CLS, last).
    pub(super) acc: Vec<f32>,
    /// Positions taken: a preempted request computes its prompt again, and rows before
    /// `next` are not taken twice.
    pub(super) next: usize,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::pooling::OutputHead;

    use crate::models::pooling::Task;

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
