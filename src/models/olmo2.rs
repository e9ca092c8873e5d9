//! OLMo 2 (`olmo2`): Llama's attention and SwiGLU MLP with the norms moved after them (each
//! branch's output is RMS-normalised before the residual add; nothing normalises a branch's
//! input), and RMSNorm of all of Q and of all of K (not per head) before RoPE.
//!
//! Split by tensor parallelism, every rank computes all of Q, K and V (the QKV projection is
//! not split), normalises them and keeps its heads' rows: the norms' mean squares span every
//! head. (vLLM all-gathers Q and K instead; this costs each rank the projection's weights and
//! flops, and no communication.)
//!
//! Shapes: T = tokens in the step, R = rows whose logits are wanted, H = query heads,
//! Hkv = kv heads, D = head_dim, F = intermediate size.

use super::config::ModelConfig;
use super::gguf::{GgufFile, GgufTensorName, map_name};
use super::kv_cache::KvCache;
use super::lora::{DOWN, LoraAdapter, LoraSet, O, QKV, gated_sites};
use super::shard::Head;
use super::shard::Lin::File;
use super::stack::{Family, Load, Stack};
use super::stack_linear;
use super::{Norm, attend};
use crate::backend::{Backend, DeviceBatch, QkNormSpan};
use crate::tensor::DType;
use anyhow::{Result, bail};
use serde_json::Value;

pub fn hf_config(_v: &Value, _c: &mut ModelConfig) -> Result<()> {
    Ok(())
}

/// llama.cpp's `olmo2` files: Q and K as transformers stores them (no permutation).
pub fn gguf_config(g: &GgufFile, arch: &str, _c: &mut ModelConfig) -> Result<()> {
    if g.tensor_info("blk.0.attn_q_norm.weight").is_none() {
        bail!("a {arch} model needs Q/K norms, but the file has no blk.0.attn_q_norm.weight");
    }
    Ok(())
}

pub fn gguf_tensor_name(hf: &str) -> Option<GgufTensorName> {
    map_name(
        hf,
        &[
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ],
        "model.layers.",
        &[
            ("self_attn.q_proj", "attn_q", None),
            ("self_attn.k_proj", "attn_k", None),
            ("self_attn.v_proj", "attn_v", None),
            ("self_attn.o_proj", "attn_output", None),
            ("self_attn.q_norm", "attn_q_norm", None),
            ("self_attn.k_norm", "attn_k_norm", None),
            ("post_attention_layernorm", "post_attention_norm", None),
            ("mlp.gate_proj", "ffn_gate", None),
            ("mlp.up_proj", "ffn_up", None),
            ("mlp.down_proj", "ffn_down", None),
            ("post_feedforward_layernorm", "post_ffw_norm", None),
        ],
    )
}

struct Layer<B: Backend> {
    wqkv: B::Buf,      // [(H + 2 Hkv) D, hidden] of all heads, also when split
    q_norm: B::Buf,    // [H D] f32
    k_norm: B::Buf,    // [Hkv D] f32
    wo: B::Buf,        // [hidden, H D]
    attn_norm: B::Buf, // [hidden] f32, on the attention's output
    w_gate_up: B::Buf, // [2 F, hidden]
    w_down: B::Buf,    // [hidden, F]
    mlp_norm: B::Buf,  // [hidden] f32, on the MLP's output
}

pub struct Olmo2<B: Backend> {
    stack: Stack<B>,
    layers: Vec<Layer<B>>,
    rope_cos: B::Buf, // [max_positions, D / 2]
    rope_sin: B::Buf,
    /// The LoRA adapters loaded.
    loras: LoraSet<B>,
}

impl<B: Backend> Olmo2<B> {
    /// Uploads the weights of one worker's shard ([`Load`]).
    pub fn load(ld: Load<'_, B>, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let (c, backend, max_positions) = (ld.cfg, ld.backend, ld.max_positions);
        let (h, hkv, d, hid, f) = c.layer_sizes();
        let split = ld.place.tp_size() > 1;
        let (sh, mut up, total) = ld.start()?;
        let place = ld.place;
        let embed = if place.first_stage() || (c.tie_word_embeddings && place.last_stage()) {
            Some(sh.vocab_table(&mut up, "model.embed_tokens.weight", hid, c.vocab_size)?)
        } else {
            None
        };
        progress(1, total);
        let mut layers = Vec::with_capacity(place.layers.len());
        for i in place.layers.clone() {
            let n = |s: &str| format!("model.layers.{i}.{s}");
            let (q, k, v) = (
                (n("self_attn.q_proj.weight"), [h * d, hid]),
                (n("self_attn.k_proj.weight"), [hkv * d, hid]),
                (n("self_attn.v_proj.weight"), [hkv * d, hid]),
            );
            let wqkv = match split {
                true => stack_linear(vec![
                    up.fetch_linear(&q.0, &q.1)?,
                    up.fetch_linear(&k.0, &k.1)?,
                    up.fetch_linear(&v.0, &v.1)?,
                ])?,
                false => sh.qkv(&up, File(&q.0, q.1), File(&k.0, k.1), File(&v.0, v.1))?,
            };
            let gate_up = sh.gate_up(
                &up,
                File(&n("mlp.gate_proj.weight"), [f, hid]),
                File(&n("mlp.up_proj.weight"), [f, hid]),
            )?;
            let wo = sh.o_proj(&up, File(&n("self_attn.o_proj.weight"), [hid, h * d]))?;
            let w_down = sh.down(&up, File(&n("mlp.down_proj.weight"), [hid, f]))?;
            let norm = |s: &str, len: usize| up.fetch(&n(s), &[len]);
            let (qn, kn) = (
                norm("self_attn.q_norm.weight", h * d)?,
                norm("self_attn.k_norm.weight", hkv * d)?,
            );
            let (an, mn) = (
                norm("post_attention_layernorm.weight", hid)?,
                norm("post_feedforward_layernorm.weight", hid)?,
            );
            layers.push(Layer {
                wqkv: up.upload_linear(wqkv)?,
                q_norm: up.upload(&qn, DType::F32)?,
                k_norm: up.upload(&kn, DType::F32)?,
                wo: up.upload_linear(wo)?,
                attn_norm: up.upload(&an, DType::F32)?,
                w_gate_up: up.upload_linear(gate_up)?,
                w_down: up.upload_linear(w_down)?,
                mlp_norm: up.upload(&mn, DType::F32)?,
            });
            progress(i - place.layers.start + 2, total);
        }
        let head = match place.last_stage() {
            true => {
                let norm = Norm::Rms(up.weight("model.norm.weight", &[hid], DType::F32)?);
                let table = (embed.is_some(), "model.embed_tokens.weight");
                Some((norm, Head::load(&mut up, &sh, c, table, &ld.head)?))
            }
            false => None,
        };
        progress(total, total);
        let (rope_cos, rope_sin) = super::rope::upload(backend, c, c.rope_theta, max_positions)?;
        Ok(Olmo2 {
            loras: LoraSet::new(gated_sites(c, &sh.lora_rows(), true), &place, c.num_layers),
            stack: Stack::new(c, sh, embed, head, max_positions, up.stats, place),
            layers,
            rope_cos,
            rope_sin,
        })
    }
}

impl<B: Backend> Family<B> for Olmo2<B> {
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
        let all = c.qkv_layout(); // all heads; `ql`: this rank's
        let mut x = s.input(backend, batch)?; // [T, hidden] residual stream
        let mut qkv = backend.alloc_scratch_f32(t * all.row_len())?; // [T, (H + 2 Hkv) D]
        // split: this rank's rows of D values of `qkv` ([T (H + 2 Hkv), D]), and where they go
        let mut mine = match s.place.tp_size() > 1 {
            true => Some((
                backend.upload_u32(&s.shard.own_qkv_rows(all, t))?,
                backend.alloc_scratch_f32(t * ql.row_len())?, // [T, (H + 2 Hkv) D] of this rank
            )),
            false => None,
        };
        let mut attn = backend.alloc_scratch_f32(t * ql.q_len())?; // [T, H D]
        let mut gu = backend.alloc_scratch_f32(t * 2 * f)?; // [T, 2 F]
        let mut act = backend.alloc_scratch_f32(t * f)?; // [T, F]
        let mut o = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] a branch's output
        let mut h = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] normalised

        for (j, w) in self.layers.iter().enumerate() {
            let l = s.place.layers.start + j;
            backend.matmul(&x, &w.wqkv, None, t, hid, all.row_len(), &mut qkv)?;
            lora.apply(backend, j, QKV, &x, &mut qkv)?;
            let span = QkNormSpan::All;
            backend.qk_norm(&mut qkv, &w.q_norm, &w.k_norm, t, all, span, eps)?;
            let local = match &mut mine {
                Some((rows, local)) => {
                    backend.gather_rows(&qkv, rows, c.head_dim, local)?;
                    local
                }
                None => &mut qkv,
            };
            attend(
                backend,
                kv,
                j,
                local,
                Some((&self.rope_cos, &self.rope_sin)),
                batch,
                ql,
                c.attention_options(l),
                &mut attn,
            )?;
            backend.matmul(&attn, &w.wo, None, t, ql.q_len(), hid, &mut o)?;
            lora.apply(backend, j, O, &attn, &mut o)?;
            tp.all_reduce_sum(backend, &mut o, t * hid)?;
            backend.rms_norm(&o, &w.attn_norm, t, hid, eps, &mut h)?;
            backend.add_assign(&mut x, &h, t * hid)?;
            let a = c.hidden_act;
            lora.matmul_gated_act(
                backend,
                j,
                &x,
                &w.w_gate_up,
                (t, hid, f),
                a,
                &mut gu,
                &mut act,
            )?;
            backend.matmul(&act, &w.w_down, None, t, f, hid, &mut o)?;
            lora.apply(backend, j, DOWN, &act, &mut o)?;
            tp.all_reduce_sum(backend, &mut o, t * hid)?;
            backend.rms_norm(&o, &w.mlp_norm, t, hid, eps, &mut h)?;
            backend.add_assign(&mut x, &h, t * hid)?;
        }
        s.output(backend, x, batch)
    }
}
