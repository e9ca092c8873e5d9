//! Which runner a run gets: the model on one device, workers for tensor and pipeline
//! parallelism (`workers.rs`), or, on a node other than 0, that node's share of the workers
//! (`nodes.rs`); and the backend each runs on.

use super::nodes;
use super::runner::{ModelRunner, RunnerArgs, build};
use super::workers::build_parallel;
use crate::backend::{
    Backend, BackendKind, CpuBackend, CudaBackend, EmuBackend, HipBackend, WgpuBackend,
};
use crate::models::LoadedModel;
use crate::parallel::MultiDevice;
use anyhow::{Result, bail};

pub fn create_runner(
    model: &LoadedModel,
    args: &RunnerArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn ModelRunner>> {
    if args.nodes.node_rank > 0 {
        bail!(
            "node rank {} runs workers only, not the engine (engine::run_worker_node)",
            args.nodes.node_rank
        );
    }
    crate::backend::cpu::simd::isa_cap()?;
    // NOTE: PAGODA_PARALLEL_RUNNER=1 runs even one device through the workers and the device
    // communicator (NCCL), so that a machine with one GPU checks that path.
    let forced = std::env::var("PAGODA_PARALLEL_RUNNER").is_ok_and(|v| v == "1");
    if forced || !args.parallel.is_single() || !args.nodes.is_single() {
        return create_parallel(model, args, progress);
    }
    match args.backend {
        BackendKind::Cpu => build(CpuBackend::new(), model, args, progress),
        BackendKind::Auto => {
            // NOTE: CUDA, then HIP, then wgpu on a real GPU (never a software rasteriser), then
            // the CPU; each one passed over is logged with its reason.
            match CudaBackend::new() {
                Ok(b) => return build(b, model, args, progress),
                Err(e) => tracing::info!("backend auto: cuda unavailable: {e:#}"),
            }
            match HipBackend::new() {
                Ok(b) => return build(b, model, args, progress),
                Err(e) => tracing::info!("backend auto: hip unavailable: {e:#}"),
            }
            match WgpuBackend::new_hardware() {
                Ok(b) => {
                    tracing::info!("backend auto: using {} (a real GPU)", b.name());
                    return build(b, model, args, progress);
                }
                Err(e) => tracing::info!("backend auto: wgpu unavailable: {e:#}"),
            }
            tracing::info!("backend auto: using cpu");
            build(CpuBackend::new(), model, args, progress)
        }
        BackendKind::Cuda => build(CudaBackend::new()?, model, args, progress),
        BackendKind::Hip => build(HipBackend::new()?, model, args, progress),
        BackendKind::Emu => build(EmuBackend::new()?, model, args, progress),
        BackendKind::Wgpu => build(WgpuBackend::new()?, model, args, progress),
    }
}

/// Workers for tensor and pipeline parallelism: one per device on CUDA and HIP (NCCL, RCCL),
/// on the emulated GPU (through the host), and threads sharing the CPU.
fn create_parallel(
    model: &LoadedModel,
    args: &RunnerArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn ModelRunner>> {
    match parallel_backend(args)? {
        BackendKind::Cuda => build_parallel::<CudaBackend>(model, args, progress),
        BackendKind::Hip => build_parallel::<HipBackend>(model, args, progress),
        BackendKind::Emu => build_parallel::<EmuBackend>(model, args, progress),
        _ => build_parallel::<CpuBackend>(model, args, progress),
    }
}

/// A node other than 0 of a run over several nodes: its workers, on the backend chosen as on
/// node 0.
pub fn serve_node(model: &LoadedModel, args: &RunnerArgs) -> Result<()> {
    match parallel_backend(args)? {
        BackendKind::Cuda => nodes::serve_node::<CudaBackend>(model, args),
        BackendKind::Hip => nodes::serve_node::<HipBackend>(model, args),
        BackendKind::Emu => nodes::serve_node::<EmuBackend>(model, args),
        _ => nodes::serve_node::<CpuBackend>(model, args),
    }
}

/// The backend the workers of tensor and pipeline parallelism run on: `auto` picks a GPU where
/// there is one, as for one device; wgpu cannot (it has no way to pass buffers between
/// devices).
fn parallel_backend(args: &RunnerArgs) -> Result<BackendKind> {
    let kind = match args.backend {
        BackendKind::Auto => {
            if CudaBackend::device_count().is_ok() {
                BackendKind::Cuda
            } else if HipBackend::device_count().is_ok() {
                BackendKind::Hip
            } else if WgpuBackend::new_hardware().is_ok() {
                BackendKind::Wgpu
            } else {
                BackendKind::Cpu
            }
        }
        k => k,
    };
    Ok(match kind {
        BackendKind::Wgpu => bail!(
            "--tensor-parallel-size {} --pipeline-parallel-size {} is not available on wgpu (it \
             has no way to pass buffers between devices); use cuda, hip or cpu",
            args.parallel.tensor,
            args.parallel.pipeline
        ),
        k => k,
    })
}
