//! The GPU backends where there is no GPU (CI): they build, their creation fails with an error
//! that says what is missing (no panic, no abort), and — where NVRTC can be loaded, which needs
//! no GPU — every kernel file compiles for real architectures. On a machine with a GPU the
//! same tests check that creation succeeds; the op tests are in tests/backend_ops.rs.
//!
//! NVRTC without a GPU: `pip install nvidia-cuda-nvrtc==13.0.*` ships libnvrtc.so.13; put its
//! `nvidia/cu13/lib` folder on LD_LIBRARY_PATH (.ci/run does this when it can).

#[cfg(feature = "cuda")]
#[test]
fn cuda_backend_creation_is_clean() {
    match pagoda::backend::CudaBackend::new() {
        Ok(b) => println!(
            "CUDA device present: {}",
            pagoda::backend::Backend::name(&b)
        ),
        Err(e) => {
            let msg = format!("{e:#}");
            println!("no CUDA backend here: {msg}");
            assert!(msg.starts_with("CUDA"), "unclear error: {msg}");
            assert!(
                msg.contains("not found") || msg.contains("no GPU") || msg.contains("failed"),
                "unclear error: {msg}"
            );
        }
    }
}

#[cfg(feature = "hip")]
#[test]
fn hip_backend_creation_is_clean() {
    match pagoda::backend::HipBackend::new() {
        Ok(b) => println!("HIP device present: {}", pagoda::backend::Backend::name(&b)),
        Err(e) => {
            let msg = format!("{e:#}");
            println!("no HIP backend here: {msg}");
            assert!(msg.starts_with("HIP"), "unclear error: {msg}");
        }
    }
}

/// `check-backend` on a backend that cannot be created is an error, not a panic.
#[test]
fn check_backend_without_the_backend_is_an_error() {
    use pagoda::BackendKind;
    for kind in [BackendKind::Cuda, BackendKind::Hip] {
        if let Err(e) = pagoda::backend::check::check_backend_kind(kind, 0) {
            assert!(!format!("{e:#}").is_empty());
        }
    }
}

#[cfg(feature = "cuda")]
#[test]
fn kernels_compile_with_nvrtc() {
    use pagoda::backend::cuda::{
        arch_has_tensor_cores, nvrtc_compile, nvrtc_options, nvrtc_version,
    };
    use pagoda::backend::gpu::kernels::{Dialect, SOURCES, kernel_names, prepare};
    let Some((major, minor)) = nvrtc_version() else {
        println!(
            "skipped: NVRTC (libnvrtc.so) not found; install nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH to compile the kernels here"
        );
        return;
    };
    println!("NVRTC {major}.{minor}");
    // Ampere, Ada and Hopper (all with tensor cores): real cubins, the backend's options.
    for arch in ["sm_80", "sm_89", "sm_90"] {
        for (stem, src) in SOURCES {
            let tc = arch_has_tensor_cores(arch);
            let source = prepare(stem, src, Dialect::Cuda, tc);
            let bin = nvrtc_compile(&format!("{stem}.cu"), &source, &nvrtc_options(arch))
                .unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(&bin[..4], b"\x7fELF", "{stem} for {arch}: not a cubin");
            // every kernel the backend will look up is in the cubin's symbols
            for k in kernel_names(stem, tc) {
                let sym = format!("\0{k}\0");
                assert!(
                    bin.windows(sym.len()).any(|w| w == sym.as_bytes()),
                    "{stem} for {arch}: no kernel {k}"
                );
            }
        }
    }
}
