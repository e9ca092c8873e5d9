//! The paged KV pool in device memory, and what each layer needs of it. A model says what it
//! stores per layer ([`LayerKvSpec`]); the runner sizes the pool from that (bytes per block over
//! all layers) and allocates it; the block manager hands out block ids that index every
//! layer's cache alike.

use super::config::ModelConfig;
use crate::backend::{Backend, KvLayout};
use crate::tensor::DType;
use crate::tensor::WeightStats;
use anyhow::{Context, Result, bail};

/// `--kv-cache-dtype`: the element type of the KV pool, as vLLM's flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// The type the model's weights are in (bf16 weights, bf16 cache) where the backend
    /// stores it; f16 for weights in quantized blocks (as llama.cpp and vLLM keep a GGUF
    /// model's cache); else f32: a model run in f32 keeps an f32 cache and its exact outputs.
    #[default]
    Auto,
    Fixed(DType),
}

impl KvCacheDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Fixed(d) => d.name(),
        }
    }

    /// The pool's element type on a backend that stores `supported`, for a model whose
    /// weights are `weights`.
    pub fn resolve(
        self,
        supported: &[DType],
        weights: &WeightStats,
        backend: &str,
    ) -> Result<DType> {
        let list = || {
            supported
                .iter()
                .map(|d| d.name())
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            KvCacheDtype::Fixed(d) if supported.contains(&d) => Ok(d),
            KvCacheDtype::Fixed(d) => bail!(
                "--kv-cache-dtype {}: the {backend} backend stores the KV cache in {} only",
                d.name(),
                list()
            ),
            KvCacheDtype::Auto => {
                // NOTE: the float type holding most of the weights' bytes, quantized blocks
                // counting for f16 (their scales are f16, and the activations they meet are
                // rounded to 8 bits: an f32 cache would keep precision nothing else has).
                let bytes = |d: DType| weights.by_type.get(d.name()).copied().unwrap_or(0);
                let floats = [DType::F32, DType::F16, DType::BF16];
                let quant: u64 = (weights.by_type.iter())
                    .filter(|(t, _)| floats.iter().all(|d| d.name() != t.as_str()))
                    .map(|(_, b)| b)
                    .sum();
                let half = [
                    (DType::BF16, bytes(DType::BF16)),
                    (DType::F16, bytes(DType::F16) + quant),
                ]
                .into_iter()
                .filter(|&(d, b)| b > bytes(DType::F32) && supported.contains(&d))
                .max_by_key(|&(_, b)| b);
                Ok(half.map_or(DType::F32, |(d, _)| d))
            }
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(KvCacheDtype::Auto),
            "fp8" | "fp8_e4m3" => Ok(KvCacheDtype::Fixed(DType::F8E4M3)),
            "fp8_e5m2" => {
                bail!(
                    "--kv-cache-dtype {s}: an fp8 E5M2 cache is not implemented (fp8 is E4M3; auto, f32, bf16, f16, fp8)"
                )
            }
            other => other
                .parse::<DType>()
                .map(KvCacheDtype::Fixed)
                .map_err(|_| {
                    anyhow::anyhow!("unknown KV cache dtype '{s}' (auto, f32, bf16, f16, fp8)")
                }),
        }
    }
}

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
            let layout = KvLayout {
                num_blocks,
                block_size,
                num_kv_heads: l.num_kv_heads,
                head_dim: l.head_dim,
                dtype: l.dtype,
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

/// `spec` with every layer's K and V in `dtype`.
pub fn in_dtype(spec: Vec<LayerKvSpec>, dtype: DType) -> Vec<LayerKvSpec> {
    spec.into_iter()
        .map(|l| LayerKvSpec { dtype, ..l })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_cache_dtype_follows_the_weights_where_the_backend_can() {
        let gpu = [DType::F32, DType::BF16, DType::F16];
        let stats = |types: &[(&str, u64)]| WeightStats {
            by_type: types.iter().map(|(t, b)| (t.to_string(), *b)).collect(),
            ..Default::default()
        };
        let bf16 = stats(&[("bf16", 1000), ("f32", 10)]);
        let f32 = stats(&[("f32", 1000)]);
        let q = stats(&[("Q4_1", 1000), ("f32", 10)]);
        let auto = KvCacheDtype::Auto;
        assert_eq!(auto.resolve(&gpu, &bf16, "cuda").unwrap(), DType::BF16);
        assert_eq!(auto.resolve(&gpu, &f32, "cuda").unwrap(), DType::F32);
        assert_eq!(auto.resolve(&gpu, &q, "cpu").unwrap(), DType::F16);
        let f16w = stats(&[("f16", 1000), ("Q8_0", 100), ("f32", 10)]);
        assert_eq!(auto.resolve(&gpu, &f16w, "cpu").unwrap(), DType::F16);
        let mixed = stats(&[("bf16", 400), ("Q8_0", 500), ("f32", 10)]);
        assert_eq!(auto.resolve(&gpu, &mixed, "cpu").unwrap(), DType::F16);
        for w in [&bf16, &q, &f32] {
            assert_eq!(auto.resolve(&[DType::F32], w, "wgpu").unwrap(), DType::F32);
        }
        let f16 = KvCacheDtype::Fixed(DType::F16);
        assert_eq!(f16.resolve(&gpu, &f32, "cuda").unwrap(), DType::F16);
        let e = f16
            .resolve(&[DType::F32], &f32, "wgpu")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("wgpu backend stores the KV cache in f32 only"),
            "{e}"
        );
        for (s, want) in [
            ("auto", KvCacheDtype::Auto),
            ("BF16", KvCacheDtype::Fixed(DType::BF16)),
            ("float16", KvCacheDtype::Fixed(DType::F16)),
            ("f32", KvCacheDtype::Fixed(DType::F32)),
        ] {
            assert_eq!(s.parse::<KvCacheDtype>().unwrap(), want, "{s}");
        }
        for s in ["fp8", "FP8_E4M3"] {
            assert_eq!(
                s.parse::<KvCacheDtype>().unwrap(),
                KvCacheDtype::Fixed(DType::F8E4M3)
            );
        }
        let e = "fp8_e5m2".parse::<KvCacheDtype>().unwrap_err().to_string();
        assert!(e.contains("not implemented"), "{e}");
        assert!("int4".parse::<KvCacheDtype>().is_err());
    }

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
