//! Host-side tensors: what loaders produce and backends upload.

/// Element type of weights in memory (`--dtype`). Activations are always computed with
/// f32 accumulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
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
