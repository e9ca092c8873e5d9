//! The argument checks every backend makes before an op runs, written once. Each takes the
//! lengths (in elements) of the op's buffers, and the host copy of an index buffer where the op
//! must look inside it (token ids, positions, slots, rows), so that one mistake gets one message
//! on every backend and no kernel reads outside a buffer. What is a backend's own (element
//! types, how a buffer is split, kernel limits) it still checks itself.

use super::{KvLayout, QkvLayout};
use anyhow::{Result, bail, ensure};

/// `embedding`: every id inside the table of `table` values in rows of `dim`.
pub fn embedding(ids: &[u32], table: usize, dim: usize, out: usize) -> Result<()> {
    ensure!(out >= ids.len() * dim, "embedding: output too small");
    ensure!(dim > 0, "embedding: zero dim");
    let vocab = table / dim;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        bail!("token id {id} is outside the vocabulary ({vocab})");
    }
    Ok(())
}

/// `matmul`: `x` `[m, k]`, `w` `[n, k]`, `bias` `[n]`, `out` `[m, n]`.
pub fn matmul(
    x: usize,
    w: usize,
    bias: Option<usize>,
    (m, k, n): (usize, usize, usize),
    out: usize,
) -> Result<()> {
    ensure!(
        x >= m * k && out >= m * n,
        "matmul: buffer too small for {m}x{k}x{n}"
    );
    ensure!(
        w == n * k,
        "matmul: weight has {w} elements, expected {n}x{k}"
    );
    if let Some(b) = bias {
        ensure!(b == n, "matmul: bias has {b} elements, expected {n}");
    }
    Ok(())
}

/// `matmul_gated_act`: `x` `[rows, k]`, the gate and up rows `[2·ffn, k]`, `out` `[rows, ffn]`.
pub fn matmul_gated_act(
    x: usize,
    w: usize,
    rows: usize,
    k: usize,
    ffn: usize,
    out: usize,
) -> Result<()> {
    ensure!(
        x >= rows * k && out >= rows * ffn && w == 2 * ffn * k,
        "matmul_gated_act: bad sizes for {rows}x{k}x(2x{ffn})"
    );
    Ok(())
}

/// `rms_norm`: `x` and `out` `[rows, dim]`, `w` `[dim]`.
pub fn rms_norm(x: usize, w: usize, rows: usize, dim: usize, out: usize) -> Result<()> {
    ensure!(
        x >= rows * dim && out >= rows * dim && w == dim,
        "rms_norm: bad sizes"
    );
    Ok(())
}

/// `add_rms_norm`: `x`, `y` and `out` `[rows, dim]`, `w` `[dim]`.
pub fn add_rms_norm(
    x: usize,
    y: usize,
    w: usize,
    rows: usize,
    dim: usize,
    out: usize,
) -> Result<()> {
    ensure!(
        x >= rows * dim && y >= rows * dim && out >= rows * dim && w == dim,
        "add_rms_norm: bad sizes"
    );
    Ok(())
}

/// `layer_norm`: `x` and `out` `[rows, dim]`, `w` and `b` `[dim]`.
pub fn layer_norm(x: usize, w: usize, b: usize, rows: usize, dim: usize, out: usize) -> Result<()> {
    ensure!(
        x >= rows * dim && out >= rows * dim && w == dim && b == dim,
        "layer_norm: bad sizes"
    );
    Ok(())
}

/// `qk_norm`: `rows` rows of `qkv`, weights as the span needs them.
pub fn qk_norm(
    qkv: usize,
    q_w: usize,
    k_w: usize,
    rows: usize,
    layout: QkvLayout,
    span: super::QkNormSpan,
) -> Result<()> {
    ensure!(
        qkv >= rows * layout.row_len() && (q_w, k_w) == span.weight_lens(layout),
        "qk_norm: bad sizes"
    );
    Ok(())
}

/// `rope`: `rows` rows of `qkv` and their positions, each inside the cos/sin tables.
pub fn rope(
    qkv: usize,
    positions: &[u32],
    cos: usize,
    sin: usize,
    rows: usize,
    layout: QkvLayout,
) -> Result<()> {
    ensure!(
        qkv >= rows * layout.row_len() && positions.len() >= rows,
        "rope: bad sizes"
    );
    let half = layout.head_dim / 2;
    ensure!(half > 0 && cos == sin, "rope: bad tables");
    let max_pos = cos / half;
    if let Some(&p) = positions[..rows].iter().find(|&&p| p as usize >= max_pos) {
        bail!("rope: position {p} is beyond the table ({max_pos})");
    }
    Ok(())
}

/// `add_assign`: `n` values of each.
pub fn add_assign(x: usize, y: usize, n: usize) -> Result<()> {
    ensure!(x >= n && y >= n, "add_assign: buffers too small");
    Ok(())
}

/// `gated_act`: `gate_up` `[rows, 2·ffn]`, `out` `[rows, ffn]`.
pub fn gated_act(gate_up: usize, rows: usize, ffn: usize, out: usize) -> Result<()> {
    ensure!(
        gate_up >= rows * 2 * ffn && out >= rows * ffn,
        "gated_act: bad sizes"
    );
    Ok(())
}

/// An op in place over the first `n` values (`act`, `scale`, `softcap`).
pub fn in_place(op: &str, x: usize, n: usize) -> Result<()> {
    ensure!(x >= n, "{op}: buffer too small");
    Ok(())
}

/// `clamp`: in place, with a positive limit.
pub fn clamp(x: usize, n: usize, limit: f32) -> Result<()> {
    in_place("clamp", x, n)?;
    ensure!(
        limit > 0.0 && limit.is_finite(),
        "clamp: the limit must be positive and finite"
    );
    Ok(())
}

/// `softcap`: in place, with a positive cap.
pub fn softcap(x: usize, n: usize, cap: f32) -> Result<()> {
    in_place("softcap", x, n)?;
    ensure!(cap > 0.0, "softcap: the cap must be positive");
    Ok(())
}

/// `gather_rows`: every row inside `x` (rows of `dim`).
pub fn gather_rows(x: usize, rows: &[u32], dim: usize, out: usize) -> Result<()> {
    ensure!(out >= rows.len() * dim, "gather_rows: output too small");
    if let Some(&r) = rows.iter().find(|&&r| (r as usize + 1) * dim > x) {
        bail!("gather_rows: row {r} out of range");
    }
    Ok(())
}

/// One adapter's part of a `lora` call as the checks see it: its rows and the count said, the
/// lengths of its weights and of its factors A and B, and its rank.
pub struct LoraLens<'a> {
    pub rows: &'a [u32],
    pub m: usize,
    pub weights: usize,
    pub a: usize,
    pub b: usize,
    pub rank: usize,
}

/// `lora`: each group with `m` rows, a weight per row and factors `[rank, k]` and `[n, rank]`,
/// every row inside `x` (rows of `k`) and `out` (rows of `n`), no row twice in the call (so
/// that rows update in parallel).
pub fn lora(groups: &[LoraLens], k: usize, n: usize, x: usize, out: usize) -> Result<()> {
    let rows: Vec<u32> = groups.iter().flat_map(|g| g.rows.iter().copied()).collect();
    if let Some(g) = groups.iter().find(|g| g.rows.len() != g.m) {
        bail!("lora: {} rows given, {} said", g.rows.len(), g.m);
    }
    ensure!(
        groups.iter().all(|g| g.weights >= g.m),
        "lora: fewer weights than rows"
    );
    if let Some(g) = groups
        .iter()
        .find(|g| g.a != g.rank * k || g.b != n * g.rank)
    {
        bail!(
            "lora: factors of {} and {} values where [{}, {k}] and [{n}, {}] were expected",
            g.a,
            g.b,
            g.rank,
            g.rank
        );
    }
    gather_rows(x, &rows, k, usize::MAX)?;
    scatter_add_rows(usize::MAX, &rows, usize::MAX, n, out)
}

/// `scatter_add_rows`: a weight for each of `y`'s rows, each target row inside `out`, none
/// twice (so that a GPU's threads never add to one row at once).
pub fn scatter_add_rows(
    y: usize,
    rows: &[u32],
    weights: usize,
    dim: usize,
    out: usize,
) -> Result<()> {
    ensure!(
        y >= rows.len() * dim && weights >= rows.len(),
        "scatter_add_rows: fewer source rows or weights than target rows"
    );
    if let Some(&r) = rows.iter().find(|&&r| (r as usize + 1) * dim > out) {
        bail!("scatter_add_rows: row {r} out of range");
    }
    let mut seen = rows.to_vec();
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
        bail!("scatter_add_rows: row {} appears twice", w[0]);
    }
    Ok(())
}

/// `argmax_rows`: `rows` rows of `cols`.
pub fn argmax_rows(logits: usize, rows: usize, cols: usize) -> Result<()> {
    ensure!(logits >= rows * cols, "argmax_rows: buffer too small");
    Ok(())
}

/// A K and a V cache of the layout's size (`op` names the op in the message).
pub fn kv_caches(op: &str, k: usize, v: usize, kv: KvLayout) -> Result<()> {
    ensure!(
        k == kv.numel() && v == kv.numel(),
        "{op}: cache size mismatch"
    );
    Ok(())
}

/// `write_kv`: `rows` rows of `qkv` and their slots, each inside the pool.
pub fn write_kv(
    qkv: usize,
    slots: &[u32],
    rows: usize,
    layout: QkvLayout,
    (k, v): (usize, usize),
    kv: KvLayout,
) -> Result<()> {
    kv_caches("write_kv", k, v, kv)?;
    ensure!(
        slots.len() >= rows && qkv >= rows * layout.row_len(),
        "write_kv: {rows} rows, {} slots, {qkv} values",
        slots.len()
    );
    if let Some(&s) = slots[..rows]
        .iter()
        .find(|&&s| s as usize / kv.block_size.max(1) >= kv.num_blocks)
    {
        bail!("write_kv: slot {s} outside the pool");
    }
    Ok(())
}

/// `paged_attention`: `qkv` and `out` for the batch's `tokens` rows, and the caches.
pub fn paged_attention(
    qkv: usize,
    tokens: usize,
    layout: QkvLayout,
    (k, v): (usize, usize),
    kv: KvLayout,
    out: usize,
) -> Result<()> {
    let (h, hkv) = (layout.num_heads, layout.num_kv_heads);
    ensure!(
        hkv > 0 && h % hkv == 0,
        "paged_attention: {h} heads over {hkv} kv heads"
    );
    ensure!(
        out >= tokens * layout.num_heads * layout.head_dim,
        "paged_attention: output too small"
    );
    ensure!(
        qkv >= tokens * layout.row_len(),
        "paged_attention: qkv too small"
    );
    kv_caches("paged_attention", k, v, kv)
}

/// `read_kv_blocks` / `write_kv_blocks`: every block inside a cache of `cache` values.
pub fn kv_blocks(op: &str, blocks: &[u32], block_len: usize, cache: usize) -> Result<()> {
    if let Some(&b) = blocks
        .iter()
        .find(|&&b| (b as usize + 1) * block_len > cache)
    {
        bail!("{op}: block {b} is outside the cache");
    }
    Ok(())
}

/// `write_kv_blocks`'s data: `blocks.len()` blocks of `block_len`.
pub fn kv_blocks_data(data: &[f32], blocks: &[u32], block_len: usize) -> Result<()> {
    ensure!(
        data.len() == blocks.len() * block_len && block_len > 0,
        "write_kv_blocks: {} values for {} blocks of {block_len}",
        data.len(),
        blocks.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> QkvLayout {
        QkvLayout {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
        }
    }

    #[test]
    fn each_check_passes_exact_sizes_and_names_what_is_wrong() {
        let l = layout();
        let kv = KvLayout {
            num_blocks: 2,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 4,
            dtype: crate::tensor::DType::F32,
        };
        let n = kv.numel();
        assert!(matmul(6, 12, Some(4), (2, 3, 4), 8).is_ok());
        let e = matmul(6, 11, None, (2, 3, 4), 8).unwrap_err().to_string();
        assert_eq!(e, "matmul: weight has 11 elements, expected 4x3");
        assert!(matmul(6, 12, Some(3), (2, 3, 4), 8).is_err());
        assert!(rope(2 * l.row_len(), &[0, 7], 16, 16, 2, l).is_ok());
        let e = rope(2 * l.row_len(), &[0, 8], 16, 16, 2, l).unwrap_err();
        assert_eq!(e.to_string(), "rope: position 8 is beyond the table (8)");
        assert!(rope(2 * l.row_len(), &[0], 16, 16, 2, l).is_err());
        assert!(write_kv(l.row_len(), &[7], 1, l, (n, n), kv).is_ok());
        let e = write_kv(l.row_len(), &[8], 1, l, (n, n), kv).unwrap_err();
        assert_eq!(e.to_string(), "write_kv: slot 8 outside the pool");
        assert!(write_kv(l.row_len(), &[0], 1, l, (n, n - 1), kv).is_err());
        assert!(gather_rows(8, &[1], 4, 4).is_ok());
        assert!(gather_rows(8, &[2], 4, 4).is_err());
        assert!(embedding(&[2], 12, 4, 4).is_ok());
        let e = embedding(&[3], 12, 4, 4).unwrap_err().to_string();
        assert_eq!(e, "token id 3 is outside the vocabulary (3)");
        assert!(embedding(&[0], 12, 0, 4).is_err());
        assert!(kv_blocks("read_kv_blocks", &[1], 4, 8).is_ok());
        assert!(kv_blocks("read_kv_blocks", &[2], 4, 8).is_err());
        assert!(softcap(4, 4, 0.0).is_err());
        assert!(clamp(4, 4, f32::NAN).is_err() && clamp(4, 4, -1.0).is_err());
        assert!(in_place("scale", 3, 4).is_err());
        assert!(paged_attention(3 * l.row_len(), 3, l, (n, n), kv, 3 * 8).is_ok());
        assert!(paged_attention(3 * l.row_len() - 1, 3, l, (n, n), kv, 3 * 8).is_err());
    }
}
