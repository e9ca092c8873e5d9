//! Launch geometry of the attention kernels (attention.cu): tiles, the context split and the
//! shared memory each block needs; pure arithmetic, tested without a device.

use super::kernels;
use anyhow::{Result, ensure};

/// Shared memory a block may use without opting in to more.
pub(super) const SHARED_LIMIT: usize = 48 * 1024;
/// Threads of a decode-attention block (DEC_THREADS in attention.cu).
pub(super) const DEC_THREADS: usize = 128;
/// Threads of a general paged-attention block (PA_THREADS in attention.cu).
const PA_THREADS: usize = 128;
/// Warps of a tensor-core prefill block at most (its launch bounds: 128 threads).
const MMA_MAX_WARPS: usize = 4;
/// Query heads per kv head that the decode kernel holds in registers (DEC_MAX_REP).
const DEC_MAX_REP: usize = 8;

/// The shared memory (bytes) of a paged-attention block; see attention.cu.
fn attention_shared_bytes(q_tile: usize, rep: usize, d: usize, k_tile: usize) -> usize {
    let r = q_tile * rep;
    4 * (2 * r * d + k_tile * (d + 1) + r * k_tile + 3 * r)
}

/// Launch geometry of one paged-attention call (the general kernel or the tensor-core one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionPlan {
    pub q_tile: usize,
    pub k_tile: usize,
    pub num_q_tiles: usize,
    pub part_size: usize,
    pub num_splits: usize,
    pub shared_bytes: usize,
    pub threads: usize,
}

/// (keys per partition, partitions): the context cut so that there are about twice as many
/// blocks as multiprocessors, in whole tiles of `k_tile` keys.
fn split_context(
    blocks: usize,
    max_seq_len: usize,
    k_tile: usize,
    multiprocessors: usize,
) -> (usize, usize) {
    let want = 2 * multiprocessors.max(1);
    let max_splits = max_seq_len.div_ceil(k_tile).max(1);
    let splits = want.div_ceil(blocks.max(1)).clamp(1, max_splits);
    let part_size = max_seq_len.max(1).div_ceil(splits).div_ceil(k_tile) * k_tile;
    (part_size, max_seq_len.max(1).div_ceil(part_size))
}

/// Picks tiles and the context split. A pure decode step gets one query row per block; a step
/// with prefill chunks gets as many rows per block as shared memory allows (≤ 16), so a K/V
/// tile serves many queries. The context is split when there are too few blocks to fill the
/// device (decode of a few long sequences).
pub fn plan_attention(
    num_seqs: usize,
    max_query_len: usize,
    max_seq_len: usize,
    rep: usize,
    head_dim: usize,
    num_kv_heads: usize,
    multiprocessors: usize,
) -> Result<AttentionPlan> {
    let k_tile = if head_dim <= 128 { 32 } else { 16 };
    ensure!(
        attention_shared_bytes(1, rep, head_dim, k_tile) <= SHARED_LIMIT,
        "paged attention: head_dim {head_dim} with {rep} query heads per kv head needs more shared memory than a block has"
    );
    let mut q_tile = if max_query_len <= 1 { 1 } else { 16 };
    while q_tile > 1 && attention_shared_bytes(q_tile, rep, head_dim, k_tile) > SHARED_LIMIT {
        q_tile -= 1;
    }
    let num_q_tiles = max_query_len.max(1).div_ceil(q_tile);
    let blocks = num_seqs * num_q_tiles * num_kv_heads;
    let (part_size, num_splits) = split_context(blocks, max_seq_len, k_tile, multiprocessors);
    Ok(AttentionPlan {
        q_tile,
        k_tile,
        num_q_tiles,
        part_size,
        num_splits,
        shared_bytes: attention_shared_bytes(q_tile, rep, head_dim, k_tile),
        threads: PA_THREADS,
    })
}

/// Keys per tile of the tensor-core prefill kernel (MMA_KT in attention.cu): S and O live in
/// registers, so the wider the head, the fewer keys.
fn mma_k_tile(head_dim: usize) -> usize {
    match head_dim {
        0..=64 => 64,
        65..=128 => 32,
        _ => 16,
    }
}

/// The shared memory (bytes) of a tensor-core prefill block: the Q, K and Vᵀ tiles of 16-bit
/// values, rows padded by 8; see attention.cu.
fn mma_shared_bytes(warps: usize, d: usize, k_tile: usize) -> usize {
    2 * ((16 * warps + k_tile) * (d + 8) + d * (k_tile + 8))
}

/// The tensor-core prefill kernel's plan (`paged_attention_prefill_<kv>_d<D>`), or `None`
/// where it does not apply: a head size without an instance, or more query heads per kv head
/// than a block's rows. A warp takes 16 rows (query rows × the kv head's query heads); a block
/// as many warps as the longest query needs, up to 4, and fewer where shared memory is short.
pub fn plan_prefill_attention_mma(
    num_seqs: usize,
    max_query_len: usize,
    max_seq_len: usize,
    rep: usize,
    head_dim: usize,
    num_kv_heads: usize,
    multiprocessors: usize,
) -> Option<AttentionPlan> {
    if !kernels::DECODE_HEAD_DIMS.contains(&head_dim) || rep == 0 {
        return None;
    }
    let k_tile = mma_k_tile(head_dim);
    let need = (max_query_len.max(1) * rep)
        .div_ceil(16)
        .clamp(1, MMA_MAX_WARPS);
    let warps = (1..=need)
        .rev()
        .find(|&w| 16 * w >= rep && mma_shared_bytes(w, head_dim, k_tile) <= SHARED_LIMIT)?;
    let q_tile = 16 * warps / rep;
    let num_q_tiles = max_query_len.max(1).div_ceil(q_tile);
    let blocks = num_seqs * num_q_tiles * num_kv_heads;
    let (part_size, num_splits) = split_context(blocks, max_seq_len, k_tile, multiprocessors);
    Some(AttentionPlan {
        q_tile,
        k_tile,
        num_q_tiles,
        part_size,
        num_splits,
        shared_bytes: mma_shared_bytes(warps, head_dim, k_tile),
        threads: 32 * warps,
    })
}

/// The shared memory (bytes) of a decode-attention block; see attention.cu. `kv_bytes`: the
/// size of a cache element (16 / kv_bytes elements per 16-byte chunk); `warp`: lanes per warp.
fn decode_shared_bytes(
    rep: usize,
    d: usize,
    kv_bytes: usize,
    warp: usize,
    part_size: usize,
) -> usize {
    let chunks = d / (16 / kv_bytes);
    // the value stage's partial sums: one per warp where a warp holds whole groups
    let partial = if chunks < warp && warp.is_multiple_of(chunks) {
        DEC_THREADS / warp
    } else {
        DEC_THREADS / chunks
    };
    4 * (rep * part_size + partial * rep * d + 2 * rep)
}

/// Launch geometry of the decode kernel: the context of every sequence cut in partitions of
/// `part_size` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlan {
    pub part_size: usize,
    pub num_splits: usize,
    pub shared_bytes: usize,
}

/// Which attention kernel a call launches, with its plan.
pub(super) enum AttentionLaunch {
    Decode(DecodePlan),
    /// the tensor-core kernel for prefill chunks and mixed steps
    Prefill(AttentionPlan),
    General(AttentionPlan),
}

impl AttentionLaunch {
    /// (keys per partition, partitions): the layout of the reduce's inputs.
    pub(super) fn split(&self) -> (usize, usize) {
        match self {
            AttentionLaunch::Decode(p) => (p.part_size, p.num_splits),
            AttentionLaunch::Prefill(p) | AttentionLaunch::General(p) => {
                (p.part_size, p.num_splits)
            }
        }
    }
}

/// Keys a decode partition holds at least: fewer would make a block's fixed costs (loading q,
/// the softmax, the write) outweigh its reads.
const DECODE_MIN_PART: usize = 32;

/// The decode kernel's plan for a step whose rows are all decode rows, or `None` where that
/// kernel does not apply (a head size without an instance, more than `DEC_MAX_REP` query heads
/// per kv head, a block size that is not a power of two): the general kernel takes those.
///
/// NOTE: the context is split until there are 8 blocks per multiprocessor (flash-decoding),
/// down to partitions of `DECODE_MIN_PART` keys; a partition is at most what shared memory holds.
#[allow(clippy::too_many_arguments)]
pub fn plan_decode_attention(
    num_seqs: usize,
    max_seq_len: usize,
    rep: usize,
    head_dim: usize,
    num_kv_heads: usize,
    block_size: usize,
    kv_bytes: usize,
    warp: usize,
    multiprocessors: usize,
) -> Option<DecodePlan> {
    if !kernels::DECODE_HEAD_DIMS.contains(&head_dim)
        || rep == 0
        || rep > DEC_MAX_REP
        || !block_size.is_power_of_two()
    {
        return None;
    }
    let ctx = max_seq_len.max(1);
    let fixed = decode_shared_bytes(rep, head_dim, kv_bytes, warp, 0);
    let max_part =
        (SHARED_LIMIT.checked_sub(fixed)? / (4 * rep)) / DECODE_MIN_PART * DECODE_MIN_PART;
    if max_part < DECODE_MIN_PART {
        return None;
    }
    let blocks = (num_seqs * num_kv_heads).max(1);
    let want_splits = (8 * multiprocessors.max(1)).div_ceil(blocks);
    let part_size = ctx
        .div_ceil(want_splits)
        .next_multiple_of(DECODE_MIN_PART)
        .min(max_part);
    Some(DecodePlan {
        part_size,
        num_splits: ctx.div_ceil(part_size),
        shared_bytes: decode_shared_bytes(rep, head_dim, kv_bytes, warp, part_size),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_plans_fit_and_cover_the_context() {
        for &(seqs, q, ctx, rep, d, hkv) in &[
            (1, 1, 1000, 4, 64, 8),
            (1, 1, 1, 4, 64, 8),
            (256, 1, 700, 4, 64, 8),
            (4, 512, 512, 4, 64, 8),
            (2, 100, 5000, 8, 128, 8),
            (1, 3, 40000, 7, 64, 2),
            (1, 1, 10, 1, 256, 1),
        ] {
            let p = plan_attention(seqs, q, ctx, rep, d, hkv, 132).unwrap();
            assert!(p.shared_bytes <= SHARED_LIMIT, "{p:?}");
            assert!(p.q_tile >= 1 && p.num_q_tiles * p.q_tile >= q);
            assert_eq!(p.part_size % p.k_tile, 0);
            assert!(p.num_splits * p.part_size >= ctx, "{p:?}");
            assert!((p.num_splits - 1) * p.part_size < ctx.max(1), "{p:?}");
            if q == 1 {
                assert_eq!(p.q_tile, 1);
            }
        }
        // decode of one long sequence is split to fill the device; a full batch is not
        assert!(
            plan_attention(1, 1, 4096, 4, 64, 8, 132)
                .unwrap()
                .num_splits
                > 1
        );
        assert_eq!(
            plan_attention(256, 1, 700, 4, 64, 8, 132)
                .unwrap()
                .num_splits,
            1
        );
        assert!(plan_attention(1, 1, 10, 64, 512, 1, 132).is_err());
    }

    #[test]
    fn tensor_core_plans_fit_and_cover_the_rows_and_the_context() {
        for &(seqs, q, ctx, rep, d, hkv) in &[
            (1, 1, 1, 1, 16, 1),
            (4, 512, 512, 4, 64, 8),
            (2, 100, 5000, 8, 128, 8),
            (1, 3, 40000, 7, 64, 2),
            (3, 2000, 2000, 2, 256, 4),
            (1, 7, 300, 20, 80, 1),
            (64, 1, 900, 3, 96, 3),
        ] {
            let p = plan_prefill_attention_mma(seqs, q, ctx, rep, d, hkv, 132).unwrap();
            let warps = p.threads / 32;
            assert!(
                p.threads.is_multiple_of(32) && (1..=MMA_MAX_WARPS).contains(&warps),
                "{p:?}"
            );
            assert!(p.shared_bytes <= SHARED_LIMIT, "{p:?}");
            assert_eq!(p.shared_bytes, mma_shared_bytes(warps, d, p.k_tile));
            // a tile's rows fit its warps' 16 rows each, and the tiles cover the query
            assert!(p.q_tile >= 1 && p.q_tile * rep <= 16 * warps, "{p:?}");
            assert!(p.num_q_tiles * p.q_tile >= q, "{p:?}");
            assert_eq!(p.part_size % p.k_tile, 0);
            assert!(p.num_splits * p.part_size >= ctx, "{p:?}");
            assert!((p.num_splits - 1) * p.part_size < ctx.max(1), "{p:?}");
        }
        // a short query takes one warp; a long one four, or what shared memory allows
        assert_eq!(
            plan_prefill_attention_mma(8, 1, 100, 4, 64, 8, 132)
                .unwrap()
                .threads,
            32
        );
        assert_eq!(
            plan_prefill_attention_mma(1, 500, 500, 4, 64, 8, 132)
                .unwrap()
                .threads,
            128
        );
        assert_eq!(
            plan_prefill_attention_mma(1, 500, 500, 4, 256, 1, 132)
                .unwrap()
                .threads,
            96
        );
        // no instance for the head size; more query heads than 4 warps' rows
        assert!(plan_prefill_attention_mma(1, 10, 10, 4, 48, 8, 132).is_none());
        assert!(plan_prefill_attention_mma(1, 10, 10, 65, 64, 1, 132).is_none());
    }

    #[test]
    fn decode_plans_fit_fill_the_device_and_cover_the_context() {
        for &(seqs, ctx, rep, d, hkv, kvb) in &[
            (1, 1, 4, 64, 8, 4),
            (1, 4096, 4, 64, 8, 2),
            (1, 131072, 8, 256, 1, 4),
            (1, 131072, 8, 256, 1, 2),
            (256, 700, 4, 64, 8, 2),
            (32, 2000, 7, 128, 2, 4),
            (3, 90, 3, 80, 2, 2),
            (3, 90, 8, 16, 2, 2),
            (1, 4096, 8, 128, 1, 1),
            (32, 2000, 7, 128, 2, 1),
            (3, 90, 3, 80, 2, 1),
        ] {
            let p = plan_decode_attention(seqs, ctx, rep, d, hkv, 16, kvb, 32, 132).unwrap();
            assert!(p.shared_bytes <= SHARED_LIMIT, "{p:?}");
            assert_eq!(p.part_size % DECODE_MIN_PART, 0);
            assert!(p.num_splits * p.part_size >= ctx, "{p:?}");
            assert!((p.num_splits - 1) * p.part_size < ctx, "{p:?}");
            // about 8 blocks per multiprocessor (partitions rounded up to whole minimums),
            // unless partitions would fall below the minimum
            let blocks = seqs * hkv * p.num_splits;
            assert!(
                blocks * (p.part_size + DECODE_MIN_PART) >= 8 * 132 * p.part_size
                    || p.part_size == DECODE_MIN_PART,
                "{p:?}: {blocks} blocks"
            );
        }
        // one sequence of 4096 keys over 8 kv heads: split, partitions of the minimum size
        let p = plan_decode_attention(1, 4096, 4, 64, 8, 16, 4, 32, 132).unwrap();
        assert_eq!((p.part_size, p.num_splits), (32, 128));
        // a full batch is not split
        assert_eq!(
            plan_decode_attention(256, 700, 4, 64, 8, 16, 4, 32, 132).map(|p| p.num_splits),
            Some(1)
        );
        // no instance for the head size, too many query heads, a block size not a power of two
        // an fp8 cache's 16-value chunks make 16 groups at d=128: their sums meet in the warp
        // first, or 8 query heads would not fit (7 x 16 x 128 floats)
        assert!(plan_decode_attention(1, 100, 8, 128, 1, 16, 1, 32, 132).is_some());
        assert!(plan_decode_attention(1, 10, 4, 48, 8, 16, 4, 32, 132).is_none());
        assert!(plan_decode_attention(1, 10, 9, 64, 1, 16, 4, 32, 132).is_none());
        assert!(plan_decode_attention(1, 10, 4, 64, 8, 12, 4, 32, 132).is_none());
    }
}
