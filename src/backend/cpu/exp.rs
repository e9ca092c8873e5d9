//! The CPU backend's `eˣ`: one polynomial computed the same way by scalar code and by 8- and
//! 16-lane vectors, so softmax (attention.rs) and the gated SiLU give the same bits on every
//! path; libm's `expf` was called once per value.

// `exp_approx`'s constants: Cody and Waite's split of ln 2 and Cephes' `expf` polynomial.
const EXP_LO: f32 = -87.336_55;
const EXP_HI: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const ROUND: f32 = 12_582_912.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `eˣ` within 2.5e-7 relative (a few ulp) for `x` in [-87.3, 88] (clamped there):
/// `x = n·ln 2 + r`, a polynomial in `r`, times `2ⁿ` built in the exponent bits.
///
/// NOTE: ours rather than libm's so that the SIMD paths compute exactly the same bits 8 or 16
/// at a time: softmax called the scalar `expf` once per score.
#[inline(always)]
pub(super) fn exp_approx(x: f32) -> f32 {
    // NOTE: not `clamp`, which keeps a NaN; `max` drops it, as `_mm256_max_ps(x, lo)` does.
    #[allow(clippy::manual_clamp)]
    let x = x.max(EXP_LO).min(EXP_HI);
    // NOTE: rounded to the nearest integer (ties to even) by adding and taking away 1.5·2²³,
    // which needs no SSE4.1 `roundps`, so the portable loops vectorize (SiLU calls this).
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = EXP_P[0];
    for c in &EXP_P[1..] {
        p = p * r + c;
    }
    let y = (p * (r * r) + r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `o[i] = silu(g[i])·u[i]` eight at a time, with [`exp_approx`]'s operations (the same bits
/// as the portable `x / (1 + exp_approx(-x))·u`); returns how many it wrote.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn silu_mul_avx2(g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let n = g.len().min(u.len()).min(o.len()) / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    for i in (0..n).step_by(8) {
        // SAFETY: i + 8 <= n, within all three.
        unsafe {
            let x = _mm256_loadu_ps(g.as_ptr().add(i));
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            let y = _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(o.as_mut_ptr().add(i), y);
        }
    }
    n
}

/// [`exp_approx`] on 8 lanes: the same operations.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
        _mm256_set1_ps(EXP_HI),
    );
    let round = _mm256_set1_ps(ROUND);
    let n = _mm256_mul_ps(x, _mm256_set1_ps(LOG2E));
    let n = _mm256_sub_ps(_mm256_add_ps(n, round), round);
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))),
        _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)),
    );
    let mut p = _mm256_set1_ps(EXP_P[0]);
    for c in &EXP_P[1..] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(*c));
    }
    let y = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
        _mm256_set1_ps(1.0),
    );
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}

/// [`exp_approx`] on 16 lanes: the same operations.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
pub(super) fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(EXP_LO)),
        _mm512_set1_ps(EXP_HI),
    );
    let round = _mm512_set1_ps(ROUND);
    let n = _mm512_mul_ps(x, _mm512_set1_ps(LOG2E));
    let n = _mm512_sub_ps(_mm512_add_ps(n, round), round);
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI))),
        _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)),
    );
    let mut p = _mm512_set1_ps(EXP_P[0]);
    for c in &EXP_P[1..] {
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(*c));
    }
    let y = _mm512_add_ps(
        _mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r),
        _mm512_set1_ps(1.0),
    );
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    _mm512_mul_ps(y, _mm512_castsi512_ps(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 gated SiLU gives the portable bits.
    #[test]
    fn silu_on_avx2_matches_the_portable_loop() {
        if !super::super::matmul::Path::Avx2.available() {
            return;
        }
        let g: Vec<f32> = (0..203).map(|i| (i as f32 - 100.0) * 0.37).collect();
        let u: Vec<f32> = (0..203).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut got = vec![f32::NAN; 203];
        // SAFETY: AVX2 was detected.
        let n = unsafe { silu_mul_avx2(&g, &u, &mut got) };
        assert_eq!(n, 200);
        for i in 0..203 {
            let want = g[i] / (1.0 + exp_approx(-g[i])) * u[i];
            if i < n {
                assert_eq!(got[i], want, "{i}");
            }
            let exact = (g[i] as f64 / (1.0 + (-g[i] as f64).exp())) * u[i] as f64;
            assert!(
                (want as f64 - exact).abs() <= 1e-6 * exact.abs().max(1e-30),
                "{i}"
            );
        }
    }
}
