//! The GGML block types the quantized kernels take, as const-generic codes, what the portable
//! and the x86 kernels both read of them, and the kernel paths.

use crate::quant::GgmlType;

// Type codes for the const-generic kernels.
pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q5_0: u8 = 2;
pub(super) const Q5_1: u8 = 3;
pub(super) const Q8_0: u8 = 4;
pub(super) const Q4_K: u8 = 5;
pub(super) const Q5_K: u8 = 6;
pub(super) const Q6_K: u8 = 7;
pub(super) const Q2_K: u8 = 8;
pub(super) const Q3_K: u8 = 9;
pub(super) const IQ4_NL: u8 = 10;
pub(super) const IQ4_XS: u8 = 11;

pub(super) fn code(ty: GgmlType) -> Option<u8> {
    Some(match ty {
        GgmlType::Q4_0 => Q4_0,
        GgmlType::Q4_1 => Q4_1,
        GgmlType::Q5_0 => Q5_0,
        GgmlType::Q5_1 => Q5_1,
        GgmlType::Q8_0 => Q8_0,
        GgmlType::Q4_K => Q4_K,
        GgmlType::Q5_K => Q5_K,
        GgmlType::Q6_K => Q6_K,
        GgmlType::Q2_K => Q2_K,
        GgmlType::Q3_K => Q3_K,
        GgmlType::IQ4_NL => IQ4_NL,
        GgmlType::IQ4_XS => IQ4_XS,
        _ => return None,
    })
}

/// Whether the type is a K-quant (super-blocks of 256, the kernels of `kquant.rs`); the
/// others have blocks of 32.
pub(super) const fn is_k(t: u8) -> bool {
    matches!(t, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS)
}

/// Bytes of one block of 32 (a type that is not a K-quant).
pub(super) const fn block_bytes(t: u8) -> usize {
    match t {
        Q4_0 | IQ4_NL => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 34,
    }
}

/// Whether the type has a minimum (`w = scale·v + min`); its decoded values are never
/// negative.
pub(super) const fn has_min(t: u8) -> bool {
    matches!(t, Q4_1 | Q5_1 | Q2_K | Q4_K | Q5_K)
}

/// Q4_K / Q5_K: the 6-bit (scale, min) of sub-block `j` from the 12 packed bytes.
#[inline(always)]
pub(super) fn k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The most rows of `x` in a tile (the AVX-512 path's; the others take 4).
pub(super) const MR: usize = 8;

/// A kernel implementation; [`Path::detect`] picks the best the CPU has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Plain Rust: the reference for the others, and the path on non-x86 CPUs.
    Portable,
    /// AVX2 + FMA + F16C (`maddubs` integer dots).
    Avx2,
    /// AVX-512 with VNNI (`dpbusd` integer dots on 512-bit vectors).
    Avx512,
}

impl Path {
    /// The fastest path this CPU runs, within `PAGODA_CPU_ISA`.
    pub fn detect() -> Path {
        [Path::Avx512, Path::Avx2]
            .into_iter()
            .find(|&p| p.available() && p as u8 <= super::super::simd::isa_level())
            .unwrap_or(Path::Portable)
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            Path::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => {
                use std::arch::is_x86_feature_detected as has;
                has!("avx2") && has!("fma") && has!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => {
                use std::arch::is_x86_feature_detected as has;
                Path::Avx2.available()
                    && has!("avx512f")
                    && has!("avx512bw")
                    && has!("avx512dq")
                    && has!("avx512vl")
                    && has!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Path::Portable => "portable",
            Path::Avx2 => "avx2",
            Path::Avx512 => "avx512-vnni",
        }
    }
}
