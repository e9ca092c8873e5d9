//! Helpers the CPU kernels share (matmul.rs, qmatmul.rs, attention.rs): prefetching and the one
//! fixed order in which 8 lanes are summed.

/// The widest instruction set the CPU kernels may pick, from `PAGODA_CPU_ISA`: `avx512`,
/// `avx2` or `portable` (0, 1, 2 below; unset: whatever the CPU has). It measures a narrower
/// machine's kernels on a wider one, as llama.cpp's `GGML_AVX512=OFF` builds do.
pub fn isa_cap() -> anyhow::Result<u8> {
    match std::env::var("PAGODA_CPU_ISA").as_deref() {
        Err(_) | Ok("avx512") => Ok(2),
        Ok("avx2") => Ok(1),
        Ok("portable") => Ok(0),
        Ok(other) => anyhow::bail!("PAGODA_CPU_ISA={other}: expected avx512, avx2 or portable"),
    }
}

/// [`isa_cap`] read once (the engine checks it when it starts: see `engine::launch`).
pub fn isa_level() -> u8 {
    static LEVEL: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| isa_cap().unwrap_or(2))
}

/// How far ahead the first row tile over a panel block prefetches the panels' weights.
/// NOTE: a model's weights do not fit in the caches, so every step streams them from memory;
/// the hardware prefetcher alone left 64-row f16 steps 15% slower than with weights in L3.
/// 4 KiB ahead measured best (2 to 32 KiB tried) for f16 and f32 weights alike.
pub const PREFETCH_BYTES: usize = 4096;

/// Asks for the cache lines of the `len` bytes from `p` (a hint: never dereferenced).
#[inline(always)]
pub fn prefetch_lines(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for l in (0..len).step_by(64) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l) as *const i8) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

/// The 8 lanes summed in [`reduce8`]'s order.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn hsum8(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h)))
}

/// One fixed pairwise order for 8 lanes (qmatmul.rs's SIMD reductions follow it).
#[inline(always)]
pub fn reduce8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}
