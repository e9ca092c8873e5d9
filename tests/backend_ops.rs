//! Every backend op against an independent f64 reference on fresh random inputs (never zeros),
//! through the one table of op cases in `pagoda::backend::check`: the same table `pagoda
//! check-backend` runs against the CPU backend, so the two cannot drift. Relative error at most
//! 1e-5 with f32 weights, 1e-2 where half weights meet a vendor GEMM, exact for argmax. The
//! `backend_ops!` macro runs the table for each compiled backend, with two seeds.

use pagoda::backend::Backend;
use pagoda::backend::check::check_against_reference;

/// Runs the table with each seed. `binding_limited`: a backend made with tiny storage bindings
/// may refuse the cases that cannot fit them (with an error saying so), never compute them
/// wrong, and must run most of the table.
fn check<B: Backend>(be: &B, seeds: &[u64], binding_limited: bool) {
    for &seed in seeds {
        let rows = check_against_reference(be, seed);
        assert!(rows.len() > 40, "the table lost its cases");
        let refused = |r: &&pagoda::backend::check::CheckRow| {
            binding_limited
                && r.error
                    .as_deref()
                    .is_some_and(|e| e.contains("storage binding"))
        };
        let failed: Vec<String> = rows
            .iter()
            .filter(|r| !r.passed() && !refused(r))
            .map(|r| match (&r.error, r.err) {
                (Some(e), _) => format!("{} {}: {e}", r.op, r.case),
                (None, err) => format!("{} {}: error {err:?} > {}", r.op, r.case, r.tol),
            })
            .collect();
        assert!(
            failed.is_empty(),
            "{} (seed {seed}):\n{}",
            be.name(),
            failed.join("\n")
        );
        let ran = rows.iter().filter(|r| r.passed()).count();
        assert!(
            ran * 5 >= rows.len() * 4,
            "only {ran} of {} cases ran",
            rows.len()
        );
    }
}

/// LoRA's update of a row is the same, to the bit, alone and among other rows of its adapter and
/// of another adapter (batch invariance: a request's tokens must not depend on what shares its
/// step).
fn lora_rows_are_batch_invariant<B: Backend>(be: &B) {
    use pagoda::backend::LoraGroup;
    use pagoda::tensor::{DType, HostTensor};
    use rand_chacha::ChaCha8Rng;
    use rand_chacha::rand_core::{Rng, SeedableRng};
    let mut r = ChaCha8Rng::seed_from_u64(40);
    let mut rand = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| r.next_u32() as f32 / u32::MAX as f32 * 2.0 - 1.0)
            .collect()
    };
    let (tokens, k, n) = (24, 160, 72);
    let (x, out0) = (rand(tokens * k), rand(tokens * n));
    let factors: Vec<(usize, Vec<f32>, Vec<f32>)> = [16, 8]
        .into_iter()
        .map(|rank| (rank, rand(rank * k), rand(n * rank)))
        .collect();
    let run = |rows: &[Vec<u32>]| -> Vec<f32> {
        let xb = be.upload_f32(&x).unwrap();
        let mut out = be.upload_f32(&out0).unwrap();
        let mut bufs = Vec::new();
        for ((rank, a, b), rows) in factors.iter().zip(rows) {
            let up = |t: Vec<usize>, v: &[f32]| {
                be.upload_weight(&HostTensor::new(t, v.to_vec()), DType::F16)
                    .unwrap()
            };
            bufs.push((
                be.upload_u32(rows).unwrap(),
                be.upload_f32(&vec![1.0; rows.len()]).unwrap(),
                up(vec![*rank, k], a),
                up(vec![n, *rank], b),
            ));
        }
        let groups: Vec<LoraGroup<B>> = bufs
            .iter()
            .zip(rows)
            .zip(&factors)
            .map(|(((ri, w, a, b), rows), f)| LoraGroup {
                rows: ri,
                weights: w,
                m: rows.len(),
                a,
                b,
                rank: f.0,
            })
            .collect();
        be.lora(&xb, &groups, k, n, &mut out).unwrap();
        be.download_f32(&out).unwrap()
    };
    let alone = run(&[vec![5]]);
    // row 5 the fourth of 13 rows of its adapter (two CPU tasks), the other adapter's rows around
    let many = run(&[
        (0..tokens as u32)
            .filter(|i| i % 2 == 0 || *i == 5)
            .collect(),
        (0..tokens as u32)
            .filter(|i| i % 2 == 1 && *i != 5)
            .collect(),
    ]);
    let row = |v: &[f32]| {
        v[5 * n..6 * n]
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    assert_ne!(
        row(&alone),
        row(&out0),
        "{}: the update changed nothing",
        be.name()
    );
    assert_eq!(
        row(&alone),
        row(&many),
        "{}: row 5 depends on the other rows",
        be.name()
    );
}

macro_rules! backend_ops {
    ($name:ident, $make:expr) => {
        backend_ops!($name, $make, &[1, 2], false);
    };
    ($name:ident, $make:expr, $seeds:expr, $limited:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            #[test]
            fn op_table_against_the_f64_reference() {
                let Some(b) = $make else { return };
                super::check(&b, $seeds, $limited);
            }
            #[test]
            fn lora_rows_are_batch_invariant() {
                let Some(b) = $make else { return };
                super::lora_rows_are_batch_invariant(&b);
            }
            #[test]
            fn weights_in_blocks_give_the_cpus_bits() {
                let Some(b) = $make else { return };
                let differ = pagoda::backend::check::quant_bits_against_cpu(&b, $seeds[0]).unwrap();
                assert!(differ.is_empty(), "{}:\n{}", b.name(), differ.join("\n"));
            }
        }
    };
}

backend_ops!(cpu, Some(pagoda::backend::CpuBackend::new()));

/// A compiled GPU backend, or `None` (with the reason printed) where this machine lacks it.
#[allow(dead_code)]
fn gpu_or_skip<B: Backend>(b: anyhow::Result<B>) -> Option<B> {
    match b {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipped: {e:#}");
            None
        }
    }
}

// The CUDA kernels on the CPU, under the host code of the GPU backends; with 64-lane warps too,
// as AMD's wavefronts run them; and with a block's threads run in reverse and shuffled between
// barriers, so that a kernel reading another thread's write without a barrier fails one of
// them. A machine without a C++ compiler fails here, naming it.
backend_ops!(emu, Some(pagoda::backend::EmuBackend::new().unwrap()));
backend_ops!(
    emu_warp64,
    Some(emu_with(64, Forward, false)),
    &[1, 2],
    false
);
backend_ops!(emu_reverse, Some(emu_with(32, Reverse, false)), &[3], false);
backend_ops!(
    emu_random,
    Some(emu_with(32, Random(7), false)),
    &[4],
    false
);
backend_ops!(
    emu_warp64_random,
    Some(emu_with(64, Random(8), false)),
    &[5],
    false
);
// The matrix products through the vendor-BLAS host path (the casts to the weights' type,
// cuBLAS's column-major call) against the emulator's reference with cuBLAS's contract.
backend_ops!(
    emu_blas,
    Some(emu_options(pagoda::backend::gpu::emu::EmuOptions {
        blas: true,
        ..pagoda::backend::gpu::emu::EmuOptions::from_env().unwrap()
    })),
    &[1, 7],
    false
);
// Multiplies and adds contracted to FMAs, as NVRTC compiles them by default: every tolerance
// must hold either way.
backend_ops!(
    emu_fp_contract,
    Some(emu_with(32, Forward, true)),
    &[1, 6],
    false
);

#[allow(unused_imports)]
use pagoda::backend::gpu::emu::ThreadOrder::{Forward, Random, Reverse};

fn emu_with(
    warp: u32,
    order: pagoda::backend::gpu::emu::ThreadOrder,
    fp_contract: bool,
) -> pagoda::backend::EmuBackend {
    emu_options(pagoda::backend::gpu::emu::EmuOptions {
        warp,
        order,
        fp_contract,
        ..pagoda::backend::gpu::emu::EmuOptions::from_env().unwrap()
    })
}

fn emu_options(o: pagoda::backend::gpu::emu::EmuOptions) -> pagoda::backend::EmuBackend {
    use pagoda::backend::gpu::emu::EmuRt;
    let rt = EmuRt::with_options(o).unwrap();
    pagoda::backend::gpu::GpuBackend::with_runtime(rt).unwrap()
}

#[cfg(feature = "cuda")]
backend_ops!(cuda, gpu_or_skip(pagoda::backend::CudaBackend::new()));
#[cfg(feature = "hip")]
backend_ops!(hip, gpu_or_skip(pagoda::backend::HipBackend::new()));

/// One wgpu device for the whole test binary (pipelines compile once); `WGPU_BACKEND=vulkan`
/// with Mesa's llvmpipe in CI.
#[cfg(feature = "wgpu")]
fn wgpu_backend(max_binding_bytes: Option<u64>) -> pagoda::backend::WgpuBackend {
    use pagoda::backend::wgpu::{WgpuBackend, WgpuOptions};
    use std::sync::OnceLock;
    static WHOLE: OnceLock<WgpuBackend> = OnceLock::new();
    static SPLIT: OnceLock<WgpuBackend> = OnceLock::new();
    let cell = if max_binding_bytes.is_some() {
        &SPLIT
    } else {
        &WHOLE
    };
    cell.get_or_init(|| {
        WgpuBackend::with_options(WgpuOptions {
            max_binding_bytes,
            disable_f16: max_binding_bytes.is_some(),
            // the GPU-tuned kernels on the split backend, whatever the adapter
            software_kernels: max_binding_bytes.map(|_| false),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("no wgpu adapter for the op tests: {e:#}"))
    })
    .clone()
}

#[cfg(feature = "wgpu")]
backend_ops!(wgpu, Some(wgpu_backend(None)));
// Storage bindings of 16 KiB: weights, the embedding table and the KV pool are split into parts
// and activations are bound in windows of rows, as on an adapter whose limits are small for the
// model; and no shader-f16, so f16 weights take the f32 fallback; and the kernels tuned for GPUs
// even on a software adapter (the other instance takes the adapter's choice).
#[cfg(feature = "wgpu")]
backend_ops!(wgpu_split, Some(wgpu_backend(Some(16 << 10))), &[3], true);
