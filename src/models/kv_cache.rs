//! The paged KV pool in device memory, and what each layer needs of it. A model says what it
//! stores per layer ([`LayerKvSpec`]); the runner sizes the pool from that (bytes per block over
//! all layers) and allocates it; the block manager hands out block ids that index every
//! layer's cache alike.

use super::config::ModelConfig;
use crate::backend::{Backend, KvLayout};
use crate::tensor::DType;
use anyhow::{Context, Result, bail};

/// What one layer keeps in the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerKvSpec {
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Element type of K and V in the pool.
    pub dtype: DType,
    /// The layer attends to its last `window` keys only (Mistral, local layers); `None`: all.
    pub sliding_window: Option<usize>,
}

impl LayerKvSpec {
    /// Bytes of one block of this layer, K and V together; `None` if that overflows a u64.
    pub fn bytes_per_block(&self, block_size: usize) -> Option<u64> {
        [
            self.num_kv_heads,
            self.head_dim,
            block_size,
            self.dtype.size_in_bytes(),
        ]
        .into_iter()
        .try_fold(2u64, |acc, x| acc.checked_mul(x as u64))
    }
}

/// What each layer keeps by default: its KV heads in f32, with its window. The runner sizes
/// the RoPE tables and the pool from this before the weights are loaded.
pub fn default_spec(c: &ModelConfig) -> Vec<LayerKvSpec> {
    (0..c.num_layers)
        .map(|l| LayerKvSpec {
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            dtype: DType::F32,
            sliding_window: c.layer_window(l),
        })
        .collect()
}

/// Bytes one block takes over all layers (checked: a block size too large is an error).
pub fn bytes_per_block(spec: &[LayerKvSpec], block_size: usize) -> Result<u64> {
    spec.iter()
        .try_fold(0u64, |acc, l| {
            l.bytes_per_block(block_size)
                .and_then(|b| acc.checked_add(b))
        })
        .with_context(|| {
            format!("a KV block of {block_size} tokens would take more than 2^64 bytes")
        })
}

/// The paged K and V caches of every layer: `[num_blocks, Hkv, block_size, D]` each.
pub struct KvCache<B: Backend> {
    pub k: Vec<B::Buf>,
    pub v: Vec<B::Buf>,
    /// Each layer's geometry (the same number of blocks everywhere).
    pub layouts: Vec<KvLayout>,
}

impl<B: Backend> KvCache<B> {
    pub fn new(
        backend: &B,
        spec: &[LayerKvSpec],
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self> {
        let mut k = Vec::with_capacity(spec.len());
        let mut v = Vec::with_capacity(spec.len());
        let mut layouts = Vec::with_capacity(spec.len());
        for l in spec {
            // NOTE: the backends' caches hold f32 today; a spec asking for another dtype must
            // not be sized as one thing and allocated as another.
            if l.dtype != DType::F32 {
                bail!("a KV cache of {} is not supported yet", l.dtype.name());
            }
            let layout = KvLayout {
                num_blocks,
                block_size,
                num_kv_heads: l.num_kv_heads,
                head_dim: l.head_dim,
            };
            k.push(backend.alloc_kv(layout)?);
            v.push(backend.alloc_kv(layout)?);
            layouts.push(layout);
        }
        Ok(KvCache { k, v, layouts })
    }

    pub fn num_blocks(&self) -> usize {
        self.layouts.first().map_or(0, |l| l.num_blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_block_follow_each_layer_and_the_dtype() {
        let full = LayerKvSpec {
            num_kv_heads: 2,
            head_dim: 64,
            dtype: DType::F32,
            sliding_window: None,
        };
        let local = LayerKvSpec {
            num_kv_heads: 1,
            head_dim: 256,
            dtype: DType::BF16,
            sliding_window: Some(512),
        };
        assert_eq!(full.bytes_per_block(16), Some(2 * 2 * 64 * 16 * 4));
        assert_eq!(local.bytes_per_block(16), Some(2 * 256 * 16 * 2));
        assert_eq!(
            bytes_per_block(&[full, local, full], 16).unwrap(),
            2 * 2 * 2 * 64 * 16 * 4 + 2 * 256 * 16 * 2
        );
        let e = bytes_per_block(&[full], usize::MAX / 4).unwrap_err();
        assert!(e.to_string().contains("more than 2^64 bytes"), "{e}");
    }
}
