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

unavailable_backend!(WgpuBackend, "wgpu", "wgpu (WGSL)");
unavailable_backend!(CudaBackend, "cuda", "CUDA");
unavailable_backend!(HipBackend, "hip", "HIP");
