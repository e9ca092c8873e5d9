//! LoRA adapters: PEFT's format read on the host ([`LoraAdapter`]), their factors on a backend
//! per layer and projection ([`LoraSet`]), and one step's rows grouped by adapter
//! ([`LoraStep`]), so that requests for different adapters and for the base model share a step.
//!
//! A projection `y = x·Wᵀ` with an adapter becomes `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` (A `[r, in]`,
//! B `[out, r]`, s = `lora_alpha / r`, or `lora_alpha / √r` with rsLoRA). The base product runs
//! once for the whole batch; then, for each adapter in the step, its rows are gathered, shrunk
//! by A, expanded by B and added back (the segmented "SGMV" shape of Punica and S-LoRA, built
//! from the backend's own gather, matmul and scatter-add, so every backend runs it). A row's
//! result depends on its own adapter only: every op is row by row.
//!
//! ```text
//!   x [T, in] ──base matmul──────────────────────────────▶ y [T, out]
//!      │ rows of adapter a: gather ▶ [m_a, in] ·Aᵀ ▶ [m_a, R] ·Bᵀ ▶ [m_a, out] ──scatter-add──▲
//! ```
//!
//! A family's fused projections (QKV, gate and up) are one site: the factors of its parts are
//! stacked, A as rows `[Σr, in]` and B block-diagonally `[out, Σr]` (each part's B in its own
//! rows and columns), so one shrink and one expand serve the whole site.

use super::loader::{SafetensorsWeights, WeightSource};
use crate::backend::{Backend, DeviceBatch};
use crate::tensor::{DType, HostTensor};
use crate::untrusted::text;
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;

/// One adapter's factors on the host, read from PEFT's `adapter_config.json` and
/// `adapter_model.safetensors`.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// `r`: the largest rank of its modules.
    pub rank: usize,
    /// The factor each product is scaled by (already folded into B).
    pub scale: f32,
    /// (layer, module name such as `q_proj`) → (A `[r, in]`, s·B `[out, r]`).
    pub modules: BTreeMap<(usize, String), (HostTensor, HostTensor)>,
}

/// The scale of a LoRA product: `alpha / r`, or `alpha / √r` with rsLoRA (PEFT's `scaling`).
pub fn lora_scale(alpha: f64, rank: usize, rslora: bool) -> f64 {
    match rslora {
        true => alpha / (rank as f64).sqrt(),
        false => alpha / rank as f64,
    }
}

impl LoraAdapter {
    /// Reads a PEFT adapter directory. What PEFT can express but this engine does not apply
    /// (DoRA, LoRA biases, `modules_to_save`, per-module ranks or alphas, embedding adapters)
    /// is refused by name rather than dropped.
    pub fn load(dir: &Path) -> Result<Self> {
        let shown = text(&dir.display().to_string());
        let cfg_path = dir.join("adapter_config.json");
        let cfg_text = std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("{shown} has no readable adapter_config.json"))?;
        let cfg: Value = serde_json::from_str(&cfg_text)
            .with_context(|| format!("{shown}/adapter_config.json is not valid JSON"))?;
        let (rank, alpha, rslora) = check_config(&cfg).with_context(|| {
            format!("{shown}/adapter_config.json: not an adapter this engine can apply")
        })?;
        let file = dir.join("adapter_model.safetensors");
        if !file.is_file() {
            bail!(
                "{shown} has no adapter_model.safetensors (adapters saved as .bin are not read: \
                 save them with safe_serialization)"
            );
        }
        let st = SafetensorsWeights::open_files(vec![file])?;
        let scale = lora_scale(alpha, rank, rslora) as f32;
        let mut a_of = BTreeMap::new();
        let mut b_of = BTreeMap::new();
        let mut names: Vec<&str> = st.names().collect();
        names.sort_unstable();
        for name in names {
            let (layer, module, which) =
                parse_name(name).with_context(|| format!("{shown}: tensor `{}`", text(name)))?;
            let t = st
                .get(name)?
                .with_context(|| format!("{shown}: tensor `{}` unreadable", text(name)))?;
            if t.shape.len() != 2 {
                bail!("{shown}: `{}` is not a matrix", text(name));
            }
            match which {
                'A' => a_of.insert((layer, module), t),
                _ => b_of.insert((layer, module), t),
            };
        }
        let mut modules = BTreeMap::new();
        for (key, a) in a_of {
            let mut b = b_of.remove(&key).with_context(|| {
                format!(
                    "{shown}: layer {} {} has lora_A but no lora_B",
                    key.0, key.1
                )
            })?;
            let r = a.shape[0];
            if b.shape[1] != r || r == 0 || r > rank {
                bail!(
                    "{shown}: layer {} {}: lora_A {:?} and lora_B {:?} do not make a product of rank {r} <= r = {rank}",
                    key.0,
                    key.1,
                    a.shape,
                    b.shape
                );
            }
            b.data.iter_mut().for_each(|v| *v *= scale);
            modules.insert(key, (a, b));
        }
        if let Some(((l, m), _)) = b_of.into_iter().next() {
            bail!("{shown}: layer {l} {m} has lora_B but no lora_A");
        }
        if modules.is_empty() {
            bail!("{shown}: adapter_model.safetensors holds no LoRA factors");
        }
        Ok(LoraAdapter {
            rank,
            scale,
            modules,
        })
    }

    /// Bytes the factors take in f32.
    pub fn bytes(&self) -> u64 {
        let n: usize = self
            .modules
            .values()
            .map(|(a, b)| a.numel() + b.numel())
            .sum();
        n as u64 * 4
    }
}

/// `r`, `lora_alpha` and `use_rslora` of an adapter_config.json, after refusing what is not
/// applied.
fn check_config(cfg: &Value) -> Result<(usize, f64, bool)> {
    if let Some(t) = cfg["peft_type"].as_str()
        && t != "LORA"
    {
        bail!("peft_type is {}, not LORA", text(t));
    }
    let rank = cfg["r"]
        .as_u64()
        .filter(|&r| r > 0)
        .context("r must be a positive integer")? as usize;
    let alpha = cfg["lora_alpha"]
        .as_f64()
        .context("lora_alpha must be a number")?;
    let rslora = cfg["use_rslora"].as_bool().unwrap_or(false);
    let set = |k: &str| match &cfg[k] {
        Value::Null | Value::Bool(false) => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::String(s) => !s.is_empty() && s != "none",
        _ => true,
    };
    for (key, what) in [
        (
            "modules_to_save",
            "fully trained modules saved beside the adapter",
        ),
        ("use_dora", "DoRA"),
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
        ("lora_bias", "LoRA biases"),
        ("layers_to_transform", "adapters on some layers by index"),
        ("layer_replication", "layer replication"),
    ] {
        if set(key) {
            bail!("{key} ({what}) is not supported");
        }
    }
    match cfg["bias"].as_str() {
        None | Some("none") => {}
        Some(b) => bail!("bias = {} is not supported (only \"none\")", text(b)),
    }
    // NOTE: `fan_in_fan_out` says the base layer stores its weight transposed (GPT-2's
    // Conv1D); lora_A and lora_B are saved as [r, in] and [out, r] either way, so the factors
    // read the same.
    Ok((rank, alpha, rslora))
}

/// `base_model.model.model.layers.{i}.{path}.{module}.lora_{A|B}.weight` → (i, module, A|B).
fn parse_name(name: &str) -> Result<(usize, String, char)> {
    let rest = name
        .strip_prefix("base_model.model.")
        .context("not a PEFT LoRA tensor (no base_model.model. prefix)")?;
    let (rest, which) = if let Some(r) = rest.strip_suffix(".lora_A.weight") {
        (r, 'A')
    } else if let Some(r) = rest.strip_suffix(".lora_B.weight") {
        (r, 'B')
    } else {
        bail!(
            "not a LoRA factor of a linear layer (embedding adapters and biases are not supported)"
        );
    };
    let parts: Vec<&str> = rest.split('.').collect();
    let at = parts.iter().position(|&p| p == "layers").context(
        "not in a decoder layer (adapters on the embeddings or the head are not supported)",
    )?;
    let layer = parts
        .get(at + 1)
        .and_then(|l| l.parse().ok())
        .context("no layer index after `layers`")?;
    let module = parts.last().context("no module name")?.to_string();
    Ok((layer, module, which))
}

/// A projection of a family's layer that adapters may change: its input and output widths,
/// and which PEFT module names fill which rows of its output (a fused projection has several).
#[derive(Debug, Clone)]
pub struct LoraSite {
    pub k: usize,
    pub n: usize,
    pub parts: Vec<(&'static str, Range<usize>)>,
}

/// One site's stacked factors on the device.
struct Factors<B: Backend> {
    a: B::Buf, // [R, k]
    b: B::Buf, // [n, R]
    rank: usize,
}

/// Every loaded adapter's factors, by slot: per layer of this worker, per site.
pub struct LoraSet<B: Backend> {
    sites: Vec<LoraSite>,
    layers: Range<usize>,
    adapters: HashMap<u32, Vec<Vec<Option<Factors<B>>>>>,
}

impl<B: Backend> LoraSet<B> {
    /// A family's sites (the same in each of `layers`), no adapter loaded.
    pub fn new(sites: Vec<LoraSite>, layers: Range<usize>) -> Self {
        LoraSet {
            sites,
            layers,
            adapters: HashMap::new(),
        }
    }

    /// Loads `adapter` into `slot` (replacing what was there), or with `None` unloads it.
    /// Every module of the adapter must name a projection of this model with its shapes.
    pub fn set(&mut self, backend: &B, slot: u32, adapter: Option<&LoraAdapter>) -> Result<()> {
        anyhow::ensure!(slot != 0, "LoRA slot 0 is the base model");
        let Some(ad) = adapter else {
            self.adapters.remove(&slot);
            return Ok(());
        };
        // per layer, per site: the parts' (row range, A, B)
        type Parts<'a> = Vec<(Range<usize>, &'a HostTensor, &'a HostTensor)>;
        let mut grouped: Vec<Vec<Parts>> =
            vec![vec![Vec::new(); self.sites.len()]; self.layers.len()];
        for ((layer, module), (a, b)) in &ad.modules {
            if !self.layers.contains(layer) {
                bail!(
                    "the adapter targets layer {layer}, but the model has layers {}..{}",
                    self.layers.start,
                    self.layers.end
                );
            }
            let found = self.sites.iter().enumerate().find_map(|(i, s)| {
                let rows = s.parts.iter().find(|p| p.0 == module)?.1.clone();
                Some((i, s, rows))
            });
            let Some((i, site, rows)) = found else {
                let known: Vec<&str> = self
                    .sites
                    .iter()
                    .flat_map(|s| s.parts.iter().map(|p| p.0))
                    .collect();
                bail!(
                    "the adapter targets `{}`, which this model has no linear layer for (it has {})",
                    text(module),
                    known.join(", ")
                );
            };
            if a.shape[1] != site.k || b.shape[0] != rows.len() {
                bail!(
                    "the adapter's {module} of layer {layer} has lora_A {:?} and lora_B {:?}, but the model's {module} maps {} to {}",
                    a.shape,
                    b.shape,
                    site.k,
                    rows.len()
                );
            }
            grouped[layer - self.layers.start][i].push((rows, a, b));
        }
        let mut layers = Vec::with_capacity(grouped.len());
        for per_site in grouped {
            let mut out = Vec::with_capacity(per_site.len());
            for (site, parts) in self.sites.iter().zip(per_site) {
                if parts.is_empty() {
                    out.push(None);
                    continue;
                }
                let rank: usize = parts.iter().map(|p| p.1.shape[0]).sum();
                let mut a = Vec::with_capacity(rank * site.k);
                let mut b = vec![0.0f32; site.n * rank];
                let mut col = 0;
                for (rows, pa, pb) in parts {
                    let r = pa.shape[0];
                    a.extend_from_slice(&pa.data);
                    for (i, row) in rows.enumerate() {
                        b[row * rank + col..row * rank + col + r]
                            .copy_from_slice(&pb.data[i * r..(i + 1) * r]);
                    }
                    col += r;
                }
                out.push(Some(Factors {
                    a: backend
                        .upload_weight(&HostTensor::new(vec![rank, site.k], a), DType::F32)?,
                    b: backend
                        .upload_weight(&HostTensor::new(vec![site.n, rank], b), DType::F32)?,
                    rank,
                }));
            }
            layers.push(out);
        }
        self.adapters.insert(slot, layers);
        Ok(())
    }

    /// The step's rows grouped by adapter (from `batch.host.lora_slots`), uploaded once for
    /// every layer.
    pub fn step<'a>(&'a self, backend: &B, batch: &DeviceBatch<B>) -> Result<LoraStep<'a, B>> {
        let h = &batch.host;
        let mut rows: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for (s, &slot) in h.lora_slots.iter().enumerate() {
            if slot != 0 {
                let (a, b) = (h.query_start[s], h.query_start[s + 1]);
                rows.entry(slot).or_default().extend(a..b);
            }
        }
        let mut groups = Vec::with_capacity(rows.len());
        for (slot, rows) in rows {
            let factors = self
                .adapters
                .get(&slot)
                .with_context(|| format!("no LoRA adapter is loaded in slot {slot}"))?;
            if rows.is_empty() {
                continue;
            }
            groups.push(Group {
                factors,
                m: rows.len(),
                ones: backend.upload_f32(&vec![1.0; rows.len()])?,
                rows: backend.upload_u32(&rows)?,
            });
        }
        Ok(LoraStep {
            sites: &self.sites,
            groups,
        })
    }
}

struct Group<'a, B: Backend> {
    factors: &'a [Vec<Option<Factors<B>>>],
    rows: B::Buf, // [m] u32
    ones: B::Buf, // [m] f32
    m: usize,
}

/// One step's adapters and their rows.
pub struct LoraStep<'a, B: Backend> {
    sites: &'a [LoraSite],
    groups: Vec<Group<'a, B>>,
}

impl<B: Backend> LoraStep<'_, B> {
    /// Whether some row of the step has an adapter on `site` of this worker's layer `j`.
    pub fn touches(&self, j: usize, site: usize) -> bool {
        self.groups.iter().any(|g| g.factors[j][site].is_some())
    }

    /// `out[row] += s·(x[row]·Aᵀ)·Bᵀ` for every row with an adapter on `site` of layer `j`;
    /// `x` `[T, k]` is the site's input, `out` `[T, n]` its base output.
    pub fn apply(
        &self,
        backend: &B,
        j: usize,
        site: usize,
        x: &B::Buf,
        out: &mut B::Buf,
    ) -> Result<()> {
        let LoraSite { k, n, .. } = self.sites[site];
        for g in &self.groups {
            let Some(f) = &g.factors[j][site] else {
                continue;
            };
            let mut xs = backend.alloc_scratch_f32(g.m * k)?; // [m, k]
            backend.gather_rows(x, &g.rows, k, &mut xs)?;
            let mut mid = backend.alloc_scratch_f32(g.m * f.rank)?; // [m, R]
            backend.matmul(&xs, &f.a, None, g.m, k, f.rank, &mut mid)?;
            let mut up = backend.alloc_scratch_f32(g.m * n)?; // [m, n]
            backend.matmul(&mid, &f.b, None, g.m, f.rank, n, &mut up)?;
            backend.scatter_add_rows(&up, &g.rows, &g.ones, n, out)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_names_give_the_layer_and_the_module() {
        let (l, m, w) =
            parse_name("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight").unwrap();
        assert_eq!((l, m.as_str(), w), (12, "q_proj", 'A'));
        let (l, m, w) =
            parse_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight").unwrap();
        assert_eq!((l, m.as_str(), w), (0, "down_proj", 'B'));
        for bad in [
            "model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.embed_tokens.lora_embedding_A",
            "base_model.model.lm_head.lora_A.weight",
            "base_model.model.model.layers.x.mlp.up_proj.lora_A.weight",
        ] {
            assert!(parse_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn what_peft_can_say_but_is_not_applied_is_refused_by_name() {
        let ok = serde_json::json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
            "use_rslora": true, "modules_to_save": null, "bias": "none", "use_dora": false,
            "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": false});
        assert_eq!(check_config(&ok).unwrap(), (8, 16.0, true));
        for (k, v) in [
            ("modules_to_save", serde_json::json!(["lm_head"])),
            ("use_dora", serde_json::json!(true)),
            ("rank_pattern", serde_json::json!({"q_proj": 4})),
            ("bias", serde_json::json!("all")),
            ("r", serde_json::json!(0)),
            ("peft_type", serde_json::json!("IA3")),
        ] {
            let mut c = ok.clone();
            c[k] = v;
            let e = check_config(&c).unwrap_err().to_string();
            assert!(
                e.contains(k) || k == "peft_type" && e.contains("IA3"),
                "{k}: {e}"
            );
        }
        assert_eq!(lora_scale(32.0, 16, true), 8.0);
        assert_eq!(lora_scale(8.0, 16, false), 0.5);
    }
}
