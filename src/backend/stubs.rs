//! Backends whose Cargo feature is off, or whose implementation has not landed yet. They have
//! the shape of a real backend's constructor and say plainly why they cannot run, so that
//! callers contain no `#[cfg]`.

// NOTE: with every backend feature on, no stub is compiled and these go unused.
#[allow(unused_imports)]
use anyhow::{Result, bail};

/// `Backend` for a stub that can never be constructed, so that callers can pass it where a
/// backend goes (`build(WgpuBackend::new()?, ..)`) without a `#[cfg]`.
#[allow(unused_macros)]
macro_rules! stub_backend_impl {
    ($name:ident) => {
        #[allow(unused_variables)]
        impl crate::backend::Backend for $name {
            type Buf = std::convert::Infallible;
            fn name(&self) -> String {
                match self.0 {}
            }
            fn upload_weight(
                &self,
                t: &crate::tensor::HostTensor,
                dtype: crate::tensor::DType,
            ) -> Result<Self::Buf> {
                match self.0 {}
            }
            fn upload_f32(&self, data: &[f32]) -> Result<Self::Buf> {
                match self.0 {}
            }
            fn upload_u32(&self, data: &[u32]) -> Result<Self::Buf> {
                match self.0 {}
            }
            fn alloc_f32(&self, n: usize) -> Result<Self::Buf> {
                match self.0 {}
            }
            fn alloc_kv(&self, layout: crate::backend::KvLayout) -> Result<Self::Buf> {
                match self.0 {}
            }
            fn download_f32(&self, buf: &Self::Buf) -> Result<Vec<f32>> {
                match self.0 {}
            }
            fn read_kv_blocks(
                &self,
                cache: &Self::Buf,
                block_len: usize,
                blocks: &[u32],
            ) -> Result<Vec<f32>> {
                match self.0 {}
            }
            fn write_kv_blocks(
                &self,
                cache: &mut Self::Buf,
                block_len: usize,
                blocks: &[u32],
                data: &[f32],
            ) -> Result<()> {
                match self.0 {}
            }
            fn len(&self, buf: &Self::Buf) -> usize {
                match self.0 {}
            }
            fn embedding(
                &self,
                table: &Self::Buf,
                ids: &Self::Buf,
                dim: usize,
                out: &mut Self::Buf,
            ) -> Result<()> {
                match self.0 {}
            }
            fn matmul(
                &self,
                x: &Self::Buf,
                w: &Self::Buf,
                bias: Option<&Self::Buf>,
                m: usize,
                k: usize,
                n: usize,
                out: &mut Self::Buf,
            ) -> Result<()> {
                match self.0 {}
            }
            fn rms_norm(
                &self,
                x: &Self::Buf,
                w: &Self::Buf,
                rows: usize,
                dim: usize,
                eps: f32,
                out: &mut Self::Buf,
            ) -> Result<()> {
                match self.0 {}
            }
            fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf, n: usize) -> Result<()> {
                match self.0 {}
            }
            fn rope(
                &self,
                qkv: &mut Self::Buf,
                positions: &Self::Buf,
                cos: &Self::Buf,
                sin: &Self::Buf,
                rows: usize,
                layout: crate::backend::QkvLayout,
            ) -> Result<()> {
                match self.0 {}
            }
            fn gated_act(
                &self,
                gate_up: &Self::Buf,
                rows: usize,
                ffn: usize,
                act: crate::backend::Activation,
                out: &mut Self::Buf,
            ) -> Result<()> {
                match self.0 {}
            }
            fn act(
                &self,
                x: &mut Self::Buf,
                n: usize,
                act: crate::backend::Activation,
            ) -> Result<()> {
                match self.0 {}
            }
            fn scale(&self, x: &mut Self::Buf, s: f32, n: usize) -> Result<()> {
                match self.0 {}
            }
            fn softcap(&self, x: &mut Self::Buf, cap: f32, n: usize) -> Result<()> {
                match self.0 {}
            }
            fn clamp(&self, x: &mut Self::Buf, limit: f32, n: usize) -> Result<()> {
                match self.0 {}
            }
            fn layer_norm(
                &self,
                x: &Self::Buf,
                w: &Self::Buf,
                b: &Self::Buf,
                rows: usize,
                dim: usize,
                eps: f32,
                out: &mut Self::Buf,
            ) -> Result<()> {
                match self.0 {}
            }
            fn gather_rows(
                &self,
                x: &Self::Buf,
                rows: &Self::Buf,
                dim: usize,
                out: &mut Self::Buf,
            ) -> Result<()> {
                match self.0 {}
            }
            fn scatter_add_rows(
                &self,
                y: &Self::Buf,
                rows: &Self::Buf,
                weights: &Self::Buf,
                dim: usize,
                out: &mut Self::Buf,
            ) -> Result<()> {
                match self.0 {}
            }
            fn lora(
                &self,
                x: &Self::Buf,
                groups: &[crate::backend::LoraGroup<'_, Self>],
                k: usize,
                n: usize,
                out: &mut Self::Buf,
            ) -> Result<()> {
                match self.0 {}
            }
            fn write_kv(
                &self,
                qkv: &Self::Buf,
                slot_mapping: &Self::Buf,
                rows: usize,
                layout: crate::backend::QkvLayout,
                k_cache: &mut Self::Buf,
                v_cache: &mut Self::Buf,
                kv: crate::backend::KvLayout,
            ) -> Result<()> {
                match self.0 {}
            }
            fn qk_norm(
                &self,
                qkv: &mut Self::Buf,
                q_w: &Self::Buf,
                k_w: &Self::Buf,
                rows: usize,
                layout: crate::backend::QkvLayout,
                span: crate::backend::QkNormSpan,
                eps: f32,
            ) -> Result<()> {
                match self.0 {}
            }
            fn paged_attention(
                &self,
                qkv: &Self::Buf,
                k_cache: &Self::Buf,
                v_cache: &Self::Buf,
                batch: &crate::backend::DeviceBatch<Self>,
                layout: crate::backend::QkvLayout,
                kv: crate::backend::KvLayout,
                opts: crate::backend::AttentionOptions,
                out: &mut Self::Buf,
            ) -> Result<()> {
                match self.0 {}
            }
        }
    };
}

#[allow(unused_macros)]
macro_rules! unavailable_backend {
    ($name:ident, $feature:literal, $what:literal) => {
        /// Not available in this build; see [`Self::new`]. Never constructed.
        pub struct $name(#[allow(dead_code)] std::convert::Infallible);
        impl $name {
            pub fn new() -> Result<Self> {
                if cfg!(feature = $feature) {
                    bail!(concat!(
                        "the ",
                        $what,
                        " backend is declared (feature '",
                        $feature,
                        "') but not implemented yet"
                    ))
                } else {
                    bail!(concat!(
                        "this build of pagoda has no ",
                        $what,
                        " support: rebuild with `--features ",
                        $feature,
                        "`"
                    ))
                }
            }
            /// What a value of this type proves: that it cannot exist.
            pub fn never(&self) -> ! {
                match self.0 {}
            }
        }
    };
}

#[cfg(not(feature = "wgpu"))]
unavailable_backend!(WgpuBackend, "wgpu", "wgpu (WGSL)");
#[cfg(not(feature = "wgpu"))]
stub_backend_impl!(WgpuBackend);

#[cfg(not(feature = "wgpu"))]
impl WgpuBackend {
    /// A real GPU only, as `--backend auto` asks; here, the same error as [`Self::new`].
    pub fn new_hardware() -> Result<Self> {
        Self::new()
    }
}
#[cfg(not(feature = "cuda"))]
unavailable_backend!(CudaBackend, "cuda", "CUDA");
#[cfg(not(feature = "cuda"))]
stub_backend_impl!(CudaBackend);
#[cfg(not(feature = "hip"))]
unavailable_backend!(HipBackend, "hip", "HIP");
#[cfg(not(feature = "hip"))]
stub_backend_impl!(HipBackend);
