//! Dequantization of GGML block formats to f32.

use super::GgmlType;
use anyhow::{Result, anyhow, bail};
use half::{bf16, f16};
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// Dequantization. Each block function mirrors ggml's reference `dequantize_row_*` (and
// `gguf.quants`), with the same f32 operations in the same order, so results are bit-exact.

/// The non-uniform 4-bit levels of IQ4_NL / IQ4_XS.
pub const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn block_q4_0(b: &[u8; 18], o: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        o[j] = d * ((qs[j] & 0x0F) as i32 - 8) as f32;
        o[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

fn block_q4_1(b: &[u8; 20], o: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        o[j] = d * (qs[j] & 0x0F) as f32 + m;
        o[j + 16] = d * (qs[j] >> 4) as f32 + m;
    }
}

fn block_q5_0(b: &[u8; 22], o: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = (((qh >> j) & 1) << 4) as u8;
        let h1 = (((qh >> (j + 16)) & 1) << 4) as u8;
        o[j] = d * (((qs[j] & 0x0F) | h0) as i32 - 16) as f32;
        o[j + 16] = d * (((qs[j] >> 4) | h1) as i32 - 16) as f32;
    }
}

fn block_q5_1(b: &[u8; 24], o: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = (((qh >> j) & 1) << 4) as u8;
        let h1 = (((qh >> (j + 16)) & 1) << 4) as u8;
        o[j] = d * ((qs[j] & 0x0F) | h0) as f32 + m;
        o[j + 16] = d * ((qs[j] >> 4) | h1) as f32 + m;
    }
}

fn block_q8_0(b: &[u8; 34], o: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (x, &q) in o.iter_mut().zip(&b[2..34]) {
        *x = (q as i8) as f32 * d;
    }
}

fn block_q2_k(b: &[u8; 84], o: &mut [f32; 256]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (e, x) in o.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let q = (qs[h * 32 + l] >> (2 * s)) & 3;
        let sc = scales[e / 16];
        let dl = d * (sc & 0x0F) as f32;
        let ml = dmin * (sc >> 4) as f32;
        *x = dl * q as f32 - ml;
    }
}

fn block_q3_k(b: &[u8; 110], o: &mut [f32; 256]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = &b[96..108];
    let d = f16_at(b, 108);
    let mut dl = [0f32; 16];
    for (j, x) in dl.iter_mut().enumerate() {
        let low = (sc[j % 8] >> (4 * (j / 8))) & 0x0F;
        let high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        *x = d * ((low | (high << 4)) as i32 - 32) as f32;
    }
    for (e, x) in o.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let low = ((qs[h * 32 + l] >> (2 * s)) & 3) as i32;
        let high_set = (hmask[l] >> (e / 32)) & 1 != 0;
        let q = if high_set { low } else { low - 4 };
        *x = dl[e / 16] * q as f32;
    }
}

/// The 8 (scale, min) pairs of Q4_K / Q5_K, 6 bits each, packed in 12 bytes.
fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

fn block_q4_k(b: &[u8; 144], o: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = k_scale_min(&b[4..16]);
    let qs = &b[16..144];
    for (j, out) in o.chunks_exact_mut(32).enumerate() {
        let dl = d * sc[j] as f32;
        let ml = dmin * mn[j] as f32;
        let (c, shift) = (j / 2, 4 * (j % 2));
        for (l, x) in out.iter_mut().enumerate() {
            let q = (qs[c * 32 + l] >> shift) & 0x0F;
            *x = dl * q as f32 - ml;
        }
    }
}

fn block_q5_k(b: &[u8; 176], o: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = k_scale_min(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (j, out) in o.chunks_exact_mut(32).enumerate() {
        let dl = d * sc[j] as f32;
        let ml = dmin * mn[j] as f32;
        let (c, shift) = (j / 2, 4 * (j % 2));
        for (l, x) in out.iter_mut().enumerate() {
            let q = ((qs[c * 32 + l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
            *x = dl * q as f32 - ml;
        }
    }
}

fn block_q6_k(b: &[u8; 210], o: &mut [f32; 256]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    for (e, x) in o.iter_mut().enumerate() {
        let (h, r) = (e / 128, e % 128);
        let low = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
        let high = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
        let q = (low | (high << 4)) as i32 - 32;
        *x = (d * (scales[e / 16] as i8) as f32) * q as f32;
    }
}

fn block_iq4_nl(b: &[u8; 18], o: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        o[j] = d * IQ4_LEVELS[(qs[j] & 0x0F) as usize] as f32;
        o[j + 16] = d * IQ4_LEVELS[(qs[j] >> 4) as usize] as f32;
    }
}

fn block_iq4_xs(b: &[u8; 136], o: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let scales_l = &b[4..8];
    let qs = &b[8..136];
    for (j, out) in o.chunks_exact_mut(32).enumerate() {
        let low = (scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
        let high = ((scales_h >> (2 * j)) & 3) as u8;
        let dl = d * ((low | (high << 4)) as i32 - 32) as f32;
        let q = &qs[j * 16..j * 16 + 16];
        for l in 0..16 {
            out[l] = dl * IQ4_LEVELS[(q[l] & 0x0F) as usize] as f32;
            out[l + 16] = dl * IQ4_LEVELS[(q[l] >> 4) as usize] as f32;
        }
    }
}

fn elem_f32(b: &[u8; 4], o: &mut [f32; 1]) {
    o[0] = f32::from_le_bytes(*b);
}

fn elem_f16(b: &[u8; 2], o: &mut [f32; 1]) {
    o[0] = f16::from_le_bytes(*b).to_f32();
}

fn elem_bf16(b: &[u8; 2], o: &mut [f32; 1]) {
    o[0] = bf16::from_le_bytes(*b).to_f32();
}

/// Applies a block function over all blocks, in parallel chunks when the tensor is large.
fn run_blocks<const BS: usize, const TS: usize>(
    data: &[u8],
    out: &mut [f32],
    f: impl Fn(&[u8; TS], &mut [f32; BS]) + Sync,
) {
    // About 64 Ki values per parallel task.
    let blocks_per_task = (65536 / BS).max(1);
    let serial = |d: &[u8], o: &mut [f32]| {
        let (db, _) = d.as_chunks::<TS>();
        let (ob, _) = o.as_chunks_mut::<BS>();
        for (b, o) in db.iter().zip(ob.iter_mut()) {
            f(b, o);
        }
    };
    if out.len() <= blocks_per_task * BS {
        serial(data, out);
    } else {
        out.par_chunks_mut(blocks_per_task * BS)
            .zip(data.par_chunks(blocks_per_task * TS))
            .for_each(|(o, d)| serial(d, o));
    }
}

/// Dequantizes `n_elements` values of type `ty` stored in `data` (exactly the bytes of
/// `n_elements / block_size` blocks) to f32.
pub fn dequantize(ty: GgmlType, data: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n_elements];
    dequantize_into(ty, data, &mut out)?;
    Ok(out)
}

/// Dequantizes `out.len()` values of type `ty` stored in `data` (exactly the bytes of
/// `out.len() / block_size` blocks) into `out`.
pub fn dequantize_into(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let n_elements = out.len();
    if !ty.is_supported() {
        bail!("tensor type {ty} is not supported (cannot dequantize it)");
    }
    let (block, type_size) = ty.block_layout();
    if !n_elements.is_multiple_of(block) {
        bail!("{n_elements} values of type {ty} are not a whole number of blocks of {block}");
    }
    let need = (n_elements / block)
        .checked_mul(type_size)
        .ok_or_else(|| anyhow!("{n_elements} values of type {ty} are too many"))?;
    if data.len() != need {
        bail!(
            "{n_elements} values of type {ty} take {need} bytes, but {} were given",
            data.len()
        );
    }
    use GgmlType::*;
    match ty {
        F32 => run_blocks(data, out, elem_f32),
        F16 => run_blocks(data, out, elem_f16),
        BF16 => run_blocks(data, out, elem_bf16),
        Q4_0 => run_blocks(data, out, block_q4_0),
        Q4_1 => run_blocks(data, out, block_q4_1),
        Q5_0 => run_blocks(data, out, block_q5_0),
        Q5_1 => run_blocks(data, out, block_q5_1),
        Q8_0 => run_blocks(data, out, block_q8_0),
        Q2_K => run_blocks(data, out, block_q2_k),
        Q3_K => run_blocks(data, out, block_q3_k),
        Q4_K => run_blocks(data, out, block_q4_k),
        Q5_K => run_blocks(data, out, block_q5_k),
        Q6_K => run_blocks(data, out, block_q6_k),
        IQ4_NL => run_blocks(data, out, block_iq4_nl),
        IQ4_XS => run_blocks(data, out, block_iq4_xs),
        _ => bail!("tensor type {ty} is not supported (cannot dequantize it)"),
    }
    Ok(())
}
