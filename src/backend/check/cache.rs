//! Swap's block copies: `read_kv_blocks` and `write_kv_blocks` over every KV type.

use super::util::{rand_vec, rounded};
use crate::backend::{Backend, KvLayout};
use crate::tensor::DType;
use anyhow::Result;
use rand_chacha::ChaCha8Rng;

/// Swap's block copies: the cache filled block by block, some blocks overwritten, some
/// read back; the result is the blocks read, then the whole cache.
pub(super) struct KvBlocks {
    pub(super) kv: KvLayout,
    pub(super) cache: Vec<f32>,
    pub(super) write: Vec<u32>,
    pub(super) data: Vec<f32>,
    pub(super) read: Vec<u32>,
}

impl KvBlocks {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let KvBlocks {
            kv,
            cache,
            write,
            data,
            read,
        } = self;
        let bl = kv.block_len();
        let mut c = be.alloc_kv(*kv)?;
        let all: Vec<u32> = (0..kv.num_blocks as u32).collect();
        be.write_kv_blocks(&mut c, bl, &all, cache)?;
        be.write_kv_blocks(&mut c, bl, write, data)?;
        let mut v = be.read_kv_blocks(&c, bl, read)?;
        v.extend(be.download_f32(&c)?);
        Ok(v)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let KvBlocks {
            kv,
            cache,
            write,
            data,
            read,
        } = self;
        let bl = kv.block_len();
        let mut c = rounded(kv.dtype, cache);
        for (&b, d) in write.iter().zip(data.chunks_exact(bl)) {
            let at = b as usize * bl;
            c[at..at + bl].copy_from_slice(&rounded(kv.dtype, d));
        }
        let mut out: Vec<f64> = read
            .iter()
            .flat_map(|&b| c[b as usize * bl..(b as usize + 1) * bl].to_vec())
            .collect();
        out.extend(c);
        out
    }
}

/// The table's rows of this family, drawn from `r` in order.
pub(super) fn cases<C: From<KvBlocks>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
    // KV block copies (swap): 80 blocks of 512 bytes span several parts of a split cache;
    // half and fp8 caches round what is written (the reference too) and widen what is read
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F8E4M3] {
        let kv = KvLayout {
            num_blocks: 80,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 16,
            dtype,
        };
        let bl = kv.block_len();
        let write = vec![79, 3, 40, 0, 33];
        out.push((
            "kv block copies".into(),
            format!(
                "{} blocks of {bl}, {}: write 5, read 6",
                kv.num_blocks,
                dtype.name()
            ),
            0.0,
            C::from(KvBlocks {
                kv,
                cache: rand_vec(r, kv.num_blocks * bl),
                data: rand_vec(r, write.len() * bl),
                write,
                read: vec![40, 1, 79, 31, 32, 0],
            }),
        ));
    }
}
