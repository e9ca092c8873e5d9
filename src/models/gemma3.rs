//! Gemma 3 (`gemma3_text`, GGUF `gemma3`): RMSNorms that scale by `1 + w`, four of them per
//! layer (before and after attention, before and after the MLP), per-head Q/K norms, embeddings
//! scaled by `sqrt(hidden)`, GeGLU (GELU tanh), interleaved local layers (sliding window, their
//! own RoPE base) and global ones, the attention scale `query_pre_attn_scalar^-1/2`, and
//! optional soft-capping of attention scores and final logits.
//!
//! Shapes: T = tokens in the step, R = rows whose logits are wanted, H = query heads,
//! Hkv = kv heads, D = head_dim, F = intermediate size.

use super::config::{Fields, ModelConfig};
use super::gguf::{GgufFile, GgufFix, GgufTensorName, map_name};
use super::kv_cache::KvCache;
use super::lora::{DOWN, LoraAdapter, LoraSet, O, QKV, gated_sites};
use super::shard::Head;
use super::shard::Lin::File;
use super::stack::{Family, Load, Stack};
use super::{Norm, Uploader, attend};
use crate::backend::{Backend, DeviceBatch, QkNormSpan};
use crate::tensor::{DType, HostTensor};
use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The RoPE base of local layers where the config does not say (google/gemma-3 configs).
const LOCAL_ROPE_THETA: f64 = 10_000.0;
/// Every `SLIDING_PATTERN`-th layer is global where the config does not list layer types.
const SLIDING_PATTERN: usize = 6;

fn sliding_by_pattern(layers: usize, pattern: usize) -> Vec<bool> {
    (0..layers).map(|i| (i + 1) % pattern != 0).collect()
}

pub fn hf_config(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    c.qk_norm = true;
    c.sliding_window = match f.usize("sliding_window") {
        Ok(Some(w)) if w > 0 => Some(w),
        _ => bail!(
            "gemma3_text needs a positive sliding_window, found {}",
            crate::untrusted::json(f.get("sliding_window"))
        ),
    };
    c.sliding_layers = match f.get("layer_types") {
        Value::Null => {
            let p = match f.usize("sliding_window_pattern")? {
                Some(p) => p,
                None => f
                    .usize("_sliding_window_pattern")?
                    .unwrap_or(SLIDING_PATTERN),
            };
            if p == 0 {
                bail!("sliding_window_pattern must be positive");
            }
            sliding_by_pattern(c.num_layers, p)
        }
        Value::Array(a) => a
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => bail!(
                    "layer_types has an unknown entry {}",
                    crate::untrusted::json(t)
                ),
            })
            .collect::<Result<_>>()?,
        other => bail!(
            "'layer_types' must be a list, found {}",
            crate::untrusted::json(other)
        ),
    };
    // transformers 5: rope_parameters per layer type; before: rope_theta and
    // rope_local_base_freq.
    let rp = f.object("rope_parameters")?;
    let full = match &rp {
        Some(rp) => rp.object("full_attention")?,
        None => None,
    };
    let sliding = match &rp {
        Some(rp) => rp.object("sliding_attention")?,
        None => None,
    };
    if let Some(t) = match &full {
        Some(full) => full.f64("rope_theta")?,
        None => None,
    } {
        c.rope_theta = t;
    }
    let local = match &sliding {
        Some(s) => s.f64("rope_theta")?,
        None => None,
    };
    c.rope_theta_local = Some(match local {
        Some(t) => t,
        None => f.f64("rope_local_base_freq")?.unwrap_or(LOCAL_ROPE_THETA),
    });
    for (k, what) in [(&full, "full_attention"), (&sliding, "sliding_attention")] {
        if let Some(k) = k
            && let Some(t) = k.str("rope_type")?
            && t != "default"
        {
            bail!(
                "rope_parameters.{what}.rope_type '{}' is not supported for gemma3 yet",
                crate::untrusted::text(t)
            );
        }
    }
    let q = f.f64("query_pre_attn_scalar")?.unwrap_or(c.head_dim as f64);
    c.attn_scale = Some(q.powf(-0.5));
    c.attn_logit_softcap = f.f64("attn_logit_softcapping")?;
    c.final_logit_softcap = f.f64("final_logit_softcapping")?;
    if f.get("hidden_activation").is_null() && f.get("hidden_act").is_null() {
        c.hidden_act = crate::backend::Activation::GeluTanh;
    }
    c.tie_word_embeddings = f.bool("tie_word_embeddings")?.unwrap_or(true);
    Ok(())
}

/// llama.cpp's `gemma3` keys: the window, the pattern of 6, the local base of 10000 and the
/// scale `1 / sqrt(head_dim)` are fixed by llama.cpp for the sizes it converts (not stored).
pub fn gguf_config(g: &GgufFile, arch: &str, c: &mut ModelConfig) -> Result<()> {
    let key = format!("{arch}.attention.sliding_window");
    let w = g
        .metadata()
        .get(&key)
        .and_then(|v| v.as_u64())
        .with_context(|| format!("a {arch} model needs the integer metadata '{key}'"))?;
    if w == 0 {
        bail!("metadata '{key}' must be positive");
    }
    c.sliding_window = Some(w as usize);
    // Newer files store the pattern (an integer, or one bool per layer) and the local base.
    let pattern_key = format!("{arch}.attention.sliding_window_pattern");
    c.sliding_layers = match g.metadata().get(&pattern_key) {
        None => sliding_by_pattern(c.num_layers, SLIDING_PATTERN),
        Some(v) => match (v.as_u64(), v.as_array()) {
            (Some(p), _) if p > 0 => sliding_by_pattern(c.num_layers, p as usize),
            (_, Some(a)) => a
                .iter()
                .map(|x| x.as_bool())
                .collect::<Option<Vec<bool>>>()
                .with_context(|| format!("metadata '{pattern_key}' has non-bool entries"))?,
            _ => bail!("metadata '{pattern_key}' should be a positive integer or bools"),
        },
    };
    c.rope_theta_local = Some(
        g.meta_f64(&format!("{arch}.rope.freq_base_swa"))?
            .unwrap_or(LOCAL_ROPE_THETA),
    );
    c.qk_norm = true;
    // NOTE: llama.cpp uses 1/sqrt(head_dim) for the sizes it converts (query_pre_attn_scalar
    // equals head_dim there) unless the file says otherwise
    c.attn_scale = Some(
        g.meta_f64(&format!("{arch}.attention.scale"))?
            .unwrap_or((c.head_dim as f64).powf(-0.5)),
    );
    c.final_logit_softcap = g.meta_f64(&format!("{arch}.final_logit_softcapping"))?;
    c.hidden_act = crate::backend::Activation::GeluTanh;
    if g.tensor_info("blk.0.attn_q_norm.weight").is_none() {
        bail!("a {arch} model needs Q/K norms, but the file has no blk.0.attn_q_norm.weight");
    }
    Ok(())
}

/// llama.cpp's names for Gemma 3's tensors; its RMSNorm weights are stored as `1 + w`.
pub fn gguf_tensor_name(hf: &str) -> Option<GgufTensorName> {
    let one = Some(GgufFix::SubtractOne);
    map_name(
        hf,
        &[("model.embed_tokens.weight", "token_embd.weight")],
        "model.layers.",
        &[
            ("input_layernorm", "attn_norm", one),
            ("post_attention_layernorm", "post_attention_norm", one),
            ("pre_feedforward_layernorm", "ffn_norm", one),
            ("post_feedforward_layernorm", "post_ffw_norm", one),
            ("self_attn.q_norm", "attn_q_norm", one),
            ("self_attn.k_norm", "attn_k_norm", one),
            ("self_attn.q_proj", "attn_q", None),
            ("self_attn.k_proj", "attn_k", None),
            ("self_attn.v_proj", "attn_v", None),
            ("self_attn.o_proj", "attn_output", None),
            ("mlp.gate_proj", "ffn_gate", None),
            ("mlp.up_proj", "ffn_up", None),
            ("mlp.down_proj", "ffn_down", None),
        ],
    )
    .or_else(|| (hf == "model.norm.weight").then(|| ("output_norm.weight".into(), one)))
}

struct Layer<B: Backend> {
    in_norm: B::Buf,        // [hidden] f32, 1 + w
    wqkv: B::Buf,           // [(H + 2 Hkv) D, hidden]
    q_norm: B::Buf,         // [D] f32, 1 + w
    k_norm: B::Buf,         // [D] f32, 1 + w
    wo: B::Buf,             // [hidden, H D]
    post_attn_norm: B::Buf, // [hidden] f32, 1 + w
    pre_ffn_norm: B::Buf,   // [hidden] f32, 1 + w
    w_gate_up: B::Buf,      // [2 F, hidden]
    w_down: B::Buf,         // [hidden, F]
    post_ffn_norm: B::Buf,  // [hidden] f32, 1 + w
}

pub struct Gemma3<B: Backend> {
    stack: Stack<B>,
    /// This stage's layers.
    layers: Vec<Layer<B>>,
    /// RoPE tables `[max_positions, D / 2]`: global layers, then local ones.
    rope_global: (B::Buf, B::Buf),
    rope_local: (B::Buf, B::Buf),
    /// The LoRA adapters loaded.
    loras: LoraSet<B>,
}

/// Gemma's RMSNorm scales by `1 + w`: the weight is uploaded with the 1 added.
fn plus_one(mut t: HostTensor) -> HostTensor {
    t.data.iter_mut().for_each(|x| *x += 1.0);
    t
}

impl<B: Backend> Gemma3<B> {
    /// Uploads the weights of one worker's shard ([`Load`]).
    pub fn load(ld: Load<'_, B>, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let (c, backend, max_positions) = (ld.cfg, ld.backend, ld.max_positions);
        let (h, hkv, d, hid, f) = c.layer_sizes();
        let (sh, mut up, total) = ld.start()?;
        let place = ld.place;
        let norm = |up: &mut Uploader<B>, name: &str, dim: usize| -> Result<B::Buf> {
            let t = plus_one(up.fetch(name, &[dim])?);
            up.upload(&t, DType::F32)
        };
        let embed = if place.first_stage() || (c.tie_word_embeddings && place.last_stage()) {
            Some(sh.vocab_table(&mut up, "model.embed_tokens.weight", hid, c.vocab_size)?)
        } else {
            None
        };
        progress(1, total);
        let mut layers = Vec::with_capacity(place.layers.len());
        for i in place.layers.clone() {
            let n = |s: &str| format!("model.layers.{i}.{s}");
            let wqkv = sh.qkv(
                &up,
                File(&n("self_attn.q_proj.weight"), [h * d, hid]),
                File(&n("self_attn.k_proj.weight"), [hkv * d, hid]),
                File(&n("self_attn.v_proj.weight"), [hkv * d, hid]),
            )?;
            let gate_up = sh.gate_up(
                &up,
                File(&n("mlp.gate_proj.weight"), [f, hid]),
                File(&n("mlp.up_proj.weight"), [f, hid]),
            )?;
            let wo = sh.o_proj(&up, File(&n("self_attn.o_proj.weight"), [hid, h * d]))?;
            let w_down = sh.down(&up, File(&n("mlp.down_proj.weight"), [hid, f]))?;
            layers.push(Layer {
                in_norm: norm(&mut up, &n("input_layernorm.weight"), hid)?,
                wqkv: up.upload_linear(wqkv)?,
                q_norm: norm(&mut up, &n("self_attn.q_norm.weight"), d)?,
                k_norm: norm(&mut up, &n("self_attn.k_norm.weight"), d)?,
                wo: up.upload_linear(wo)?,
                post_attn_norm: norm(&mut up, &n("post_attention_layernorm.weight"), hid)?,
                pre_ffn_norm: norm(&mut up, &n("pre_feedforward_layernorm.weight"), hid)?,
                w_gate_up: up.upload_linear(gate_up)?,
                w_down: up.upload_linear(w_down)?,
                post_ffn_norm: norm(&mut up, &n("post_feedforward_layernorm.weight"), hid)?,
            });
            progress(i - place.layers.start + 2, total);
        }
        let head = if place.last_stage() {
            let final_norm = Norm::Rms(norm(&mut up, "model.norm.weight", hid)?);
            Some((
                final_norm,
                Head::load(
                    &mut up,
                    &sh,
                    c,
                    (embed.is_some(), "model.embed_tokens.weight"),
                    &ld.head,
                )?,
            ))
        } else {
            None
        };
        progress(total, total);
        let tables = |theta: f64| super::rope::upload(backend, c, theta, max_positions);
        let rope_global = tables(c.rope_theta)?;
        let rope_local = tables(c.rope_theta_local.unwrap_or(c.rope_theta))?;
        let loras = LoraSet::new(gated_sites(c, &sh.lora_rows(), false), &place, c.num_layers);
        Ok(Gemma3 {
            stack: Stack::new(c, sh, embed, head, max_positions, up.stats, place),
            layers,
            rope_global,
            rope_local,
            loras,
        })
    }
}

impl<B: Backend> Family<B> for Gemma3<B> {
    fn stack(&self) -> &Stack<B> {
        &self.stack
    }

    fn set_lora(&mut self, backend: &B, slot: u32, adapter: Option<&LoraAdapter>) -> Result<u64> {
        self.loras.set(backend, slot, adapter)
    }

    fn forward(&self, backend: &B, batch: &DeviceBatch<B>, kv: &mut KvCache<B>) -> Result<B::Buf> {
        let s = &self.stack;
        let (c, tp, t) = (&s.cfg, &s.place.tp, batch.host.num_tokens());
        let (hid, f, ql, eps) = s.sizes();
        let lora = self.loras.step(backend, batch)?;

        let mut x = s.input(backend, batch)?; // [T, hidden] residual stream
        if s.place.first_stage() {
            // NOTE: transformers rounds sqrt(hidden) to the embedding's dtype; ours is f32.
            backend.scale(&mut x, (hid as f32).sqrt(), t * hid)?;
        }
        let mut h = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] normed input of a block
        let mut qkv = backend.alloc_scratch_f32(t * ql.row_len())?; // [T, (H + 2 Hkv) D] of this rank
        let mut attn = backend.alloc_scratch_f32(t * ql.q_len())?; // [T, H D]
        let mut gu = backend.alloc_scratch_f32(t * 2 * f)?; // [T, 2 F]
        let mut act = backend.alloc_scratch_f32(t * f)?; // [T, F]
        let mut o = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] output of o_proj / down_proj
        let mut on = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] that output, normed

        if let Some(first) = self.layers.first() {
            backend.rms_norm(&x, &first.in_norm, t, hid, eps, &mut h)?;
        }
        for (j, w) in self.layers.iter().enumerate() {
            let l = s.place.layers.start + j;
            let (cos, sin) = match c.layer_window(l) {
                Some(_) => &self.rope_local,
                None => &self.rope_global,
            };
            backend.matmul(&h, &w.wqkv, None, t, hid, ql.row_len(), &mut qkv)?;
            lora.apply(backend, j, QKV, &h, &mut qkv)?;
            backend.qk_norm(&mut qkv, &w.q_norm, &w.k_norm, t, ql, QkNormSpan::Head, eps)?;
            attend(
                backend,
                kv,
                j,
                &mut qkv,
                Some((cos, sin)),
                batch,
                ql,
                c.attention_options(l),
                &mut attn,
            )?;
            // NOTE: under tensor parallelism o_proj and down_proj give partial sums: added
            // over the ranks before their norms.
            backend.matmul(&attn, &w.wo, None, t, ql.q_len(), hid, &mut o)?;
            lora.apply(backend, j, O, &attn, &mut o)?;
            tp.all_reduce_sum(backend, &mut o, t * hid)?;
            // x += post_attn_norm(o); h = pre_ffn_norm(x)
            backend.rms_norm(&o, &w.post_attn_norm, t, hid, eps, &mut on)?;
            backend.add_rms_norm(&mut x, &on, &w.pre_ffn_norm, t, hid, eps, &mut h)?;
            let a = c.hidden_act;
            lora.matmul_gated_act(
                backend,
                j,
                &h,
                &w.w_gate_up,
                (t, hid, f),
                a,
                &mut gu,
                &mut act,
            )?;
            backend.matmul(&act, &w.w_down, None, t, f, hid, &mut o)?;
            lora.apply(backend, j, DOWN, &act, &mut o)?;
            tp.all_reduce_sum(backend, &mut o, t * hid)?;
            // x += post_ffn_norm(o); h = the next layer's input norm of x
            backend.rms_norm(&o, &w.post_ffn_norm, t, hid, eps, &mut on)?;
            match self.layers.get(j + 1) {
                Some(next) => {
                    backend.add_rms_norm(&mut x, &on, &next.in_norm, t, hid, eps, &mut h)?
                }
                None => backend.add_assign(&mut x, &on, t * hid)?,
            }
        }
        s.output(backend, x, batch)
    }
}
