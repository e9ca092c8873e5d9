//! The CPU matmuls' GFLOP/s against the cores' peak, at 1, 16, 64 and 512 rows of `x`.
//!
//!     cargo bench --bench matmul                  # every weight type, default shapes
//!     cargo bench --bench matmul -- 1 64          # some row counts
//!     PAGODA_MATMUL_TYPES=Q4_K,Q6_K PAGODA_MATMUL_SHAPES=4864x896 cargo bench --bench matmul
//!     PAGODA_CPU_ISA=avx2 cargo bench --bench matmul     # the AVX2 kernels on an AVX-512 CPU
//!
//! Weights are random (random blocks for the GGML types); shapes are SmolLM2-135M's fused
//! gate/up projection (`[3072, 576]`) and a `[576, 1536]` one (the down projection, whose
//! rows are whole K-quant blocks). Peak: an FMA loop with 12 independent accumulators per
//! thread on every thread (AVX-512 where the CPU has it, else AVX2), i.e. what the cores can
//! do in f32, not what memory can feed. Prints one line per (type, rows, shape) and a JSON
//! summary last.

use half::{bf16, f16};
use pagoda::backend::cpu::matmul::{Packed, Weights, matmul};
use pagoda::backend::cpu::qmatmul::{Path, qmatmul_on};
use pagoda::quant::{GgmlType, QuantTensor};
use rayon::prelude::*;
use std::time::{Duration, Instant};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn quant(ty: GgmlType, n: usize, k: usize, rng: &mut Rng) -> QuantTensor {
    let (block, bytes) = ty.block_layout();
    let mut data: Vec<u8> = (0..n * k / block * bytes)
        .map(|_| rng.next() as u8)
        .collect();
    let at: &[usize] = match ty {
        GgmlType::Q6_K => &[208],
        GgmlType::Q3_K => &[108],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => {
            &[0]
        }
        _ => &[0, 2],
    };
    for b in data.chunks_exact_mut(bytes) {
        for &i in at {
            b[i..i + 2].copy_from_slice(&f16::from_f32(rng.f32() * 0.05).to_le_bytes());
        }
    }
    QuantTensor::new(ty, n, k, data).unwrap()
}

/// Seconds per call: the median of runs filling about `budget`.
fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let t0 = Instant::now();
    f();
    let once = t0.elapsed().as_secs_f64().max(1e-7);
    let reps = ((budget.as_secs_f64() / once) as usize).clamp(3, 2000);
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// GFLOP/s of an FMA loop on every thread: the f32 peak.
fn peak_gflops() -> f64 {
    let threads = rayon::current_num_threads();
    let iters = 20_000_000usize;
    let t = Instant::now();
    let s: f32 = (0..threads)
        .into_par_iter()
        .map(|i| fma_loop(iters, i as f32))
        .sum();
    let secs = t.elapsed().as_secs_f64();
    std::hint::black_box(s);
    (threads * iters * 12 * lanes() * 2) as f64 / secs / 1e9
}

fn lanes() -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return 16;
    }
    8
}

fn fma_loop(iters: usize, seed: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected.
            return unsafe { fma512(iters, seed) };
        }
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: FMA and AVX were detected.
            return unsafe { fma256(iters, seed) };
        }
    }
    let _ = (iters, seed);
    0.0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma512(iters: usize, seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(seed); 12];
    let (a, b) = (_mm512_set1_ps(0.999_99), _mm512_set1_ps(1e-7));
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, a, b);
        }
    }
    acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma256(iters: usize, seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(seed); 12];
    let (a, b) = (_mm256_set1_ps(0.999_99), _mm256_set1_ps(1e-7));
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, a, b);
        }
    }
    let mut out = [0f32; 8];
    let mut s = 0.0;
    for v in acc {
        // SAFETY: out holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        s += out.iter().sum::<f32>();
    }
    s
}

fn main() {
    let mut rows: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if rows.is_empty() {
        rows = vec![1, 16, 64, 512];
    }
    let path = Path::detect();
    let peak = peak_gflops();
    println!(
        "threads {}, qmatmul path {}, f32 FMA peak {peak:.1} GFLOP/s",
        rayon::current_num_threads(),
        path.name()
    );
    let mut rng = Rng(1);
    let mut json = Vec::new();
    let types = [
        "f32", "f16", "bf16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
        "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
    ];
    // PAGODA_MATMUL_TYPES=Q4_K,Q6_K: only those types.
    let only_types = std::env::var("PAGODA_MATMUL_TYPES").unwrap_or_default();
    let only: Vec<&str> = only_types.split(',').filter(|t| !t.is_empty()).collect();
    let shapes: Vec<(usize, usize)> = match std::env::var("PAGODA_MATMUL_SHAPES") {
        Ok(s) => s
            .split(',')
            .filter_map(|p| p.split_once('x'))
            .filter_map(|(n, k)| Some((n.parse().ok()?, k.parse().ok()?)))
            .collect(),
        Err(_) => vec![(3072, 576), (576, 1536)],
    };
    for &(n, k) in &shapes {
        let wf: Vec<f32> = (0..n * k).map(|_| rng.f32() * 0.05).collect();
        let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let (wf, wh, wb) = (
            Packed::pack(&wf, n, k),
            Packed::pack(&wh, n, k),
            Packed::pack(&wb, n, k),
        );
        for name in types {
            if !only.is_empty() && !only.contains(&name) {
                continue;
            }
            let q = match name {
                "f32" | "f16" | "bf16" => None,
                t => {
                    let ty = match t {
                        "Q8_0" => GgmlType::Q8_0,
                        "Q4_0" => GgmlType::Q4_0,
                        "Q4_1" => GgmlType::Q4_1,
                        "Q5_0" => GgmlType::Q5_0,
                        "Q5_1" => GgmlType::Q5_1,
                        "Q2_K" => GgmlType::Q2_K,
                        "Q3_K" => GgmlType::Q3_K,
                        "Q4_K" => GgmlType::Q4_K,
                        "Q5_K" => GgmlType::Q5_K,
                        "IQ4_NL" => GgmlType::IQ4_NL,
                        "IQ4_XS" => GgmlType::IQ4_XS,
                        _ => GgmlType::Q6_K,
                    };
                    if !k.is_multiple_of(ty.block_layout().0) {
                        continue;
                    }
                    Some(quant(ty, n, k, &mut rng))
                }
            };
            for &m in &rows {
                let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
                let mut out = vec![0f32; m * n];
                let budget = Duration::from_millis(400);
                let secs = match (&q, name) {
                    (Some(q), _) => time(budget, || qmatmul_on(path, &x, m, k, n, &mut out, q)),
                    (None, "f32") => {
                        time(budget, || matmul(&x, m, k, n, &mut out, Weights::F32(&wf)))
                    }
                    (None, "f16") => {
                        time(budget, || matmul(&x, m, k, n, &mut out, Weights::F16(&wh)))
                    }
                    (None, _) => time(budget, || matmul(&x, m, k, n, &mut out, Weights::BF16(&wb))),
                };
                let gflops = 2.0 * (m * n * k) as f64 / secs / 1e9;
                let bytes = match (&q, name) {
                    (Some(q), _) => q.bytes(),
                    (None, "f32") => 4 * n * k,
                    (None, _) => 2 * n * k,
                };
                // the weight's bytes over the time: against the memory bandwidth at m = 1
                let gbs = bytes as f64 / secs / 1e9;
                println!(
                    "{name:>6} m={m:<4} [{n}x{k}]  {:>9.1} us  {gflops:>7.1} GFLOP/s  {:>5.1}% of peak  {gbs:>6.1} GB/s of weights",
                    secs * 1e6,
                    100.0 * gflops / peak
                );
                json.push(format!(
                    "{{\"type\": \"{name}\", \"m\": {m}, \"n\": {n}, \"k\": {k}, \"us\": {:.2}, \"gflops\": {gflops:.2}, \"weight_gbs\": {gbs:.2}}}",
                    secs * 1e6
                ));
            }
        }
    }
    println!(
        "{{\"path\": \"{}\", \"peak_gflops\": {peak:.1}, \"results\": [{}]}}",
        path.name(),
        json.join(", ")
    );
}
