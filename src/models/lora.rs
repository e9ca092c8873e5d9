//! LoRA adapters: their factors on the host ([`LoraAdapter`], read by `peft.rs`), on a backend
//! per layer and projection ([`LoraSet`]), and one step's rows grouped by adapter
//! ([`LoraStep`]), so that requests for different adapters and for the base model share a step.
//!
//! A projection `y = x·Wᵀ` with an adapter becomes `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` (A `[r, in]`,
//! B `[out, r]`, s = `lora_alpha / r`, or `lora_alpha / √r` with rsLoRA). The base product runs
//! once for the whole batch; then, for each adapter in the step, its rows are gathered, shrunk
//! by A, expanded by B and added back (the segmented "SGMV" shape of Punica and S-LoRA, built
//! from the backend's own gather, matmul and scatter-add, so every backend runs it). Every op
//! works row by row, so a row's result depends on its own adapter only; exactly so where the
//! backend's matmul gives a row the same bits whatever the row count (the CPU's), not on a GPU,
//! whose matmul changes kernel past 8 rows.
//!
//! ```text
//!   x [T, in] ──base matmul──────────────────────────────▶ y [T, out]
//!      │ rows of adapter a: gather ▶ [m_a, in] ·Aᵀ ▶ [m_a, R] ·Bᵀ ▶ [m_a, out] ──scatter-add──▲
//! ```
//!
//! A family's fused projections (QKV, gate and up) are one site: the factors of its parts are
//! stacked, A as rows `[Σr, in]` and B block-diagonally `[out, Σr]` (each part's B in its own
//! rows and columns), so one shrink and one expand serve the whole site.

use super::config::ModelConfig;
use crate::backend::{Activation, Backend, DeviceBatch, LoraGroup};
use crate::parallel::Placement;
use crate::tensor::{DType, HostTensor};
use crate::untrusted::text;
use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

/// One adapter's factors on the host (read from PEFT's files by `peft.rs`).
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// `r`: the largest rank of its modules.
    pub rank: usize,
    /// The type the factors are kept in on the device (the file's: f32, f16 or bf16).
    pub dtype: DType,
    /// (layer, module name such as `q_proj`) → (A `[r, in]`, s·B `[out, r]`): the scale is
    /// folded into B.
    pub modules: BTreeMap<(usize, String), (HostTensor, HostTensor)>,
}

/// An adapter's factors as a file lists them (`peft.rs`, `gguf_lora.rs`), paired by module
/// when all are read.
pub struct FactorPairs {
    /// The file, for messages.
    shown: String,
    /// (layer, module) → (A, B), either not read yet.
    pairs: BTreeMap<(usize, String), [Option<HostTensor>; 2]>,
    dtype: Option<DType>,
}

impl FactorPairs {
    pub fn new(shown: &str) -> Self {
        FactorPairs {
            shown: shown.to_string(),
            pairs: BTreeMap::new(),
            dtype: None,
        }
    }

    /// Adds lora_A (`is_a`) or lora_B of a module; `stored` is the file's type for it.
    pub fn add(
        &mut self,
        layer: usize,
        module: String,
        is_a: bool,
        t: HostTensor,
        stored: DType,
    ) -> Result<()> {
        let (shown, which) = (&self.shown, if is_a { 'A' } else { 'B' });
        if t.shape.len() != 2 {
            bail!(
                "{shown}: lora_{which} of layer {layer} {} is not a matrix",
                text(&module)
            );
        }
        // NOTE: the factors stay in the type the file stores (as `--dtype auto` keeps the
        // weights'): a half-precision adapter reads half the bytes each step.
        self.dtype = match self.dtype {
            None => Some(stored),
            Some(d) if d == stored => Some(d),
            _ => Some(DType::F32),
        };
        let slot = &mut self.pairs.entry((layer, module.clone())).or_default()[!is_a as usize];
        if slot.replace(t).is_some() {
            bail!(
                "{shown}: two lora_{which} tensors for layer {layer} {}",
                text(&module)
            );
        }
        Ok(())
    }

    /// The adapter: each module's A `[r, in]` and B `[out, r]` must make a product of rank
    /// `r`, at most `rank` where the file gives one (else the adapter's rank is its largest
    /// module's); each B is scaled by `scale(r)`.
    pub fn finish(self, rank: Option<usize>, scale: impl Fn(usize) -> f32) -> Result<LoraAdapter> {
        let shown = &self.shown;
        let mut modules = BTreeMap::new();
        let mut largest = 0;
        for ((layer, module), pair) in self.pairs {
            let [Some(a), Some(mut b)] = pair else {
                let has = if pair[0].is_some() { "A" } else { "B" };
                let lacks = if pair[0].is_some() { "B" } else { "A" };
                bail!(
                    "{shown}: layer {layer} {} has lora_{has} but no lora_{lacks}",
                    text(&module)
                );
            };
            let r = a.shape[0];
            if b.shape[1] != r || r == 0 || rank.is_some_and(|max| r > max) {
                bail!(
                    "{shown}: layer {layer} {}: lora_A {:?} and lora_B {:?} do not make a product of rank {r}{}",
                    text(&module),
                    a.shape,
                    b.shape,
                    rank.map_or(String::new(), |max| format!(" <= r = {max}"))
                );
            }
            let s = scale(r);
            b.data.iter_mut().for_each(|v| *v *= s);
            largest = largest.max(r);
            modules.insert((layer, module), (a, b));
        }
        if modules.is_empty() {
            bail!("{shown} holds no LoRA factors");
        }
        let rank = rank.unwrap_or(largest);
        Ok(LoraAdapter {
            rank,
            dtype: self.dtype.unwrap_or(DType::F32),
            modules,
        })
    }
}

/// The scale of a LoRA product: `alpha / r`, or `alpha / √r` with rsLoRA (PEFT's `scaling`).
pub fn lora_scale(alpha: f64, rank: usize, rslora: bool) -> f64 {
    match rslora {
        true => alpha / (rank as f64).sqrt(),
        false => alpha / rank as f64,
    }
}

/// A projection of a family's layer that adapters may change, as this worker holds it.
#[derive(Debug, Clone)]
pub struct LoraSite {
    /// The module's input width in the adapter (A's columns).
    pub k_full: usize,
    /// The columns of A this worker multiplies: a row-parallel projection's part of the
    /// input under tensor parallelism, else all.
    pub cols: Range<usize>,
    /// The output width on this worker.
    pub n: usize,
    /// The PEFT module names that fill its output (a fused projection has several).
    pub parts: Vec<LoraPart>,
}

/// A PEFT module of a site.
#[derive(Debug, Clone)]
pub struct LoraPart {
    pub name: &'static str,
    /// The module's output width in the adapter (B's rows).
    pub rows: usize,
    /// The runs of B's rows this worker keeps, each with the first output row it fills.
    pub keep: Vec<(Range<usize>, usize)>,
}

/// A tensor-parallel rank's rows of the whole model's Q and K/V projections and its MLP
/// columns (all of them on one worker): `Shard::lora_rows`.
#[derive(Debug, Clone)]
pub struct RankRows {
    pub q: Range<usize>,
    pub kv: Range<usize>,
    pub ffn: Range<usize>,
}

/// The sites of [`gated_sites`], in its order.
pub const QKV: usize = 0;
pub const O: usize = 1;
pub const GATE_UP: usize = 2;
pub const DOWN: usize = 3;

/// The projections of a layer with a fused QKV (PEFT's `q_proj`, `k_proj` and `v_proj`, or
/// Phi-3's `qkv_proj`), `o_proj`, a gated MLP's fused gate and up (`gate_proj` and `up_proj`,
/// or `gate_up_proj`) and `down_proj`, as LoRA sites of the tensor-parallel rank `rk`: the
/// Llama graph's, Gemma 3's, OLMo 2's. `whole_qkv`: every rank computes the QKV projection of
/// all heads (OLMo 2's norms over all of them).
///
/// NOTE: under tensor parallelism a column-parallel site (QKV, gate and up) keeps its rows of
/// B and all of A; a row-parallel one (o, down) its columns of A and all of B. Its partial
/// update `(x_r·A_rᵀ)·Bᵀ` is added before the all-reduce that sums the base's partial outputs,
/// which sums the updates too: `Σ_r (x_r·A_rᵀ)·Bᵀ = (x·Aᵀ)·Bᵀ`.
pub fn gated_sites(c: &ModelConfig, rk: &RankRows, whole_qkv: bool) -> Vec<LoraSite> {
    let (h, hkv, d, hid, f) = c.layer_sizes();
    let (q, kv) = (h * d, hkv * d);
    let (qr, kvr) = match whole_qkv {
        true => (0..q, 0..kv),
        false => (rk.q.clone(), rk.kv.clone()),
    };
    let (ql, kvl) = (qr.len(), kvr.len());
    let (ffn, fl) = (rk.ffn.clone(), rk.ffn.len());
    let shift = |r: &Range<usize>, by: usize| r.start + by..r.end + by;
    let part = |name, rows, keep| LoraPart { name, rows, keep };
    let all = |n: usize| vec![(0..n, 0)];
    vec![
        LoraSite {
            k_full: hid,
            cols: 0..hid,
            n: ql + 2 * kvl,
            parts: vec![
                part("q_proj", q, vec![(qr.clone(), 0)]),
                part("k_proj", kv, vec![(kvr.clone(), ql)]),
                part("v_proj", kv, vec![(kvr.clone(), ql + kvl)]),
                part(
                    "qkv_proj",
                    q + 2 * kv,
                    vec![
                        (qr.clone(), 0),
                        (shift(&kvr, q), ql),
                        (shift(&kvr, q + kv), ql + kvl),
                    ],
                ),
            ],
        },
        LoraSite {
            k_full: q,
            cols: rk.q.clone(),
            n: hid,
            parts: vec![part("o_proj", hid, all(hid))],
        },
        LoraSite {
            k_full: hid,
            cols: 0..hid,
            n: 2 * fl,
            parts: vec![
                part("gate_proj", f, vec![(ffn.clone(), 0)]),
                part("up_proj", f, vec![(ffn.clone(), fl)]),
                part(
                    "gate_up_proj",
                    2 * f,
                    vec![(ffn.clone(), 0), (shift(&ffn, f), fl)],
                ),
            ],
        },
        LoraSite {
            k_full: f,
            cols: ffn.clone(),
            n: hid,
            parts: vec![part("down_proj", hid, all(hid))],
        },
    ]
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
    /// This worker's layers, of the model's `num_layers`.
    layers: Range<usize>,
    num_layers: usize,
    adapters: HashMap<u32, Vec<Vec<Option<Factors<B>>>>>,
}

impl<B: Backend> LoraSet<B> {
    /// A family's sites on this worker (the same in each of its layers), no adapter loaded.
    pub fn new(sites: Vec<LoraSite>, place: &Placement<B>, num_layers: usize) -> Self {
        LoraSet {
            sites,
            layers: place.layers.clone(),
            num_layers,
            adapters: HashMap::new(),
        }
    }

    /// Loads `adapter` into `slot` (replacing what was there), or with `None` unloads it;
    /// returns the bytes its factors take on this worker's device (a fused site's B is stacked
    /// block-diagonally, so it takes more than the file). Every module of the adapter must name
    /// a projection of this model with its shapes; this worker keeps its layers' part.
    pub fn set(&mut self, backend: &B, slot: u32, adapter: Option<&LoraAdapter>) -> Result<u64> {
        anyhow::ensure!(slot != 0, "LoRA slot 0 is the base model");
        let Some(ad) = adapter else {
            self.adapters.remove(&slot);
            return Ok(0);
        };
        // per layer, per site: the parts (and their A and B)
        type Parts<'a> = Vec<(&'a LoraPart, &'a HostTensor, &'a HostTensor)>;
        let mut grouped: Vec<Vec<Parts>> =
            vec![vec![Vec::new(); self.sites.len()]; self.layers.len()];
        for ((layer, module), (a, b)) in &ad.modules {
            if *layer >= self.num_layers {
                bail!(
                    "the adapter targets layer {layer}, but the model has {} layers",
                    self.num_layers
                );
            }
            let found = self.sites.iter().enumerate().find_map(|(i, s)| {
                let part = s.parts.iter().find(|p| p.name == module)?;
                Some((i, s, part))
            });
            let Some((i, site, part)) = found else {
                let known: Vec<&str> = self
                    .sites
                    .iter()
                    .flat_map(|s| s.parts.iter().map(|p| p.name))
                    .collect();
                bail!(
                    "the adapter targets `{}`, which this model has no linear layer for (it has {})",
                    text(module),
                    known.join(", ")
                );
            };
            if a.shape[1] != site.k_full || b.shape[0] != part.rows {
                bail!(
                    "the adapter's {module} of layer {layer} has lora_A {:?} and lora_B {:?}, but the model's {module} maps {} to {}",
                    a.shape,
                    b.shape,
                    site.k_full,
                    part.rows
                );
            }
            // NOTE: checked whole on every pipeline stage; each keeps its own layers.
            if self.layers.contains(layer) {
                grouped[layer - self.layers.start][i].push((part, a, b));
            }
        }
        let mut layers = Vec::with_capacity(grouped.len());
        let mut bytes = 0;
        for per_site in grouped {
            let mut out = Vec::with_capacity(per_site.len());
            for (site, parts) in self.sites.iter().zip(per_site) {
                if parts.is_empty() {
                    out.push(None);
                    continue;
                }
                let rank: usize = parts.iter().map(|p| p.1.shape[0]).sum();
                let k = site.cols.len();
                let mut a = Vec::with_capacity(rank * k);
                let mut b = vec![0.0f32; site.n * rank];
                let mut col = 0;
                for (part, pa, pb) in parts {
                    let r = pa.shape[0];
                    for row in pa.data.chunks_exact(site.k_full) {
                        a.extend_from_slice(&row[site.cols.clone()]);
                    }
                    for (src, dst) in &part.keep {
                        for (i, from) in src.clone().enumerate() {
                            let to = (dst + i) * rank + col;
                            b[to..to + r].copy_from_slice(&pb.data[from * r..(from + 1) * r]);
                        }
                    }
                    col += r;
                }
                let (a, b) = (
                    HostTensor::new(vec![rank, k], a),
                    HostTensor::new(vec![site.n, rank], b),
                );
                bytes += ((a.numel() + b.numel()) * ad.dtype.size_in_bytes()) as u64;
                out.push(Some(Factors {
                    a: backend.upload_weight(&a, ad.dtype)?,
                    b: backend.upload_weight(&b, ad.dtype)?,
                    rank,
                }));
            }
            layers.push(out);
        }
        self.adapters.insert(slot, layers);
        Ok(bytes)
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
        let (k, n) = (self.sites[site].cols.len(), self.sites[site].n);
        let groups: Vec<LoraGroup<B>> = self
            .groups
            .iter()
            .filter_map(|g| {
                let f = g.factors[j][site].as_ref()?;
                Some(LoraGroup {
                    rows: &g.rows,
                    weights: &g.ones,
                    m: g.m,
                    a: &f.a,
                    b: &f.b,
                    rank: f.rank,
                })
            })
            .collect();
        backend.lora(x, &groups, k, n, out)
    }

    /// The gated MLP's first half ([`Backend::matmul_gated_act`] of `x` `[rows, k]` by
    /// `w_gate_up` `[2 ffn, k]`) with the adapters of [`GATE_UP`] added before the activation.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_gated_act(
        &self,
        backend: &B,
        j: usize,
        x: &B::Buf,
        w_gate_up: &B::Buf,
        (rows, k, ffn): (usize, usize, usize),
        act: Activation,
        gate_up: &mut B::Buf,
        out: &mut B::Buf,
    ) -> Result<()> {
        if !self.touches(j, GATE_UP) {
            return backend.matmul_gated_act(x, w_gate_up, rows, k, ffn, act, gate_up, out);
        }
        backend.matmul(x, w_gate_up, None, rows, k, 2 * ffn, gate_up)?;
        self.apply(backend, j, GATE_UP, x, gate_up)?;
        backend.gated_act(gate_up, rows, ffn, act, out)
    }
}
