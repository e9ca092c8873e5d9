//! LoRA adapters served beside the base model (vLLM's `--enable-lora`): loading and unloading
//! them at run time, and the slot and prefix-cache root of a request that names one.
//!
//! A request names an adapter; the engine gives its scheduler request the adapter's slot (the
//! rows of that request use the slot's factors: `models/lora.rs`) and a prefix-cache root of
//! the adapter's own, so that no adapter ever reads K/V another computed. An adapter unloaded
//! while requests use it is gone for new requests at once; its slot is freed when the last of
//! them finishes.

use super::Engine;
use super::adapters::{LoraError, LoraInfo, Loras};
use super::request::RequestError;
use super::runner::ModelRunner;
use crate::models::lora::LoraAdapter;
use crate::untrusted::text;
use std::path::Path;

impl Engine {
    /// Loads the adapter in `path` (a PEFT directory or a GGUF file) under `name`; requests
    /// naming it use it from the next step on.
    pub fn load_lora(&mut self, name: &str, path: &Path) -> Result<LoraInfo, LoraError> {
        if !self.loras.args.enable {
            return Err(LoraError::Disabled);
        }
        // NOTE: names go into metrics labels, logs and comma-separated lists.
        if name.is_empty() || name.len() > 256 || name.chars().any(|c| c.is_control() || c == ',') {
            return Err(LoraError::Invalid(anyhow::anyhow!(
                "an adapter's name must be 1 to 256 characters, without commas or control characters"
            )));
        }
        if self.loras.by_name.contains_key(name) || name == self.model_name {
            return Err(LoraError::Exists(name.to_string()));
        }
        let max_cpu = self.loras.max_cpu;
        if self.loras.by_name.len() + self.loras.draining.len() >= max_cpu {
            return Err(LoraError::Invalid(anyhow::anyhow!(
                "{max_cpu} adapters are loaded already (--max-cpu-loras): unload one first"
            )));
        }
        let t0 = std::time::Instant::now();
        let adapter =
            crate::models::peft::load_adapter(path, &self.config).map_err(LoraError::Invalid)?;
        let max = self.loras.args.max_lora_rank;
        if adapter.rank > max {
            return Err(LoraError::Invalid(anyhow::anyhow!(
                "the adapter's rank {} is above --max-lora-rank {max}",
                adapter.rank
            )));
        }
        let slot = self.loras.free_slot();
        // NOTE: uploaded at once (the device checks every module against the model's
        // projections), as the adapter used most recently; where the device is full, an
        // adapter no running request uses moves out first, if there is one.
        let (running, _) = self.scheduler.lora_slots();
        let running: Vec<u32> = running.into_iter().collect();
        let bytes = to_device(
            &mut self.loras,
            &mut *self.runner,
            slot,
            &adapter,
            Keep::Rather(&running),
        )
        .map_err(LoraError::Invalid)?;
        self.loras.roots += 1;
        let info = LoraInfo {
            name: name.to_string(),
            path: path.to_path_buf(),
            rank: adapter.rank,
            bytes,
            on_device: true,
            parent: None,
            slot,
            root: self.loras.roots,
        };
        tracing::info!(
            "LoRA adapter {} loaded from {} (rank {}, {} KiB of {} in device memory) in {:.0} ms",
            text(name),
            text(&path.display().to_string()),
            info.rank,
            info.bytes >> 10,
            adapter.dtype.name(),
            t0.elapsed().as_secs_f64() * 1e3
        );
        self.loras.by_name.insert(name.to_string(), info.clone());
        self.loras.host.insert(slot, adapter);
        Ok(info)
    }

    /// Unloads the adapter `name`: new requests for it are refused at once; those already
    /// queued or running finish with it first, and its memory is freed after the last.
    pub fn unload_lora(&mut self, name: &str) -> Result<(), LoraError> {
        if !self.loras.args.enable {
            return Err(LoraError::Disabled);
        }
        let info = self
            .loras
            .by_name
            .remove(name)
            .ok_or_else(|| LoraError::NotFound(name.to_string()))?;
        self.loras.draining.push(info);
        self.free_drained_loras();
        Ok(())
    }

    /// Whether LoRA adapters are served (`--enable-lora`).
    pub fn lora_enabled(&self) -> bool {
        self.loras.args.enable
    }

    /// The adapters loaded, by name.
    pub fn loras(&self) -> Vec<LoraInfo> {
        let on_device = |l: &LoraInfo| LoraInfo {
            on_device: self.loras.on_device.contains(&l.slot),
            ..l.clone()
        };
        let mut v: Vec<LoraInfo> = self.loras.by_name.values().map(on_device).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// The adapters of the running requests and of those waiting (or swapped out), by name
    /// (vLLM's `lora_requests_info`).
    pub fn lora_requests(&self) -> (Vec<String>, Vec<String>) {
        let (running, waiting) = self.scheduler.lora_slots();
        let loras = &self.loras;
        let name = |s: &u32| {
            let mut all = loras.by_name.values().chain(&loras.draining);
            all.find(|l| l.slot == *s).map(|l| l.name.clone())
        };
        (
            running.iter().filter_map(name).collect(),
            waiting.iter().filter_map(name).collect(),
        )
    }

    /// `--max-loras`.
    pub fn max_loras(&self) -> usize {
        self.loras.args.max_loras
    }

    /// Frees the slots of unloaded adapters that no request uses any more. A slot whose
    /// factors cannot be freed stays taken (and the error is logged).
    pub(super) fn free_drained_loras(&mut self) {
        let mut i = 0;
        while i < self.loras.draining.len() {
            let slot = self.loras.draining[i].slot;
            if self.scheduler.uses_lora(slot) {
                i += 1;
                continue;
            }
            match self.runner.set_lora(slot, None) {
                Ok(_) => {
                    self.loras.draining.swap_remove(i);
                    self.loras.host.remove(&slot);
                    self.loras.on_device.retain(|&s| s != slot);
                }
                Err(e) => {
                    tracing::error!("freeing LoRA slot {slot} failed: {e:#}");
                    i += 1;
                }
            }
        }
    }

    /// Puts the adapters of a step's rows (`slots`, 0 for the base model) on the device,
    /// moving out the least recently used others where `--max-loras` are there already (the
    /// scheduler puts no more than that in one step).
    pub(super) fn loras_to_device(&mut self, slots: &[u32]) -> anyhow::Result<()> {
        let mut step: Vec<u32> = slots.iter().copied().filter(|&s| s != 0).collect();
        step.sort_unstable();
        step.dedup();
        for &slot in &step {
            let loras = &mut self.loras;
            if let Some(i) = loras.on_device.iter().position(|&s| s == slot) {
                loras.on_device.remove(i);
                loras.on_device.push(slot);
                continue;
            }
            let adapter = loras
                .host
                .remove(&slot)
                .ok_or_else(|| anyhow::anyhow!("no LoRA adapter is loaded in slot {slot}"))?;
            let t0 = std::time::Instant::now();
            let moved = to_device(loras, &mut *self.runner, slot, &adapter, Keep::Must(&step));
            loras.host.insert(slot, adapter);
            moved?;
            tracing::debug!(
                "LoRA slot {slot} moved to the device in {:.1} ms",
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
        Ok(())
    }

    /// The slot and the prefix-cache root of the adapter a request names (`None`: the base
    /// model, slot 0 and root 0).
    pub(super) fn lora_slot(&self, name: Option<&str>) -> Result<(u32, u64), RequestError> {
        match name {
            None => Ok((0, 0)),
            Some(n) => match self.loras.by_name.get(n) {
                Some(l) => Ok((l.slot, l.root)),
                None => Err(RequestError::UnknownLora(n.to_string())),
            },
        }
    }

    /// With `--enable-lora`: refuses a model or a split that cannot take adapters (at start,
    /// rather than at each load), then loads the adapters of `--lora-modules`.
    pub(super) fn load_lora_modules(&mut self) -> anyhow::Result<()> {
        if !self.loras.args.enable {
            return Ok(());
        }
        // NOTE: with steps in flight (pipeline parallelism) an adapter cannot move in or out
        // between two of them: the workers take one job at a time alone.
        if self.runner.parallel().pipeline > 1 {
            anyhow::bail!(
                "--enable-lora: LoRA adapters with pipeline parallelism are not supported yet \
                 (tensor parallelism is)"
            );
        }
        // NOTE: unloading a slot that holds nothing changes nothing, but says whether the
        // model and its split take adapters at all.
        self.runner
            .set_lora(1, None)
            .map_err(|e| anyhow::anyhow!("--enable-lora: {e:#}"))?;
        for m in self.loras.args.modules.clone() {
            self.load_lora(&m.name, &m.path).map_err(|e| {
                anyhow::anyhow!("--lora-modules {}={}: {e}", m.name, m.path.display())
            })?;
            if let Some(l) = self.loras.by_name.get_mut(&m.name) {
                l.parent = m.base_model_name;
            }
        }
        Ok(())
    }
}

/// Which adapters on the device [`to_device`] leaves there: those of the step about to run
/// (`Must`), or those running requests use, where another can go instead (`Rather`).
enum Keep<'a> {
    Must(&'a [u32]),
    Rather(&'a [u32]),
}

/// Uploads `adapter` into `slot` as the most recently used adapter on the device; where
/// `--max-loras` are there already, the least recently used outside `keep` moves out first
/// (its host copy stays). The bytes its factors take on the devices.
fn to_device(
    loras: &mut Loras,
    runner: &mut dyn ModelRunner,
    slot: u32,
    adapter: &LoraAdapter,
    keep: Keep,
) -> anyhow::Result<u64> {
    while loras.on_device.len() >= loras.args.max_loras {
        let free = |kept: &[u32]| loras.on_device.iter().position(|s| !kept.contains(s));
        let i = match keep {
            Keep::Must(kept) => free(kept).ok_or_else(|| {
                anyhow::anyhow!("internal: a step holds more LoRA adapters than --max-loras")
            })?,
            Keep::Rather(kept) => free(kept).unwrap_or(0),
        };
        runner.set_lora(loras.on_device[i], None)?;
        loras.on_device.remove(i);
    }
    let bytes = runner.set_lora(slot, Some(adapter))?;
    loras.on_device.push(slot);
    Ok(bytes)
}
