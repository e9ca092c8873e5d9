//! `pagoda check-backend`: every backend operation against the CPU backend on fresh random
//! inputs, with the error of each in a table. Users run it on new hardware; the GPU checks run
//! it first (see scripts/gpu-check.sh).
//!
//! The table of op cases is the one place ops are checked: `check-backend` runs it against the
//! CPU backend, and `cargo test` (tests/backend_ops.rs) runs it for every compiled backend, the
//! CPU one included, against an f64 reference computed here. One file per op family (as
//! `kernels/*.cu`); an op is one struct there carrying its inputs, how a backend runs it
//! (`run`) and its f64 `reference`, with its rows in the family's `cases`; the struct's name in
//! the [`Case`] list below makes it part of the table.
//!
//! The error of a case is `max |got − want| / max |want|` (normalised by the reference's scale).
//! Tolerances: 1e-5 for f32 arithmetic, 1e-2 where a vendor GEMM rounds activations to f16/bf16
//! first, exact for argmax and for sampling on the device (whose cases keep clear of the
//! boundaries where rounding could choose another token).

mod attention;
mod cache;
mod elementwise;
mod linear;
mod norm;
mod qkv;
mod sample;
mod util;

use super::{Backend, BackendKind, CpuBackend, CudaBackend, EmuBackend, HipBackend, WgpuBackend};
use crate::tensor::DType;
use anyhow::{Result, bail};
use attention::Attention;
use cache::KvBlocks;
use elementwise::{Elementwise, Embedding, ScatterAdd};
use linear::{GatedMatmul, Lora, Matmul, QuantMatmul};
use norm::{LayerNorm, RmsNorm};
use qkv::{QkNorm, Rope, RopeWriteKv};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use sample::{Argmax, Logprobs, Sample};
use util::rel_err;

/// The op cases: each variant one op's struct, built once and run on both sides.
macro_rules! case_list {
    ($($op:ident),* $(,)?) => {
        // NOTE: a few dozen cases are built once per check; their sizes do not matter.
        #[allow(clippy::large_enum_variant)]
        enum Case {
            $($op($op),)*
        }

        /// Runs `case` on `be`: its outputs, flattened.
        fn run<B: Backend>(be: &B, case: &Case) -> Result<Vec<f32>> {
            match case {
                $(Case::$op(c) => c.run(be),)*
            }
        }

        /// What a case's outputs should be, in f64 and in the order [`run`] returns them: the
        /// reference `cargo test` checks every backend against (independent of the CPU
        /// backend's code).
        fn reference(case: &Case) -> Vec<f64> {
            match case {
                $(Case::$op(c) => c.reference(),)*
            }
        }

        $(impl From<$op> for Case {
            fn from(c: $op) -> Case {
                Case::$op(c)
            }
        })*
    };
}

case_list!(
    Matmul,
    GatedMatmul,
    QuantMatmul,
    Lora,
    RmsNorm,
    LayerNorm,
    Elementwise,
    Embedding,
    ScatterAdd,
    Rope,
    QkNorm,
    RopeWriteKv,
    Attention,
    Argmax,
    Sample,
    Logprobs,
    KvBlocks,
);

/// The table: (op, case, tolerance, inputs), every family's rows drawn from one stream.
fn cases(seed: u64) -> Vec<(String, String, f64, Case)> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    linear::cases(&mut r, &mut out);
    norm::cases(&mut r, &mut out);
    elementwise::cases(&mut r, &mut out);
    qkv::cases(&mut r, &mut out);
    attention::cases(&mut r, &mut out);
    sample::cases(&mut r, &mut out);
    cache::cases(&mut r, &mut out);
    elementwise::scatter_cases(&mut r, &mut out);
    linear::lora_cases(&mut r, &mut out);
    out
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct CheckRow {
    pub op: String,
    pub case: String,
    /// Normalised error; `None` when the op failed (see `error`).
    pub err: Option<f64>,
    pub tol: f64,
    pub error: Option<String>,
    pub micros: f64,
}

impl CheckRow {
    pub fn passed(&self) -> bool {
        self.err.is_some_and(|e| e <= self.tol)
    }
}

impl Case {
    /// The KV cache type a case allocates, if it allocates one.
    fn kv_dtype(&self) -> Option<DType> {
        match self {
            Case::Attention(Attention { kv, .. })
            | Case::KvBlocks(KvBlocks { kv, .. })
            | Case::RopeWriteKv(RopeWriteKv { kv, .. }) => Some(kv.dtype),
            _ => None,
        }
    }

    /// Whether `be` runs the case: a KV cache type it stores, random sampling where it samples
    /// on the device.
    fn runs_on<B: Backend>(&self, be: &B) -> bool {
        let kv = self
            .kv_dtype()
            .is_none_or(|d| be.kv_cache_dtypes().contains(&d));
        let blocks = match self {
            Case::QuantMatmul(c) => {
                !c.blocks_only || c.w.parts.iter().all(|p| be.keeps_quant(p.ty))
            }
            _ => true,
        };
        kv && blocks
            && (be.samples_on_device() || !matches!(self, Case::Sample(_) | Case::Logprobs(_)))
    }
}

/// Runs every case of the table on `be` against `want` (the CPU backend or the f64 reference).
/// Cases the backend does not run ([`Case::runs_on`]) are left out.
fn check_with<B: Backend>(
    be: &B,
    seed: u64,
    want: impl Fn(&Case) -> Result<Vec<f64>>,
) -> Vec<CheckRow> {
    cases(seed)
        .into_iter()
        .filter(|(.., case)| case.runs_on(be))
        .map(|(op, case_name, tol, case)| {
            let want = want(&case);
            let t0 = std::time::Instant::now();
            let got = run(be, &case);
            let micros = t0.elapsed().as_secs_f64() * 1e6;
            let (err, error) = match (got, want) {
                (Ok(g), Ok(w)) => (Some(rel_err(&g, &w)), None),
                (Err(e), _) => (None, Some(format!("{e:#}"))),
                (_, Err(e)) => (None, Some(format!("the reference failed: {e:#}"))),
            };
            CheckRow {
                op,
                case: case_name,
                err,
                tol,
                error,
                micros,
            }
        })
        .collect()
}

/// `pagoda check-backend`: every case on `be` and on the CPU backend.
pub fn check_backend<B: Backend>(be: &B, seed: u64) -> Vec<CheckRow> {
    let cpu = CpuBackend::new();
    check_with(be, seed, |case| {
        // NOTE: a cache type the CPU does not store is checked against the f64 reference,
        // which rounds K and V as the cache does; so is sampling on the device.
        if !case.runs_on(&cpu) {
            return Ok(reference(case));
        }
        Ok(run(&cpu, case)?.into_iter().map(f64::from).collect())
    })
}

/// The same table against an f64 reference computed here, independently of every backend:
/// what `cargo test` runs for each compiled backend (`tests/backend_ops.rs`).
pub fn check_against_reference<B: Backend>(be: &B, seed: u64) -> Vec<CheckRow> {
    check_with(be, seed, |case| Ok(reference(case)))
}

/// The products by weights in blocks, on `be` and on the CPU backend, which must agree to the
/// bit: the backends that keep a block type compute it with the CPU's operations in the CPU's
/// order (kernels/qmatmul.cu). The cases where they differ, named; none where `be` keeps no
/// block type.
pub fn quant_bits_against_cpu<B: Backend>(be: &B, seed: u64) -> Result<Vec<String>> {
    let cpu = CpuBackend::new();
    let mut differ = Vec::new();
    for (op, name, _, case) in cases(seed) {
        let Case::QuantMatmul(c) = &case else {
            continue;
        };
        if !c.w.parts.iter().all(|p| be.keeps_quant(p.ty)) {
            continue;
        }
        let (got, want) = (c.run(be)?, c.run(&cpu)?);
        let same = got.len() == want.len()
            && got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        if !same {
            let at = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            differ.push(format!("{op} {name}: first difference at {at:?}"));
        }
    }
    Ok(differ)
}

/// Creates the backend `kind` names and checks it.
pub fn check_backend_kind(kind: BackendKind, seed: u64) -> Result<(String, Vec<CheckRow>)> {
    fn go<B: Backend>(b: B, seed: u64) -> Result<(String, Vec<CheckRow>)> {
        Ok((b.name(), check_backend(&b, seed)))
    }
    match kind {
        BackendKind::Cpu => go(CpuBackend::new(), seed),
        BackendKind::Cuda => go(CudaBackend::new()?, seed),
        BackendKind::Hip => go(HipBackend::new()?, seed),
        BackendKind::Emu => go(EmuBackend::new()?, seed),
        BackendKind::Wgpu => go(WgpuBackend::new()?, seed),
        BackendKind::Auto => {
            bail!("check-backend needs a named backend (cuda, hip, wgpu, emu, cpu)")
        }
    }
}

/// The table as text, one line per case, with a summary line last.
pub fn format_table(backend: &str, rows: &[CheckRow]) -> String {
    let mut s = format!("check-backend: {backend} against cpu\n");
    s.push_str(&format!(
        "{:<20} {:<44} {:>10} {:>8} {:>10}  result\n",
        "op", "case", "error", "tol", "time (us)"
    ));
    for r in rows {
        let err = r.err.map_or("-".to_string(), |e| format!("{e:.2e}"));
        let result = match (&r.error, r.passed()) {
            (Some(e), _) => format!("ERROR {}", e.lines().next().unwrap_or("")),
            (None, true) => "ok".into(),
            (None, false) => "FAIL".into(),
        };
        s.push_str(&format!(
            "{:<20} {:<44} {:>10} {:>8.0e} {:>10.0}  {result}\n",
            r.op, r.case, err, r.tol, r.micros
        ));
    }
    let passed = rows.iter().filter(|r| r.passed()).count();
    s.push_str(&format!(
        "{passed} passed, {} failed\n",
        rows.len() - passed
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_agrees_with_itself() {
        let rows = check_backend(&CpuBackend::new(), 7);
        assert!(rows.len() > 30);
        for r in &rows {
            assert!(r.passed(), "{r:?}");
            assert_eq!(r.err, Some(0.0), "{r:?}");
        }
        let t = format_table("cpu", &rows);
        assert!(t.contains(&format!("{} passed, 0 failed", rows.len())));
    }

    #[test]
    fn the_cpu_backend_passes_the_table_against_the_f64_reference() {
        let rows = check_against_reference(&CpuBackend::new(), 7);
        let failed: Vec<_> = rows.iter().filter(|r| !r.passed()).collect();
        assert!(failed.is_empty(), "{failed:#?}");
    }

    #[test]
    fn the_reference_can_fail() {
        // a wrong output is caught: every case run on the CPU (or, for a case the CPU does not
        // run, the reference itself), its first value off by more than the output's scale
        let cpu = CpuBackend::new();
        for (_, name, tol, case) in cases(3) {
            let mut got = if case.runs_on(&cpu) {
                run(&cpu, &case).unwrap()
            } else {
                reference(&case).into_iter().map(|x| x as f32).collect()
            };
            let scale = got.iter().fold(0f32, |m, x| m.max(x.abs()));
            got[0] += 1.0 + scale;
            assert!(rel_err(&got, &reference(&case)) > tol, "{name}");
        }
    }
}
