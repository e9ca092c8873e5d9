//! Matrix products: `matmul` (with and without a bias, every weight type, decode rows and
//! batches, odd sizes), the gated MLP's `matmul_gated_act`, and weights in GGML blocks
//! (`matmul` and `embedding` of one table, in two parts of different types).

use super::util::{rand_vec, rounded};
use crate::backend::{Activation, Backend, LoraGroup};
use crate::quant::{GgmlType, QuantTensor};
use crate::tensor::{DType, HostTensor};
use anyhow::Result;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::Rng;

pub(super) struct Matmul {
    pub(super) dtype: DType,
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) x: Vec<f32>,
    pub(super) w: Vec<f32>,
    pub(super) b: Option<Vec<f32>>,
}

impl Matmul {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let Matmul {
            dtype,
            m,
            k,
            n,
            x,
            w,
            b,
        } = self;
        let xb = be.upload_f32(x)?;
        let wb = be.upload_weight(&HostTensor::new(vec![*n, *k], w.clone()), *dtype)?;
        let bb = b.as_ref().map(|b| be.upload_f32(b)).transpose()?;
        let mut out = be.alloc_f32(m * n)?;
        be.matmul(&xb, &wb, bb.as_ref(), *m, *k, *n, &mut out)?;
        be.download_f32(&out)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let Matmul {
            dtype,
            m,
            k,
            n,
            x,
            w,
            b,
        } = self;
        let w = rounded(*dtype, w);
        let mut out = Vec::with_capacity(m * n);
        for i in 0..*m {
            for j in 0..*n {
                let dot: f64 = (0..*k).map(|l| x[i * k + l] as f64 * w[j * k + l]).sum();
                out.push(dot + b.as_ref().map_or(0.0, |b| b[j] as f64));
            }
        }
        out
    }
}

/// The gated MLP's gate and up projections with the activation's product
/// (`matmul_gated_act`), under each activation.
pub(super) struct GatedMatmul {
    pub(super) dtype: DType,
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) ffn: usize,
    pub(super) x: Vec<f32>,
    pub(super) w: Vec<f32>,
}

impl GatedMatmul {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let GatedMatmul {
            dtype,
            m,
            k,
            ffn,
            x,
            w,
        } = self;
        let xb = be.upload_f32(x)?;
        let wb = be.upload_weight(&HostTensor::new(vec![2 * ffn, *k], w.clone()), *dtype)?;
        let mut v = Vec::new();
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
            let mut gu = be.alloc_f32(m * 2 * ffn)?;
            let mut out = be.alloc_f32(m * ffn)?;
            be.matmul_gated_act(&xb, &wb, *m, *k, *ffn, act, &mut gu, &mut out)?;
            v.extend(be.download_f32(&out)?);
        }
        Ok(v)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let GatedMatmul {
            dtype,
            m,
            k,
            ffn,
            x,
            w,
        } = self;
        let w = rounded(*dtype, w);
        let dot = |i: usize, j: usize| -> f64 {
            (0..*k).map(|l| x[i * k + l] as f64 * w[j * k + l]).sum()
        };
        let mut out = Vec::with_capacity(3 * m * ffn);
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
            for i in 0..*m {
                out.extend((0..*ffn).map(|j| act.apply_f64(dot(i, j)) * dot(i, ffn + j)));
            }
        }
        out
    }
}

/// A weight in blocks: `matmul` by it (x quantized to 8 bits per 32, or per 256 for the
/// super-blocks, by the backend, so against
/// the exact product the error is the activations' rounding: about 1e-2) and `embedding` of
/// its rows (exact). Backends that do not keep a type get it dequantized, as the loader does.
pub(super) struct QuantMatmul {
    /// Run only where the weight stays in blocks (a case for the block kernels' launches).
    pub(super) blocks_only: bool,
    pub(super) m: usize,
    pub(super) x: Vec<f32>,
    pub(super) w: QuantTensor,
    pub(super) b: Option<Vec<f32>>,
    pub(super) ids: Vec<u32>,
}

impl QuantMatmul {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let (m, k, n) = (self.m, self.w.k, self.w.rows());
        let wb = if self.w.parts.iter().all(|p| be.keeps_quant(p.ty)) {
            be.upload_quant(self.w.clone())?
        } else {
            be.upload_weight(
                &HostTensor::new(vec![n, k], self.w.dequantize()?),
                DType::F32,
            )?
        };
        let bb = self.b.as_ref().map(|b| be.upload_f32(b)).transpose()?;
        let mut out = be.alloc_f32(m * n)?;
        be.matmul(
            &be.upload_f32(&self.x)?,
            &wb,
            bb.as_ref(),
            m,
            k,
            n,
            &mut out,
        )?;
        let mut e = be.alloc_f32(self.ids.len() * k)?;
        be.embedding(&wb, &be.upload_u32(&self.ids)?, k, &mut e)?;
        let mut v = be.download_f32(&out)?;
        v.extend(be.download_f32(&e)?);
        Ok(v)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let (m, k, n) = (self.m, self.w.k, self.w.rows());
        let w = self.w.dequantize().expect("random blocks dequantize");
        let mut out = Vec::with_capacity(m * n + self.ids.len() * k);
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|l| self.x[i * k + l] as f64 * w[j * k + l] as f64)
                    .sum();
                out.push(dot + self.b.as_ref().map_or(0.0, |b| b[j] as f64));
            }
        }
        for &id in &self.ids {
            out.extend(w[id as usize * k..][..k].iter().map(|&v| v as f64));
        }
        out
    }
}

/// `rows` rows of `k` values of `ty`: random bytes, with the f16 scales (and minimums) set to
/// random finite values of a realistic size.
pub(super) fn random_blocks(
    r: &mut ChaCha8Rng,
    ty: GgmlType,
    rows: usize,
    k: usize,
) -> QuantTensor {
    let (block, bytes) = ty.block_layout();
    let mut data = vec![0u8; rows * k / block * bytes];
    r.fill_bytes(&mut data);
    let halves: &[usize] = match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[0],
    };
    for b in data.chunks_exact_mut(bytes) {
        for &at in halves {
            let v = half::f16::from_f32(rand_vec(r, 1)[0] * 0.05);
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    QuantTensor::new(ty, rows, k, data).expect("whole blocks")
}

/// LoRA's update of several adapters in one call (`lora`), over an output already holding
/// values: two of different ranks (one with more rows than a CPU task takes, the other's rows
/// interleaved with them, some rows untouched); or more adapters than one GPU launch takes, in
/// every weight type.
pub(super) struct Lora {
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) x: Vec<f32>,
    pub(super) out: Vec<f32>,
    pub(super) groups: Vec<LoraCaseGroup>,
}

pub(super) struct LoraCaseGroup {
    dtype: DType,
    rows: Vec<u32>,
    weights: Vec<f32>,
    rank: usize,
    /// `[rank, k]`.
    a: Vec<f32>,
    /// `[n, rank]`.
    b: Vec<f32>,
}

impl Lora {
    pub(super) fn run<B: Backend>(&self, be: &B) -> Result<Vec<f32>> {
        let (k, n) = (self.k, self.n);
        let x = be.upload_f32(&self.x)?;
        let mut out = be.upload_f32(&self.out)?;
        let mut bufs = Vec::new();
        for g in &self.groups {
            bufs.push((
                be.upload_u32(&g.rows)?,
                be.upload_f32(&g.weights)?,
                be.upload_weight(&HostTensor::new(vec![g.rank, k], g.a.clone()), g.dtype)?,
                be.upload_weight(&HostTensor::new(vec![n, g.rank], g.b.clone()), g.dtype)?,
            ));
        }
        let groups: Vec<LoraGroup<B>> = self
            .groups
            .iter()
            .zip(&bufs)
            .map(|(g, (rows, weights, a, b))| LoraGroup {
                rows,
                weights,
                m: g.rows.len(),
                a,
                b,
                rank: g.rank,
            })
            .collect();
        be.lora(&x, &groups, k, n, &mut out)?;
        be.download_f32(&out)
    }

    /// What [`Self::run`] should return, in f64.
    pub(super) fn reference(&self) -> Vec<f64> {
        let (k, n) = (self.k, self.n);
        let mut out: Vec<f64> = self.out.iter().map(|&v| v as f64).collect();
        for g in &self.groups {
            let (a, b, rank) = (rounded(g.dtype, &g.a), rounded(g.dtype, &g.b), g.rank);
            for (&r, &w) in g.rows.iter().zip(&g.weights) {
                let x = &self.x[r as usize * k..(r as usize + 1) * k];
                let mid: Vec<f64> = (0..rank)
                    .map(|j| (0..k).map(|l| x[l] as f64 * a[j * k + l]).sum())
                    .collect();
                for c in 0..n {
                    let up: f64 = (0..rank).map(|j| mid[j] * b[c * rank + j]).sum();
                    out[r as usize * n + c] += w as f64 * up;
                }
            }
        }
        out
    }
}

/// The table's `lora` rows.
pub(super) fn lora_cases<C: From<Lora>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
    let (tokens, k, n) = (20, 96, 80);
    let group = |r: &mut ChaCha8Rng, dtype: DType, rows: Vec<u32>, rank: usize| LoraCaseGroup {
        dtype,
        weights: rand_vec(r, rows.len()).iter().map(|v| v.abs()).collect(),
        rows,
        rank,
        a: rand_vec(r, rank * k),
        b: rand_vec(r, n * rank),
    };
    let tolerance = |d: DType| if d == DType::F32 { 1e-5 } else { 1e-2 };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let groups = vec![
            group(r, dtype, vec![0, 2, 3, 5, 6, 8, 9, 11, 12, 14, 19], 16),
            group(r, dtype, vec![1, 4, 7, 13, 17], 8),
        ];
        out.push((
            "lora".into(),
            format!("{} 2 adapters, {tokens}x{k}x{n}", dtype.name()),
            tolerance(dtype),
            C::from(Lora {
                k,
                n,
                x: rand_vec(r, tokens * k),
                out: rand_vec(r, tokens * n),
                groups,
            }),
        ));
    }
    // NOTE: 18 adapters of each weight type (rows 0..54, row 55 untouched): more than a GPU
    // launch takes for each type.
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    let groups = (0..54)
        .map(|i| group(r, dtypes[i % 3], vec![i as u32], 4 + i % 5))
        .collect();
    out.push((
        "lora".into(),
        format!("54 adapters of 3 types, 56x{k}x{n}"),
        tolerance(DType::F16),
        C::from(Lora {
            k,
            n,
            x: rand_vec(r, 56 * k),
            out: rand_vec(r, 56 * n),
            groups,
        }),
    ));
}

/// The tolerance of a product of `m` rows by `dtype` weights over `k`.
// NOTE: half weights with a decode-sized batch go through the GEMV kernels, which keep x in
// f32; elsewhere a vendor GEMM may round x to the weights' type first.
fn matmul_tolerance(dtype: DType, m: usize, k: usize) -> f64 {
    if dtype == DType::F32 || (m <= 8 && k.is_multiple_of(8)) {
        1e-5
    } else {
        1e-2
    }
}

/// The table's rows of this family, drawn from `r` in order.
pub(super) fn cases<C: From<Matmul> + From<GatedMatmul> + From<QuantMatmul>>(
    r: &mut ChaCha8Rng,
    out: &mut Vec<(String, String, f64, C)>,
) {
    // matmul: decode rows (matvec), larger batches (vendor GEMM or our tiled kernel), odd k
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &(m, k, n, bias) in &[
            (1, 576, 1536, false),
            (3, 2048, 512, true),
            (8, 1024, 384, false),
            (17, 576, 192, true),
            (130, 256, 320, false),
            (5, 130, 33, true),
        ] {
            let tol = matmul_tolerance(dtype, m, k);
            out.push((
                "matmul".into(),
                format!(
                    "{} {m}x{k}x{n}{}",
                    dtype.name(),
                    if bias { " +bias" } else { "" }
                ),
                tol,
                C::from(Matmul {
                    dtype,
                    m,
                    k,
                    n,
                    x: rand_vec(r, m * k),
                    w: rand_vec(r, n * k),
                    b: bias.then(|| rand_vec(r, n)),
                }),
            ));
        }
    }
    // weights in blocks, a second part in Q8_0 under them (a fused projection of two types):
    // decode rows, a batch over three launch rows, an odd count of blocks; and, where the
    // blocks stay, one case with more activation blocks and embedding values than the
    // emulator's elementwise grid (16 multiprocessors × 32 blocks × 256 threads) holds.
    // NOTE: the last runs only where weights stay in blocks: wgpu, multiplying the weight
    // dequantized, gets that product (520x8192x32 in f32) wrong, with an error of 0.99 (a
    // bug of its own, found so and still open).
    // NOTE: drawn from a stream of their own, so that the other rows keep their inputs.
    let r = &mut r.clone();
    r.set_stream(0x5155_414e);
    for ty in GgmlType::WITH_KERNELS {
        let shapes = match ty.block_layout().0 {
            32 => [(1, 576, 96, true), (3, 96, 40, false), (20, 256, 48, true)],
            _ => [(1, 512, 96, true), (3, 256, 40, false), (20, 768, 48, true)],
        };
        // NOTE: 300 ids of 8192 values and 520 rows of 256 blocks of 32 pass the cap.
        let large = (ty == GgmlType::Q4_0).then_some((520, 8192, 32, false));
        for (m, k, n, bias) in shapes.into_iter().chain(large) {
            let w = QuantTensor::stack(vec![
                random_blocks(r, ty, n - 16, k),
                random_blocks(r, GgmlType::Q8_0, 16, k),
            ])
            .expect("one k");
            out.push((
                "matmul".into(),
                format!(
                    "{ty} (+Q8_0) {m}x{k}x{n}{}",
                    if bias { " +bias" } else { "" }
                ),
                2e-2,
                C::from(QuantMatmul {
                    blocks_only: m == 520,
                    m,
                    x: rand_vec(r, m * k),
                    w,
                    b: bias.then(|| rand_vec(r, n)),
                    ids: match m {
                        520 => (0..300).map(|i| (i * 7 % n) as u32).collect(),
                        _ => vec![0, (n - 1) as u32, 5, (n - 17) as u32],
                    },
                }),
            ));
        }
    }
    // the gated MLP's first half: decode rows (fused on a GPU), an odd k, a prefill batch
    for dtype in [DType::F32, DType::BF16] {
        for &(m, k, ffn) in &[
            (1, 576, 384),
            (5, 256, 200),
            (8, 520, 96),
            (3, 130, 64),
            (20, 128, 96),
        ] {
            out.push((
                "matmul_gated_act".into(),
                format!("{} {m}x{k}x(2x{ffn})", dtype.name()),
                matmul_tolerance(dtype, m, k),
                C::from(GatedMatmul {
                    dtype,
                    m,
                    k,
                    ffn,
                    x: rand_vec(r, m * k),
                    w: rand_vec(r, 2 * ffn * k),
                }),
            ));
        }
    }
}
