//! The Llama family and the families that share its graph: Llama 2/3 and SmolLM2, Mistral
//! (sliding-window attention), Qwen2 (biases on the Q, K and V projections), Qwen3 (per-head
//! RMSNorm of Q and K before RoPE), Granite (multipliers on the embeddings, the residual
//! branches, the attention scores and the logits), and with a mixture of experts for an MLP
//! (`moe.rs`): Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (RMSNorm of all of Q and of K). Written
//! once over the [`Backend`] trait.
//!
//! Shapes: T = tokens in the step (all sequences flattened), R = rows whose logits are wanted,
//! H = query heads, Hkv = kv heads, D = head_dim, F = intermediate size.

use super::config::{Fields, ModelConfig};
use super::gguf::GgufFile;
use super::kv_cache::KvCache;
use super::lora::{DOWN, LoraAdapter, LoraSet, O, QKV, gated_sites};
use super::moe::{self, HfKeys, Moe};
use super::shard::Lin::File;
use super::shard::{Head, Lin};
use super::stack::{Family, Load, Stack};
use super::{Norm, attend, stack_linear};
use crate::backend::{Backend, DeviceBatch, QkNormSpan};
use crate::tensor::DType;
use anyhow::{Result, bail};
use serde_json::Value;

struct Layer<B: Backend> {
    attn_norm: B::Buf,      // [hidden] f32
    wqkv: B::Buf,           // [(H + 2 Hkv) D, hidden]: q, k and v projections stacked
    bqkv: Option<B::Buf>,   // [(H + 2 Hkv) D] f32 (Qwen2)
    q_norm: Option<B::Buf>, // [D] f32 (Qwen3); [H D] (OLMoE)
    k_norm: Option<B::Buf>, // [D] f32 (Qwen3); [Hkv D] (OLMoE)
    wo: B::Buf,             // [hidden, H D]
    mlp_norm: B::Buf,       // [hidden] f32
    mlp: Mlp<B>,
}

enum Mlp<B: Backend> {
    Dense {
        gate_up: B::Buf, // [2 F, hidden]: gate and up projections stacked
        down: B::Buf,    // [hidden, F]
    },
    Experts(Moe<B>),
}

pub struct Llama<B: Backend> {
    stack: Stack<B>,
    /// This stage's layers.
    layers: Vec<Layer<B>>,
    /// What the Q and K norms span: each head (Qwen3), or all of Q and of K (OLMoE).
    qk_span: QkNormSpan,
    /// Granite's multipliers of the embeddings and of each residual branch.
    embedding_multiplier: Option<f32>,
    residual_multiplier: Option<f32>,
    rope_cos: B::Buf, // [max_positions, D / 2]
    rope_sin: B::Buf, // [max_positions, D / 2]
    /// The LoRA adapters loaded, on [`gated_sites`].
    loras: LoraSet<B>,
}

// ---- configuration: the family-specific parts (registry hooks) ------------------------------

/// `model_type: llama`: no sliding window, biases only where `attention_bias` says.
pub fn hf_config_llama(_v: &Value, _c: &mut ModelConfig) -> Result<()> {
    Ok(())
}

/// `model_type: mistral`: a sliding window over every layer where `sliding_window` is set.
pub fn hf_config_mistral(v: &Value, c: &mut ModelConfig) -> Result<()> {
    c.sliding_window = hf_sliding_window(v)?;
    Ok(())
}

/// `sliding_window`: a positive integer, or null (none).
pub fn hf_sliding_window(v: &Value) -> Result<Option<usize>> {
    match Fields::top(v).usize("sliding_window") {
        Ok(Some(0)) | Err(_) => bail!(
            "sliding_window must be a positive integer or null, found {}",
            crate::untrusted::json(&v["sliding_window"])
        ),
        w => w,
    }
}

/// `model_type: qwen2`: biases on Q, K and V. Qwen2's optional sliding window applies to some
/// layers only (`max_window_layers`); it is off in every released checkpoint.
pub fn hf_config_qwen2(v: &Value, c: &mut ModelConfig) -> Result<()> {
    c.attention_bias = true;
    if Fields::top(v).bool("use_sliding_window")? == Some(true) {
        bail!("use_sliding_window: true is not supported for qwen2");
    }
    Ok(())
}

/// `model_type: qwen3`: RMSNorm of each Q and K head (`q_norm`, `k_norm`) before RoPE.
pub fn hf_config_qwen3(v: &Value, c: &mut ModelConfig) -> Result<()> {
    c.qk_norm = true;
    if Fields::top(v).bool("use_sliding_window")? == Some(true) {
        bail!("use_sliding_window: true is not supported for qwen3");
    }
    Ok(())
}

/// `model_type: mixtral`: Mistral with `num_local_experts` experts of `intermediate_size` in
/// every layer, the top-k weights renormalised.
pub fn hf_config_mixtral(v: &Value, c: &mut ModelConfig) -> Result<()> {
    hf_config_mistral(v, c)?;
    let keys = HfKeys {
        experts: &["num_local_experts"],
        expert_ffn: "intermediate_size",
        norm_topk_prob: true,
    };
    c.moe = Some(moe::hf_config(v, c.num_layers, keys)?);
    Ok(())
}

/// The experts of Qwen2-MoE and Qwen3-MoE: `num_experts` of `moe_intermediate_size`, a shared
/// expert where `shared_expert_intermediate_size` is set.
fn qwen_experts(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let keys = HfKeys {
        experts: &["num_experts", "num_local_experts"],
        expert_ffn: "moe_intermediate_size",
        norm_topk_prob: false,
    };
    c.moe = Some(moe::hf_config(v, c.num_layers, keys)?);
    Ok(())
}

/// `model_type: qwen2_moe`: Qwen2 with experts and a gated shared expert.
pub fn hf_config_qwen2_moe(v: &Value, c: &mut ModelConfig) -> Result<()> {
    hf_config_qwen2(v, c)?;
    qwen_experts(v, c)
}

/// `model_type: qwen3_moe`: Qwen3 with experts.
pub fn hf_config_qwen3_moe(v: &Value, c: &mut ModelConfig) -> Result<()> {
    hf_config_qwen3(v, c)?;
    qwen_experts(v, c)
}

/// `model_type: olmoe`: experts of `intermediate_size`, RMSNorm of all of Q and of all of K.
pub fn hf_config_olmoe(v: &Value, c: &mut ModelConfig) -> Result<()> {
    if !Fields::top(v).get("clip_qkv").is_null() {
        bail!("olmoe with clip_qkv is not supported");
    }
    c.qk_norm = true;
    c.extra = serde_json::json!({ "qk_norm_all": true });
    let keys = HfKeys {
        experts: &["num_experts", "num_local_experts"],
        expert_ffn: "intermediate_size",
        norm_topk_prob: false,
    };
    c.moe = Some(moe::hf_config(v, c.num_layers, keys)?);
    Ok(())
}

/// `model_type: granite`: Llama with `embedding_multiplier`, `residual_multiplier` (kept in
/// `extra` for the model), `attention_multiplier` (the attention scale) and `logits_scaling`
/// (the logits are divided by it).
pub fn hf_config_granite(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    // NOTE: Granite's biases would sit on o_proj and the MLP too, which this graph has not.
    for k in ["attention_bias", "mlp_bias"] {
        if f.bool(k)? == Some(true) {
            bail!("granite with {k}: true is not supported");
        }
    }
    granite_multipliers(
        c,
        f.f64("embedding_multiplier")?,
        f.f64("residual_multiplier")?,
        f.f64("attention_multiplier")?,
        f.f64("logits_scaling")?,
    )
}

/// Granite's multipliers into the config; each must be a positive number.
fn granite_multipliers(
    c: &mut ModelConfig,
    embedding: Option<f64>,
    residual: Option<f64>,
    attention: Option<f64>,
    logits_divisor: Option<f64>,
) -> Result<()> {
    for (name, m) in [
        ("embedding_multiplier", embedding),
        ("residual_multiplier", residual),
        ("attention_multiplier", attention),
        ("logits_scaling", logits_divisor),
    ] {
        if let Some(m) = m
            && !(m > 0.0 && m.is_finite())
        {
            bail!("{name} must be a positive number, got {m}");
        }
    }
    c.extra = serde_json::json!({
        "embedding_multiplier": embedding,
        "residual_multiplier": residual,
    });
    c.attn_scale = attention.or(c.attn_scale);
    c.logit_scale = logits_divisor.map(|d| 1.0 / d);
    Ok(())
}

/// The GGUF keys of these families beyond the common ones: an optional sliding window (Mistral
/// files are `llama` with `{arch}.attention.sliding_window`), Q/K norms where the file has them.
pub fn gguf_config(g: &GgufFile, arch: &str, c: &mut ModelConfig) -> Result<()> {
    let key = format!("{arch}.attention.sliding_window");
    if let Some(v) = g.metadata().get(&key) {
        match v.as_u64() {
            Some(0) => {}
            Some(w) => c.sliding_window = Some(w as usize),
            None => bail!("metadata '{key}' should be a non-negative integer, found {v:?}"),
        }
    }
    c.attention_bias |= g.tensor_info("blk.0.attn_q.bias").is_some();
    if arch == "granite" {
        let key = |k: &str| g.meta_f64(&format!("{arch}.{k}"));
        granite_multipliers(
            c,
            key("embedding_scale")?,
            key("residual_scale")?,
            key("attention.scale")?,
            key("logit_scale")?,
        )?;
    }
    c.qk_norm |= matches!(arch, "qwen3" | "qwen3moe" | "olmoe");
    if arch == "olmoe" {
        c.extra = serde_json::json!({ "qk_norm_all": true });
    }
    // NOTE: llama.cpp renormalises the top-k weights of Mixtral (`llama`) and Qwen3-MoE, not
    // those of Qwen2-MoE and OLMoE, where the file does not say.
    c.moe = moe::gguf_config(g, arch, c, matches!(arch, "llama" | "qwen3moe"))?;
    if c.qk_norm && g.tensor_info("blk.0.attn_q_norm.weight").is_none() {
        bail!("a {arch} model needs Q/K norms, but the file has no blk.0.attn_q_norm.weight");
    }
    Ok(())
}

impl<B: Backend> Llama<B> {
    /// Uploads the weights of one worker's shard ([`Load`]).
    pub fn load(ld: Load<'_, B>, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let (c, backend, max_positions) = (ld.cfg, ld.backend, ld.max_positions);
        let (h, hkv, d, hid, f) = c.layer_sizes();
        let (sh, mut up, total) = ld.start()?;
        let place = ld.place;
        let qk_span = match c.extra["qk_norm_all"].as_bool() {
            Some(true) => QkNormSpan::All,
            _ => QkNormSpan::Head,
        };
        // NOTE: a norm over all heads needs them all: under tensor parallelism each rank
        // computes the whole QKV projection and keeps its heads' rows, as OLMo 2 does.
        let whole_qkv = qk_span == QkNormSpan::All && sh.tp > 1;
        if whole_qkv && c.attention_bias {
            bail!("QKV biases with Q/K norms over all heads are not supported");
        }
        let (q_len, k_len) = qk_span.weight_lens(c.qkv_layout());
        let embed = if place.first_stage() || (c.tie_word_embeddings && place.last_stage()) {
            Some(sh.vocab_table(&mut up, "model.embed_tokens.weight", hid, c.vocab_size)?)
        } else {
            None
        };
        progress(1, total);
        let mut layers = Vec::with_capacity(place.layers.len());
        for i in place.layers.clone() {
            let p = format!("model.layers.{i}.");
            let n = |s: &str| format!("{p}{s}");
            // NOTE: Phi-3 stores the projections fused, in the order we stack them.
            let fused = n("self_attn.qkv_proj.weight");
            let proj = |s: &str, rows| up.fetch_linear(&n(s), &[rows, hid]);
            let wqkv = match up.has(&fused)? {
                _ if whole_qkv => stack_linear(vec![
                    proj("self_attn.q_proj.weight", h * d)?,
                    proj("self_attn.k_proj.weight", hkv * d)?,
                    proj("self_attn.v_proj.weight", hkv * d)?,
                ])?,
                true => sh.qkv_fused(&up, File(&fused, [(h + 2 * hkv) * d, hid]))?,
                false => sh.qkv(
                    &up,
                    File(&n("self_attn.q_proj.weight"), [h * d, hid]),
                    File(&n("self_attn.k_proj.weight"), [hkv * d, hid]),
                    File(&n("self_attn.v_proj.weight"), [hkv * d, hid]),
                )?,
            };
            let bqkv = if c.attention_bias {
                let b = |s: &str, rows: usize| up.fetch(&n(s), &[rows]).map(Lin::bias);
                let b = sh.qkv(
                    &up,
                    b("self_attn.q_proj.bias", h * d)?,
                    b("self_attn.k_proj.bias", hkv * d)?,
                    b("self_attn.v_proj.bias", hkv * d)?,
                )?;
                Some(up.upload_bias(b)?)
            } else {
                None
            };
            let (q_norm, k_norm) = if c.qk_norm {
                (
                    Some(up.weight(&n("self_attn.q_norm.weight"), &[q_len], DType::F32)?),
                    Some(up.weight(&n("self_attn.k_norm.weight"), &[k_len], DType::F32)?),
                )
            } else {
                (None, None)
            };
            let wo = sh.o_proj(&up, File(&n("self_attn.o_proj.weight"), [hid, h * d]))?;
            let mlp = match &c.moe {
                Some(m) if m.sparse(i) => Mlp::Experts(Moe::load(&mut up, &sh, m, hid, &p)?),
                _ => {
                    let fused = n("mlp.gate_up_proj.weight");
                    let gate_up = match up.has(&fused)? {
                        true => sh.gate_up_fused(&up, File(&fused, [2 * f, hid]))?,
                        false => sh.gate_up(
                            &up,
                            File(&n("mlp.gate_proj.weight"), [f, hid]),
                            File(&n("mlp.up_proj.weight"), [f, hid]),
                        )?,
                    };
                    let down = sh.down(&up, File(&n("mlp.down_proj.weight"), [hid, f]))?;
                    Mlp::Dense {
                        gate_up: up.upload_linear(gate_up)?,
                        down: up.upload_linear(down)?,
                    }
                }
            };
            layers.push(Layer {
                attn_norm: up.weight(&n("input_layernorm.weight"), &[hid], DType::F32)?,
                wqkv: up.upload_linear(wqkv)?,
                bqkv,
                q_norm,
                k_norm,
                wo: up.upload_linear(wo)?,
                mlp_norm: up.weight(&n("post_attention_layernorm.weight"), &[hid], DType::F32)?,
                mlp,
            });
            progress(i - place.layers.start + 2, total);
        }
        let head = if place.last_stage() {
            let norm = Norm::Rms(up.weight("model.norm.weight", &[hid], DType::F32)?);
            Some((
                norm,
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
        let (rope_cos, rope_sin) = super::rope::upload(backend, c, c.rope_theta, max_positions)?;
        let multiplier = |k: &str| c.extra[k].as_f64().map(|m| m as f32);
        let loras = LoraSet::new(
            gated_sites(c, &sh.lora_rows(), whole_qkv),
            &place,
            c.num_layers,
        );
        Ok(Llama {
            stack: Stack::new(c, sh, embed, head, max_positions, up.stats, place),
            layers,
            qk_span,
            embedding_multiplier: multiplier("embedding_multiplier"),
            residual_multiplier: multiplier("residual_multiplier"),
            rope_cos,
            rope_sin,
            loras,
        })
    }
}

impl<B: Backend> Family<B> for Llama<B> {
    fn stack(&self) -> &Stack<B> {
        &self.stack
    }

    fn set_lora(&mut self, backend: &B, slot: u32, adapter: Option<&LoraAdapter>) -> Result<u64> {
        // NOTE: an MoE layer's experts are not sites.
        if self.stack.cfg.moe.is_some() {
            bail!("LoRA adapters on mixture-of-experts models are not supported yet");
        }
        self.loras.set(backend, slot, adapter)
    }

    fn forward(&self, backend: &B, batch: &DeviceBatch<B>, kv: &mut KvCache<B>) -> Result<B::Buf> {
        let s = &self.stack;
        let (c, tp, t) = (&s.cfg, &s.place.tp, batch.host.num_tokens());
        let (hid, f, ql, eps) = s.sizes();
        let lora = self.loras.step(backend, batch)?;

        let mut x = s.input(backend, batch)?; // [T, hidden] residual stream
        if let Some(m) = self.embedding_multiplier.filter(|_| s.place.first_stage()) {
            backend.scale(&mut x, m, t * hid)?;
        }
        let residual = |o: &mut B::Buf| match self.residual_multiplier {
            Some(m) => backend.scale(o, m, t * hid),
            None => Ok(()),
        };
        let mut h = backend.alloc_scratch_f32(t * hid)?; // [T, hidden]
        let mut qkv = backend.alloc_scratch_f32(t * ql.row_len())?; // [T, (H + 2 Hkv) D] of this rank
        let mut attn = backend.alloc_scratch_f32(t * ql.q_len())?; // [T, H D]
        let mut gu = backend.alloc_scratch_f32(t * 2 * f)?; // [T, 2 F]
        let mut act = backend.alloc_scratch_f32(t * f)?; // [T, F]
        let mut o = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] output of o_proj / down_proj
        // norms over all heads, split: all heads' QKV rows, and which of their rows of D are ours
        let all = c.qkv_layout();
        let mut whole = match self.qk_span == QkNormSpan::All && s.place.tp_size() > 1 {
            true => Some((
                backend.alloc_scratch_f32(t * all.row_len())?, // [T, (H + 2 Hkv) D]
                backend.upload_u32(&s.shard.own_qkv_rows(all, t))?,
            )),
            false => None,
        };

        // NOTE: each residual add is fused with the norm that follows it (add_rms_norm): the
        // layer's input norm is applied at the end of the previous layer. Under tensor
        // parallelism o_proj and down_proj give partial sums, added over the ranks first.
        if let Some(first) = self.layers.first() {
            backend.rms_norm(&x, &first.attn_norm, t, hid, eps, &mut h)?;
        }
        for (j, w) in self.layers.iter().enumerate() {
            let l = s.place.layers.start + j;
            let (out, layout) = match &mut whole {
                Some((full, _)) => (full, all),
                None => (&mut qkv, ql),
            };
            backend.matmul(&h, &w.wqkv, w.bqkv.as_ref(), t, hid, layout.row_len(), out)?;
            lora.apply(backend, j, QKV, &h, out)?;
            if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
                backend.qk_norm(out, qn, kn, t, layout, self.qk_span, eps)?;
            }
            if let Some((full, rows)) = &whole {
                backend.gather_rows(full, rows, c.head_dim, &mut qkv)?;
            }
            attend(
                backend,
                kv,
                j,
                &mut qkv,
                Some((&self.rope_cos, &self.rope_sin)),
                batch,
                ql,
                c.attention_options(l),
                &mut attn,
            )?;
            backend.matmul(&attn, &w.wo, None, t, ql.q_len(), hid, &mut o)?;
            lora.apply(backend, j, O, &attn, &mut o)?;
            tp.all_reduce_sum(backend, &mut o, t * hid)?;
            residual(&mut o)?;
            backend.add_rms_norm(&mut x, &o, &w.mlp_norm, t, hid, eps, &mut h)?;
            match &w.mlp {
                Mlp::Dense { gate_up, down } => {
                    let a = c.hidden_act;
                    lora.matmul_gated_act(
                        backend,
                        j,
                        &h,
                        gate_up,
                        (t, hid, f),
                        a,
                        &mut gu,
                        &mut act,
                    )?;
                    backend.matmul(&act, down, None, t, f, hid, &mut o)?;
                    lora.apply(backend, j, DOWN, &act, &mut o)?;
                }
                Mlp::Experts(m) => o = m.forward(backend, &h, t, hid, c.hidden_act)?,
            }
            tp.all_reduce_sum(backend, &mut o, t * hid)?;
            residual(&mut o)?;
            match self.layers.get(j + 1) {
                Some(next) => {
                    backend.add_rms_norm(&mut x, &o, &next.attn_norm, t, hid, eps, &mut h)?
                }
                None => backend.add_assign(&mut x, &o, t * hid)?,
            }
        }
        s.output(backend, x, batch)
    }
}
