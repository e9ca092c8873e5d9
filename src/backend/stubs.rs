//! Backends whose Cargo feature is off, or whose implementation has not landed yet. They have
//! the shape of a real backend's constructor and say plainly why they cannot run, so that
//! callers contain no `#[cfg]`.

use anyhow::{Result, bail};

macro_rules! unavailable_backend {
    ($name:ident, $feature:literal, $what:literal) => {
        /// Not available in this build; see [`Self::new`].
        pub struct $name;
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
        }
    };
}

/// A [`Backend`] for a stub, so that callers can pass it where a backend goes without a
/// `#[cfg]`. It is never constructed ([`new`](CudaBackend::new) always fails); each op says so.
#[allow(unused_macros)]
macro_rules! stub_backend_impl {
    ($name:ident) => {
        impl crate::backend::Backend for $name {
            type Buf = ();
            fn name(&self) -> String {
                stringify!($name).into()
            }
            fn upload_weight(
                &self,
                _: &crate::tensor::HostTensor,
                _: crate::tensor::DType,
            ) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn upload_f32(&self, _: &[f32]) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn upload_u32(&self, _: &[u32]) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn alloc_f32(&self, _: usize) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn alloc_kv(&self, _: crate::backend::KvLayout) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn download_f32(&self, _: &()) -> Result<Vec<f32>> {
                Self::new().map(|_| Vec::new())
            }
            fn len(&self, _: &()) -> usize {
                0
            }
            fn embedding(&self, _: &(), _: &(), _: usize, _: &mut ()) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn matmul(
                &self,
                _: &(),
                _: &(),
                _: Option<&()>,
                _: usize,
                _: usize,
                _: usize,
                _: &mut (),
            ) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn rms_norm(
                &self,
                _: &(),
                _: &(),
                _: usize,
                _: usize,
                _: f32,
                _: &mut (),
            ) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn add_assign(&self, _: &mut (), _: &(), _: usize) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn rope(
                &self,
                _: &mut (),
                _: &(),
                _: &(),
                _: &(),
                _: usize,
                _: crate::backend::QkvLayout,
            ) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn silu_mul(&self, _: &(), _: usize, _: usize, _: &mut ()) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn gather_rows(&self, _: &(), _: &(), _: usize, _: &mut ()) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn write_kv(
                &self,
                _: &(),
                _: &(),
                _: usize,
                _: crate::backend::QkvLayout,
                _: &mut (),
                _: &mut (),
                _: crate::backend::KvLayout,
            ) -> Result<()> {
                Self::new().map(|_| ())
            }
            fn paged_attention(
                &self,
                _: &(),
                _: &(),
                _: &(),
                _: &crate::backend::DeviceBatch<Self>,
                _: crate::backend::QkvLayout,
                _: crate::backend::KvLayout,
                _: f32,
                _: &mut (),
            ) -> Result<()> {
                Self::new().map(|_| ())
            }
        }
    };
}

unavailable_backend!(WgpuBackend, "wgpu", "wgpu (WGSL)");
#[cfg(not(feature = "cuda"))]
unavailable_backend!(CudaBackend, "cuda", "CUDA");
#[cfg(not(feature = "cuda"))]
stub_backend_impl!(CudaBackend);
#[cfg(not(feature = "hip"))]
unavailable_backend!(HipBackend, "hip", "HIP");
#[cfg(not(feature = "hip"))]
stub_backend_impl!(HipBackend);
