//! The wgpu device: adapter choice, device with the adapter's real limits, errors turned into
//! `Result`s, buffers, and the recorder that puts every dispatch of a step into one command
//! encoder.

use super::kernels::{self, Kernel, PipelineKey};
use anyhow::{Context, Result, bail, ensure};
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex, mpsc};

/// Which adapters may be picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterPolicy {
    /// The best adapter there is, a software rasteriser if nothing else (`--backend wgpu`).
    Any,
    /// A real GPU only (`--backend auto`).
    HardwareOnly,
}

/// Adapters that rasterise on the CPU, by the names their drivers give.
const SOFTWARE_NAMES: [&str; 4] = ["llvmpipe", "lavapipe", "swiftshader", "basic render"];

pub fn is_software(info: &wgpu::AdapterInfo) -> bool {
    let name = info.name.to_ascii_lowercase();
    info.device_type == wgpu::DeviceType::Cpu || SOFTWARE_NAMES.iter().any(|s| name.contains(s))
}

fn rank(info: &wgpu::AdapterInfo) -> u32 {
    if is_software(info) {
        return 9;
    }
    match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 9,
    }
}

fn describe(info: &wgpu::AdapterInfo) -> String {
    format!("{} ({:?}, {:?})", info.name, info.backend, info.device_type)
}

/// Picks an adapter. `WGPU_BACKEND` (vulkan, metal, dx12) limits the APIs searched and
/// `WGPU_ADAPTER_NAME` (a substring, any case) the adapters.
pub fn pick_adapter(policy: AdapterPolicy) -> Result<(wgpu::Adapter, String)> {
    let desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    let backends = desc.backends;
    let instance = wgpu::Instance::new(desc);
    let mut adapters = pollster::block_on(instance.enumerate_adapters(backends));
    if adapters.is_empty() {
        bail!(
            "no wgpu adapter found (APIs searched: {backends:?}); a Vulkan, Metal or DX12 driver is \
             needed (on Linux without a GPU, Mesa's software Vulkan driver: packages \
             mesa-vulkan-drivers and libvulkan1)"
        );
    }
    if let Ok(want) = std::env::var("WGPU_ADAPTER_NAME") {
        let want = want.to_ascii_lowercase();
        let names: Vec<String> = adapters.iter().map(|a| describe(&a.get_info())).collect();
        adapters.retain(|a| a.get_info().name.to_ascii_lowercase().contains(&want));
        if adapters.is_empty() {
            bail!(
                "no wgpu adapter matches WGPU_ADAPTER_NAME={want:?}; there are: {}",
                names.join(", ")
            );
        }
    }
    adapters.sort_by_key(|a| rank(&a.get_info()));
    let best = adapters.remove(0);
    let info = best.get_info();
    if policy == AdapterPolicy::HardwareOnly && is_software(&info) {
        bail!(
            "the only wgpu adapter is a software rasteriser, {}; `--backend auto` does not pick it \
             (ask for `--backend wgpu` to use it)",
            describe(&info)
        );
    }
    let why = if is_software(&info) {
        "software rasteriser".to_string()
    } else {
        format!("{:?}", info.device_type)
    };
    Ok((best, why))
}

/// Bytes of device-local memory of the adapter, where the API says (Vulkan). Software adapters
/// share host memory: `None`, so the KV pool is sized as on the CPU backend.
fn device_local_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    if is_software(&adapter.get_info()) {
        return None;
    }
    #[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
    {
        // SAFETY: a read-only query of the adapter's own physical device through wgpu-hal's
        // Vulkan handles, which outlive the guard.
        unsafe {
            let hal = adapter.as_hal::<wgpu::hal::api::Vulkan>()?;
            let props = hal
                .shared_instance()
                .raw_instance()
                .get_physical_device_memory_properties(hal.raw_physical_device());
            const DEVICE_LOCAL: u32 = 0x1; // VK_MEMORY_HEAP_DEVICE_LOCAL_BIT
            props.memory_heaps[..props.memory_heap_count as usize]
                .iter()
                .filter(|h| h.flags.as_raw() & DEVICE_LOCAL != 0)
                .map(|h| h.size)
                .max()
        }
    }
    #[cfg(any(target_vendor = "apple", target_arch = "wasm32"))]
    {
        None
    }
}

/// Bytes of uniform data per dispatch (the largest `min_uniform_buffer_offset_alignment`).
const PARAMS_SLOT: u64 = 256;
/// Dispatches recorded before the encoder is submitted on its own.
const MAX_DISPATCHES: u64 = 4096;

/// The open command encoder of the current step.
#[derive(Default)]
struct Recorder {
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    /// Uniform parameters of the recorded dispatches, one `PARAMS_SLOT` each, written to
    /// `Gpu::params` just before the encoder is submitted.
    params: Vec<u8>,
}

impl Recorder {
    /// The encoder to record a copy into, after everything recorded so far (the open compute
    /// pass is closed first).
    fn copy_encoder(&mut self, device: &wgpu::Device) -> &mut wgpu::CommandEncoder {
        self.pass = None;
        self.encoder.get_or_insert_with(|| {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("copies"),
            })
        })
    }
}

/// A part of a buffer bound to a kernel.
#[derive(Clone, Copy)]
pub struct Bind<'a> {
    pub buf: &'a wgpu::Buffer,
    pub offset: u64,
    pub size: u64,
}

impl<'a> Bind<'a> {
    pub fn whole(buf: &'a wgpu::Buffer) -> Self {
        Bind {
            buf,
            offset: 0,
            size: buf.size(),
        }
    }
}

pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// The adapter has `shader-f16` and the device was created with it.
    pub f16: bool,
    pub memory: Option<u64>,
    /// The largest storage binding (and so the largest part of a split buffer), in bytes.
    pub max_binding: u64,
    error: Arc<Mutex<Option<String>>>,
    lost: Arc<Mutex<Option<String>>>,
    recorder: Mutex<Recorder>,
    params: wgpu::Buffer,
    /// A small buffer bound where a kernel's optional input is absent.
    pub dummy: wgpu::Buffer,
    pipelines: Mutex<HashMap<PipelineKey, wgpu::ComputePipeline>>,
}

impl Gpu {
    pub fn new(
        policy: AdapterPolicy,
        max_binding: Option<u64>,
        allow_f16: bool,
    ) -> Result<(Self, String)> {
        let (adapter, why) = pick_adapter(policy)?;
        let info = adapter.get_info();
        let f16 = allow_f16 && adapter.features().contains(wgpu::Features::SHADER_F16);
        // NOTE: the adapter's real limits, not WebGPU's defaults: a 128 MiB storage binding
        // would otherwise cap every buffer.
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("pagoda"),
            required_features: if f16 {
                wgpu::Features::SHADER_F16
            } else {
                wgpu::Features::empty()
            },
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .with_context(|| format!("cannot open a wgpu device on {}", describe(&info)))?;
        let error = Arc::new(Mutex::new(None::<String>));
        let sink = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(e.to_string());
            }
        }));
        let lost = Arc::new(Mutex::new(None::<String>));
        let lost_sink = lost.clone();
        device.set_device_lost_callback(move |reason, msg| {
            *lost_sink.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(format!("{reason:?}: {msg}"));
        });
        let mut max_bind = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        if let Some(m) = max_binding {
            max_bind = max_bind.min(m);
        }
        // whole 256-byte steps, so that windows and parts stay aligned
        max_bind &= !255;
        let usage = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST;
        let params = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: PARAMS_SLOT * MAX_DISPATCHES,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let dummy = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dummy"),
            size: 16,
            usage,
            mapped_at_creation: false,
        });
        let gpu = Gpu {
            memory: device_local_bytes(&adapter),
            device,
            queue,
            info,
            limits,
            f16,
            max_binding: max_bind,
            error,
            lost,
            recorder: Mutex::new(Recorder::default()),
            params,
            dummy,
            pipelines: Mutex::new(HashMap::new()),
        };
        gpu.check()?;
        Ok((gpu, why))
    }

    pub fn describe(&self) -> String {
        describe(&self.info)
    }

    /// The first error the device reported since the last check, or its loss.
    pub fn check(&self) -> Result<()> {
        let error = self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
        if error.is_some() {
            // NOTE: a lost device reports itself from a poll; its loss explains the error
            let _ = self.device.poll(wgpu::PollType::Poll);
        }
        if let Some(reason) = self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            bail!("the wgpu device ({}) was lost: {reason}", self.info.name);
        }
        if let Some(e) = error {
            bail!("wgpu error on {}: {e}", self.info.name);
        }
        Ok(())
    }

    /// A zero-filled storage buffer of `bytes` (rounded up to 4).
    pub fn buffer(&self, bytes: u64, label: &str) -> Result<wgpu::Buffer> {
        let size = bytes.max(4).next_multiple_of(4);
        if size > self.limits.max_buffer_size {
            bail!(
                "wgpu: {label} needs a buffer of {} MiB, more than the adapter's largest ({} MiB)",
                size >> 20,
                self.limits.max_buffer_size >> 20
            );
        }
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.check()
            .with_context(|| format!("allocating {} MiB for {label}", size >> 20))?;
        Ok(buf)
    }

    /// A storage buffer holding `data` (padded with zeros to a multiple of 4 bytes). Written
    /// through a mapping at creation, so it needs no queue operation and is ordered before
    /// anything recorded after it.
    pub fn buffer_init(&self, data: &[u8], label: &str) -> Result<wgpu::Buffer> {
        let size = (data.len() as u64).max(4).next_multiple_of(4);
        if size > self.limits.max_buffer_size {
            bail!(
                "wgpu: {label} needs a buffer of {} MiB, more than the adapter's largest ({} MiB)",
                size >> 20,
                self.limits.max_buffer_size >> 20
            );
        }
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: true,
        });
        self.check()
            .with_context(|| format!("allocating {} MiB for {label}", size >> 20))?;
        {
            let mut view = buf
                .slice(..)
                .get_mapped_range_mut()
                .map_err(|e| anyhow::anyhow!("wgpu: cannot map {label}: {e}"))?;
            view.slice(..data.len()).copy_from_slice(data);
        }
        buf.unmap();
        Ok(buf)
    }

    fn pipeline(&self, key: &PipelineKey) -> Result<wgpu::ComputePipeline> {
        let mut cache = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = cache.get(key) {
            return Ok(p.clone());
        }
        let src = kernels::source(key.kernel, key.weights)?;
        kernels::validate(key.kernel, &src, self.f16)?;
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(key.kernel.name()),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            });
        let constants: Vec<(&str, f64)> =
            key.constants.iter().map(|&(n, v)| (n, v as f64)).collect();
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(key.kernel.name()),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &constants,
                    // every kernel writes its workgroup memory before reading it
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        self.check().with_context(|| {
            format!(
                "compiling shaders/{}.wgsl ({:?})",
                key.kernel.name(),
                key.weights
            )
        })?;
        cache.insert(key.clone(), pipeline.clone());
        Ok(pipeline)
    }

    /// Records one dispatch into the step's encoder. `params` are the kernel's uniform
    /// parameters (u32 or f32 bits); `binds` are its storage bindings 1, 2, ... in order.
    pub fn dispatch(
        &self,
        key: &PipelineKey,
        params: &[u32],
        binds: &[Bind<'_>],
        groups: [u32; 3],
    ) -> Result<()> {
        if groups.contains(&0) {
            return Ok(());
        }
        let max = self.limits.max_compute_workgroups_per_dimension;
        if groups.iter().any(|&g| g > max) {
            bail!(
                "wgpu: {} needs {groups:?} workgroups, more than the adapter allows ({max} a dimension)",
                key.kernel.name()
            );
        }
        let pipeline = self.pipeline(key)?;
        let mut rec = self.recorder.lock().unwrap_or_else(|p| p.into_inner());
        if rec.params.len() as u64 >= PARAMS_SLOT * MAX_DISPATCHES {
            self.submit(&mut rec)?;
        }
        let offset = rec.params.len() as u64;
        let bytes: &[u8] = bytemuck::cast_slice(params);
        assert!(bytes.len() as u64 <= PARAMS_SLOT);
        rec.params.extend_from_slice(bytes);
        rec.params.resize((offset + PARAMS_SLOT) as usize, 0);
        let mut entries = Vec::with_capacity(binds.len() + 1);
        entries.push(wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &self.params,
                offset,
                size: NonZeroU64::new(PARAMS_SLOT),
            }),
        });
        for (i, b) in binds.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: b.buf,
                    offset: b.offset,
                    size: NonZeroU64::new(b.size.next_multiple_of(4)),
                }),
            });
        }
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(key.kernel.name()),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        if rec.encoder.is_none() {
            rec.encoder = Some(self.device.create_command_encoder(
                &wgpu::CommandEncoderDescriptor {
                    label: Some("step"),
                },
            ));
        }
        if rec.pass.is_none() {
            let enc = rec.encoder.as_mut().expect("encoder was just created");
            let pass = enc
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("step"),
                    timestamp_writes: None,
                })
                .forget_lifetime();
            rec.pass = Some(pass);
        }
        let pass = rec.pass.as_mut().expect("pass was just opened");
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        drop(rec);
        self.check()
            .with_context(|| format!("recording {}", key.kernel.name()))
    }

    /// Submits what was recorded (the parameters first).
    fn submit(&self, rec: &mut Recorder) -> Result<()> {
        rec.pass = None;
        if let Some(enc) = rec.encoder.take() {
            if !rec.params.is_empty() {
                self.queue.write_buffer(&self.params, 0, &rec.params);
            }
            self.queue.submit([enc.finish()]);
            rec.params.clear();
        }
        self.check().context("submitting a step")
    }

    /// Copies `data` into `parts` (consecutive pieces of it, in order), recorded after the work
    /// recorded so far: through a staging buffer, so the copy keeps its place in the queue.
    pub fn copy_in(&self, data: &[u8], parts: &[Bind<'_>]) -> Result<()> {
        let total: u64 = parts.iter().map(|p| p.size).sum();
        ensure!(
            total == data.len() as u64 && parts.iter().all(|p| p.size % 4 == 0),
            "copy_in: {} bytes for {total} bytes of destinations",
            data.len()
        );
        if parts.is_empty() {
            return Ok(());
        }
        let staging = self.buffer_init(data, "upload staging")?;
        let mut rec = self.recorder.lock().unwrap_or_else(|p| p.into_inner());
        let enc = rec.copy_encoder(&self.device);
        let mut at = 0;
        for p in parts {
            enc.copy_buffer_to_buffer(&staging, at, p.buf, p.offset, p.size);
            at += p.size;
        }
        drop(rec);
        self.check().context("recording a copy")
    }

    /// Submits the step and reads `parts` back: one submission, one wait.
    pub fn read(&self, parts: &[Bind<'_>]) -> Result<Vec<u8>> {
        let total: u64 = parts.iter().map(|p| p.size.next_multiple_of(4)).sum();
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: total.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.check().context("allocating a readback buffer")?;
        {
            let mut rec = self.recorder.lock().unwrap_or_else(|p| p.into_inner());
            let enc = rec.copy_encoder(&self.device);
            let mut at = 0;
            for p in parts {
                let n = p.size.next_multiple_of(4);
                enc.copy_buffer_to_buffer(p.buf, p.offset, &staging, at, n);
                at += n;
            }
            self.submit(&mut rec)?;
        }
        let (tx, rx) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow::anyhow!("wgpu: waiting for the device failed: {e}"))?;
        self.check().context("running a step")?;
        rx.recv()
            .context("wgpu: the readback never completed")?
            .map_err(|e| anyhow::anyhow!("wgpu: cannot read results back: {e}"))?;
        let out = {
            let view = staging
                .slice(..)
                .get_mapped_range()
                .map_err(|e| anyhow::anyhow!("wgpu: cannot map the readback buffer: {e}"))?;
            let mut out = Vec::with_capacity(total as usize);
            let mut at = 0usize;
            for p in parts {
                out.extend_from_slice(&view[at..at + p.size as usize]);
                at += p.size.next_multiple_of(4) as usize;
            }
            out
        };
        staging.unmap();
        Ok(out)
    }
}

impl Kernel {
    pub fn key(self) -> PipelineKey {
        PipelineKey {
            kernel: self,
            weights: None,
            constants: Vec::new(),
        }
    }
}
