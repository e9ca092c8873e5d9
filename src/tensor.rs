//! Host-side tensors: what loaders produce and backends upload.

use std::collections::BTreeMap;

/// Element type of weights in memory (`--dtype`) and of the KV cache (`--kv-cache-dtype`).
/// Activations are always computed with f32 accumulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// FP8 E4M3 (OCP: 4 exponent bits, bias 7, 3 mantissa bits, no infinities, ±448 at most):
    /// a KV cache type only, as vLLM's `--kv-cache-dtype fp8`.
    F8E4M3,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3 => "fp8",
        }
    }
}

/// The largest finite FP8 E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// `x` as FP8 E4M3 bits: rounded to nearest even, saturated to ±448 (as CUDA's
/// `__NV_SATFINITE` conversion, which vLLM's fp8 cache uses), NaN to 0x7f. The kernels'
/// `f32_to_fp8_bits` (kernels/common.cuh) computes the same bits.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a.is_nan() {
        return 0x7f;
    }
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // NOTE: below 2^-6 the values are multiples of 2^-9 (subnormals); above, 3 mantissa bits.
    // Scaling into the f32 exponent where its rounding gives ours: add a magic number whose
    // ulp is the e4m3 ulp, as in the classic float-to-half conversion.
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    if exp < -6 {
        // subnormal (or zero): round a / 2^-9 to an integer, nearest even
        let q = (a * 512.0).round_ties_even() as u8;
        return sign | q; // q == 8 is 2^-6, the smallest normal: the encoding follows on
    }
    // normal: keep 3 mantissa bits, round to nearest even on the 20 dropped
    let m = bits & 0x7f_ffff;
    let mut e = (exp + 7) as u32;
    let mut q = m >> 20;
    let rest = m & 0xf_ffff;
    if rest > 0x8_0000 || (rest == 0x8_0000 && q & 1 == 1) {
        q += 1;
        if q == 8 {
            q = 0;
            e += 1;
        }
    }
    if e > 15 || (e == 15 && q == 7) {
        return sign | 0x7e; // rounded past 448
    }
    sign | ((e as u8) << 3) | q as u8
}

/// FP8 E4M3 bits as f32 (exact); 0x7f and 0xff are NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    if b & 0x7f == 0x7f {
        return f32::NAN;
    }
    // NOTE: the exponent and mantissa moved into f32's fields give 2^(e - 127)(1 + m/8) (and
    // the subnormals' 2^-126 · m/8): scaling by 2^120 makes them 2^(e - 7)(1 + m/8).
    let v = f32::from_bits((u32::from(b & 0x7f)) << 20) * f32::from_bits((120 + 127) << 23);
    if b & 0x80 != 0 { -v } else { v }
}

impl std::str::FromStr for DType {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            _ => anyhow::bail!("unknown dtype '{s}' (expected f32, f16 or bf16)"),
        }
    }
}

/// A dense row-major f32 tensor on the host. Shapes follow PyTorch/HF order:
/// a linear layer's weight is `[out_features, in_features]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        HostTensor { shape, data }
    }
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// The rows (first-dimension indices) in `ranges`, one run after the other.
    pub fn select_rows(&self, ranges: &[std::ops::Range<usize>]) -> anyhow::Result<HostTensor> {
        let rows = self.shape.first().copied().unwrap_or(0);
        let row_len: usize = self.shape.iter().skip(1).product();
        let mut data = Vec::new();
        let mut n = 0;
        for r in ranges {
            if r.start > r.end || r.end > rows {
                anyhow::bail!("rows {}..{} of a tensor with {rows}", r.start, r.end);
            }
            data.extend_from_slice(&self.data[r.start * row_len..r.end * row_len]);
            n += r.len();
        }
        let mut shape = self.shape.clone();
        shape[0] = n;
        Ok(HostTensor::new(shape, data))
    }

    /// Columns `c` of every row of a matrix.
    pub fn slice_cols(&self, c: std::ops::Range<usize>) -> anyhow::Result<HostTensor> {
        let &[rows, cols] = self.shape.as_slice() else {
            anyhow::bail!("slicing the columns of a tensor of shape {:?}", self.shape);
        };
        if c.start > c.end || c.end > cols {
            anyhow::bail!("columns {}..{} of a matrix with {cols}", c.start, c.end);
        }
        let data = self
            .data
            .chunks_exact(cols.max(1))
            .flat_map(|row| row[c.clone()].iter().copied())
            .collect();
        Ok(HostTensor::new(vec![rows, c.len()], data))
    }
}

/// `--dtype`: how linear weights are kept in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WeightDtype {
    /// As the file stores them: a GGUF's block formats stay quantized where the backend has
    /// kernels for them (the CPU), f16/bf16/f32 tensors stay in their type; a block format
    /// without kernels becomes f32.
    #[default]
    Auto,
    /// Every weight converted to this type (f32 reproduces the reference exactly).
    Fixed(DType),
}

impl WeightDtype {
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::Auto => "auto",
            WeightDtype::Fixed(d) => d.name(),
        }
    }
}

impl From<DType> for WeightDtype {
    fn from(d: DType) -> Self {
        WeightDtype::Fixed(d)
    }
}

impl std::str::FromStr for WeightDtype {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(WeightDtype::Auto);
        }
        s.parse::<DType>()
            .map(WeightDtype::Fixed)
            .map_err(|_| anyhow::anyhow!("unknown dtype '{s}' (expected auto, f32, f16 or bf16)"))
    }
}

/// What a model's weights take once uploaded, as counted while loading.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WeightStats {
    /// Bytes of every weight, norm and bias.
    pub bytes: u64,
    /// Elements of every weight, norm and bias.
    pub params: u64,
    /// Bytes by storage type (`f32`, `bf16`, `Q4_1`, ...).
    pub by_type: BTreeMap<String, u64>,
}

impl WeightStats {
    pub fn add(&mut self, ty: String, bytes: u64, params: u64) {
        self.bytes += bytes;
        self.params += params;
        *self.by_type.entry(ty).or_default() += bytes;
    }

    /// Adds another worker's weights (a model split over workers).
    pub fn absorb(&mut self, other: &WeightStats) {
        self.bytes += other.bytes;
        self.params += other.params;
        for (t, b) in &other.by_type {
            *self.by_type.entry(t.clone()).or_default() += b;
        }
    }

    /// `Q4_1 84.2 MiB, f32 28.1 MiB` (largest first).
    pub fn describe(&self) -> String {
        let mut v: Vec<(&String, &u64)> = self.by_type.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1));
        v.iter()
            .map(|(t, b)| format!("{t} {:.1} MiB", **b as f64 / (1u64 << 20) as f64))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite E4M3 value from its definition: (-1)^s 2^(e-7) (1 + m/8), subnormals
    /// 2^-6 m/8.
    fn e4m3_value(b: u8) -> Option<f64> {
        let (e, m) = (i32::from(b >> 3 & 0xf), f64::from(b & 7));
        if b & 0x7f == 0x7f {
            return None;
        }
        let v = if e == 0 {
            m / 8.0 * 2f64.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f64.powi(e - 7)
        };
        Some(if b & 0x80 != 0 { -v } else { v })
    }

    #[test]
    fn e4m3_widens_exactly_and_rounds_to_the_nearest_even_value() {
        for b in 0..=255u8 {
            match e4m3_value(b) {
                Some(v) => assert_eq!(e4m3_to_f32(b) as f64, v, "{b:#x}"),
                None => assert!(e4m3_to_f32(b).is_nan(), "{b:#x}"),
            }
        }
        let finite: Vec<(f64, u8)> = (0..=255u8)
            .filter_map(|b| e4m3_value(b).map(|v| (v, b)))
            .collect();
        // the nearest value by brute force; ties to the even encoding; beyond 448: ±448
        let nearest = |x: f32| -> f64 {
            let x = f64::from(x).clamp(-448.0, 448.0);
            let mut best = (f64::INFINITY, 0u8);
            for &(v, b) in &finite {
                let d = (v - x).abs();
                if d < best.0 || (d == best.0 && b & 1 == 0) {
                    best = (d, b);
                }
            }
            e4m3_value(best.1).unwrap()
        };
        let mut x = 1e-4f32;
        let mut samples = vec![
            0.0f32,
            448.0,
            449.0,
            464.0,
            480.0,
            1e9,
            2f32.powi(-10),
            2f32.powi(-9) * 1.5,
        ];
        while x < 600.0 {
            samples.push(x);
            x *= 1.0137;
        }
        // the midpoints between neighbours, and a hair either side of them
        for w in finite.windows(2) {
            let mid = ((w[0].0 + w[1].0) / 2.0) as f32;
            samples.extend([mid, mid.next_up(), mid.next_down()]);
        }
        for &s in &samples {
            for x in [s, -s] {
                let got = e4m3_to_f32(f32_to_e4m3(x)) as f64;
                assert_eq!(got, nearest(x), "{x:e}");
            }
        }
        assert!(e4m3_to_f32(f32_to_e4m3(f32::NAN)).is_nan());
    }
}
