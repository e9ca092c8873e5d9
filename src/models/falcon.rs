//! Falcon (`falcon`): attention and MLP in parallel off the block's LayerNorm (two LayerNorms,
//! `ln_attn` and `ln_mlp`, in the new decoder architecture), multi-query or grouped KV, RoPE,
//! a plain GELU MLP, optional biases, tied embeddings or an output head of its own; RoPE, or
//! ALiBi (Falcon-RW, `alibi: true`: the bias added before the attention scale, so the slopes
//! are scaled by it, as the original code and vLLM do).
//!
//! Shapes: T = tokens in the step, R = rows whose logits are wanted, H = query heads,
//! Hkv = kv heads, D = head_dim, F = ffn size.

use super::config::{Fields, ModelConfig};
use super::gguf::{GgufFile, GgufTensorName, map_name};
use super::kv_cache::KvCache;
use super::rope::Positions;
use super::shard::Lin::{File, Have};
use super::shard::{Head, Lin};
use super::stack::{Family, Load, Stack};
use super::{Norm, Uploader, attend};
use crate::backend::{Backend, DeviceBatch};
use crate::tensor::{DType, HostTensor};
use anyhow::{Context, Result};
use serde_json::{Value, json};

/// Falcon's own config keys, copied to the common names; the KV heads follow transformers:
/// `num_kv_heads` in the new architecture, 1 with `multi_query`, else one per query head.
pub fn hf_prepare(v: &mut Value) -> Result<()> {
    let f = Fields::top(v);
    let hidden = f.req_usize("hidden_size")?;
    let ffn = match f.usize("ffn_hidden_size")? {
        Some(n) => n,
        None => hidden
            .checked_mul(4)
            .context("'hidden_size' is too large")?,
    };
    let new_arch = f.bool("new_decoder_architecture")?.unwrap_or(false);
    let multi_query = f.bool("multi_query")?.unwrap_or(true);
    v["intermediate_size"] = ffn.into();
    v["num_key_value_heads"] = if new_arch {
        v["num_kv_heads"].clone()
    } else if multi_query {
        1.into()
    } else {
        v["num_attention_heads"].clone()
    };
    for (from, to) in [
        ("layer_norm_epsilon", "rms_norm_eps"),
        ("activation", "hidden_act"),
    ] {
        if !v[from].is_null() {
            v[to] = v[from].clone();
        }
    }
    if v["hidden_act"].is_null() {
        v["hidden_act"] = "gelu".into();
    }
    if v["tie_word_embeddings"].is_null() {
        v["tie_word_embeddings"] = true.into();
    }
    Ok(())
}

pub fn hf_config(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    let new_arch = f.bool("new_decoder_architecture")?.unwrap_or(false);
    let parallel = f.bool("parallel_attn")?.unwrap_or(true);
    // transformers: two LayerNorms in the new architecture unless num_ln_in_parallel_attn is 1
    let two_norms = new_arch && f.u64("num_ln_in_parallel_attn")?.unwrap_or(2) == 2;
    c.extra = json!({
        "new_decoder_architecture": new_arch,
        "parallel_attn": parallel || new_arch,
        "two_norms": two_norms,
        "bias": f.bool("bias")?.unwrap_or(false),
        "alibi": f.bool("alibi")?.unwrap_or(false),
        "qkv_layout": if new_arch {
            "grouped"
        } else if f.bool("multi_query")?.unwrap_or(true) {
            "qkv"
        } else {
            "interleaved"
        },
    });
    Ok(())
}

/// llama.cpp's `falcon` files: the new architecture's second LayerNorm is `attn_norm_2`, and
/// its converter already reorders the fused QKV rows to `[q | k | v]`.
pub fn gguf_config(g: &GgufFile, arch: &str, c: &mut ModelConfig) -> Result<()> {
    c.rms_norm_eps = super::gpt2::layer_norm_eps(g, arch)?;
    c.hidden_act = crate::backend::Activation::Gelu;
    let two_norms = g.tensor_info("blk.0.attn_norm_2.weight").is_some();
    c.extra = json!({
        "new_decoder_architecture": two_norms,
        "parallel_attn": true,
        "two_norms": two_norms,
        "bias": g.tensor_info("blk.0.attn_qkv.bias").is_some(),
        "qkv_layout": "qkv",
    });
    Ok(())
}

pub fn gguf_tensor_name(hf: &str) -> Option<GgufTensorName> {
    map_name(
        hf,
        &[
            ("transformer.word_embeddings.weight", "token_embd.weight"),
            ("transformer.ln_f.weight", "output_norm.weight"),
            ("transformer.ln_f.bias", "output_norm.bias"),
            ("lm_head.weight", "output.weight"),
        ],
        "transformer.h.",
        &[
            ("input_layernorm", "attn_norm", None),
            // NOTE: llama.cpp names Falcon-40B's MLP norm attn_norm, its attention norm
            // attn_norm_2 (gguf's TensorNameMap)
            ("ln_mlp", "attn_norm", None),
            ("ln_attn", "attn_norm_2", None),
            ("self_attention.query_key_value", "attn_qkv", None),
            ("self_attention.dense", "attn_output", None),
            ("mlp.dense_h_to_4h", "ffn_up", None),
            ("mlp.dense_4h_to_h", "ffn_down", None),
        ],
    )
}

fn flag(c: &ModelConfig, k: &str) -> bool {
    c.extra[k].as_bool().unwrap_or(false)
}

/// Reorders the fused QKV rows (weight `[rows, hidden]` or bias `[rows]`) from Falcon's layout
/// into ours, `[q: H×D | k: Hkv×D | v: Hkv×D]`:
///
/// ```text
///   grouped (new architecture):   per kv group g: q_{g·rep} .. q_{g·rep+rep-1}, k_g, v_g
///   qkv (multi-query, GGUF):      q_0 .. q_{H-1}, k.., v..      (already ours)
///   interleaved (old multi-head): per head h: q_h, k_h, v_h
/// ```
fn reorder_qkv(t: HostTensor, c: &ModelConfig) -> HostTensor {
    let (h, hkv, d) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let cols = t.data.len() / ((h + 2 * hkv) * d);
    // source head index (in units of D rows) of each destination head
    let layout = c.extra["qkv_layout"].as_str().unwrap_or("qkv");
    let src_of = |dst: usize| -> usize {
        match layout {
            "grouped" => {
                let rep = h / hkv;
                if dst < h {
                    (dst / rep) * (rep + 2) + dst % rep
                } else if dst < h + hkv {
                    (dst - h) * (rep + 2) + rep
                } else {
                    (dst - h - hkv) * (rep + 2) + rep + 1
                }
            }
            "interleaved" if dst < h => dst * 3,
            "interleaved" if dst < 2 * h => (dst - h) * 3 + 1,
            "interleaved" => (dst - 2 * h) * 3 + 2,
            _ => dst,
        }
    };
    let block = d * cols;
    let mut data = vec![0f32; t.data.len()];
    for dst in 0..h + 2 * hkv {
        let s = src_of(dst);
        data[dst * block..(dst + 1) * block].copy_from_slice(&t.data[s * block..(s + 1) * block]);
    }
    HostTensor::new(t.shape, data)
}

struct Layer<B: Backend> {
    ln_attn: Norm<B>,        // LayerNorm [hidden]: input_layernorm or ln_attn
    ln_mlp: Option<Norm<B>>, // ln_mlp (two norms) or post_attention_layernorm (sequential)
    w_qkv: B::Buf,           // [(H + 2 Hkv) D, hidden] of this rank's heads
    b_qkv: Option<B::Buf>,
    w_o: B::Buf,         // [hidden, H D]
    b_o: Option<B::Buf>, // on tensor rank 0 only (added once to the sum)
    w_up: B::Buf,        // [F, hidden]
    b_up: Option<B::Buf>,
    w_down: B::Buf,         // [hidden, F]
    b_down: Option<B::Buf>, // on tensor rank 0 only
}

pub struct Falcon<B: Backend> {
    stack: Stack<B>,
    layers: Vec<Layer<B>>,
    positions: Positions<B>,
}

impl<B: Backend> Falcon<B> {
    /// Uploads the weights of one worker's shard ([`Load`]).
    pub fn load(ld: Load<'_, B>, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let (c, backend, max_positions) = (ld.cfg, ld.backend, ld.max_positions);
        let (h, hkv, d, hid, f) = c.layer_sizes();
        let bias = flag(c, "bias");
        let (sh, mut up, total) = ld.start()?;
        let place = ld.place;
        let embed = match place.first_stage() || place.last_stage() {
            true => Some(sh.vocab_table(
                &mut up,
                "transformer.word_embeddings.weight",
                hid,
                c.vocab_size,
            )?),
            false => None,
        };
        progress(1, total);
        let ln = |up: &mut Uploader<B>, name: &str| -> Result<Norm<B>> {
            Ok(Norm::Layer(
                up.weight(&format!("{name}.weight"), &[hid], DType::F32)?,
                up.weight(&format!("{name}.bias"), &[hid], DType::F32)?,
            ))
        };
        // NOTE: a row-parallel projection's bias is added once, by rank 0, before the sum.
        let rank0 = place.tp_rank() == 0;
        let row_bias = |up: &mut Uploader<B>, name: &str| -> Result<Option<B::Buf>> {
            match bias && rank0 {
                true => Ok(Some(up.weight(name, &[hid], DType::F32)?)),
                false => Ok(None),
            }
        };
        let rows = (h + 2 * hkv) * d;
        let mut layers = Vec::with_capacity(place.layers.len());
        for l in place.layers.clone() {
            let n = |s: &str| format!("transformer.h.{l}.{s}");
            let (ln_attn, ln_mlp) = if flag(c, "two_norms") {
                (
                    ln(&mut up, &n("ln_attn"))?,
                    Some(ln(&mut up, &n("ln_mlp"))?),
                )
            } else if flag(c, "parallel_attn") {
                (ln(&mut up, &n("input_layernorm"))?, None)
            } else {
                (
                    ln(&mut up, &n("input_layernorm"))?,
                    Some(ln(&mut up, &n("post_attention_layernorm"))?),
                )
            };
            let wqkv = up
                .fetch_linear(&n("self_attention.query_key_value.weight"), &[rows, hid])?
                .map_dense(|t| reorder_qkv(t, c))?;
            let b_qkv = if bias {
                let b = reorder_qkv(
                    up.fetch(&n("self_attention.query_key_value.bias"), &[rows])?,
                    c,
                );
                let b = sh.qkv_fused(&up, Lin::bias(b))?;
                Some(up.upload_bias(b)?)
            } else {
                None
            };
            let b_up = if bias {
                let b = up.fetch(&n("mlp.dense_h_to_4h.bias"), &[f])?;
                let b = sh.ffn_rows(&up, Lin::bias(b))?;
                Some(up.upload_bias(b)?)
            } else {
                None
            };
            let w_o = sh.o_proj(&up, File(&n("self_attention.dense.weight"), [hid, h * d]))?;
            let w_up = sh.ffn_rows(&up, File(&n("mlp.dense_h_to_4h.weight"), [f, hid]))?;
            let w_down = sh.down(&up, File(&n("mlp.dense_4h_to_h.weight"), [hid, f]))?;
            layers.push(Layer {
                ln_attn,
                ln_mlp,
                w_qkv: up.upload_linear(sh.qkv_fused(&up, Have(wqkv))?)?,
                b_qkv,
                w_o: up.upload_linear(w_o)?,
                b_o: row_bias(&mut up, &n("self_attention.dense.bias"))?,
                w_up: up.upload_linear(w_up)?,
                b_up,
                w_down: up.upload_linear(w_down)?,
                b_down: row_bias(&mut up, &n("mlp.dense_4h_to_h.bias"))?,
            });
            progress(l - place.layers.start + 2, total);
        }
        let head = match place.last_stage() {
            true => {
                let table = (embed.is_some(), "transformer.word_embeddings.weight");
                let head = Head::load(&mut up, &sh, c, table, &ld.head)?;
                Some((ln(&mut up, "transformer.ln_f")?, head))
            }
            false => None,
        };
        progress(total, total);
        // NOTE: Falcon-RW adds the bias to q·k before scaling by 1/sqrt(D): the slopes scaled
        let alibi = flag(c, "alibi").then(|| (8.0, c.attention_scale()));
        let first_head = sh.heads.q.start;
        let positions = Positions::load(backend, c, first_head, alibi, max_positions)?;
        Ok(Falcon {
            stack: Stack::new(c, sh, embed, head, max_positions, up.stats, place),
            layers,
            positions,
        })
    }
}

impl<B: Backend> Family<B> for Falcon<B> {
    fn stack(&self) -> &Stack<B> {
        &self.stack
    }

    fn forward(&self, backend: &B, batch: &DeviceBatch<B>, kv: &mut KvCache<B>) -> Result<B::Buf> {
        let s = &self.stack;
        let (c, tp, t) = (&s.cfg, &s.place.tp, batch.host.num_tokens());
        let (hid, f, ql, eps) = s.sizes();
        let parallel = flag(c, "parallel_attn");
        let mut x = s.input(backend, batch)?; // [T, hidden] residual stream
        let mut ha = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] attention's normed input
        let mut hm = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] the MLP's normed input
        let mut qkv = backend.alloc_scratch_f32(t * ql.row_len())?; // [T, (H + 2 Hkv) D] of this rank
        let mut attn = backend.alloc_scratch_f32(t * ql.q_len())?; // [T, H D]
        let mut u = backend.alloc_scratch_f32(t * f)?; // [T, F]
        let mut oa = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] attention output
        let mut om = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] MLP output

        for (j, w) in self.layers.iter().enumerate() {
            let l = s.place.layers.start + j;
            w.ln_attn.apply(backend, &x, t, hid, eps, &mut ha)?;
            backend.matmul(
                &ha,
                &w.w_qkv,
                w.b_qkv.as_ref(),
                t,
                hid,
                ql.row_len(),
                &mut qkv,
            )?;
            let (rope, opts) = (self.positions.rope(), c.attention_options(l));
            let opts = self.positions.options(opts);
            attend(backend, kv, j, &mut qkv, rope, batch, ql, opts, &mut attn)?;
            backend.matmul(&attn, &w.w_o, w.b_o.as_ref(), t, ql.q_len(), hid, &mut oa)?;
            tp.all_reduce_sum(backend, &mut oa, t * hid)?;
            // The MLP reads: ln_mlp(x) (two norms), the attention's normed input (parallel,
            // one norm), or post_attention_layernorm(x + attention) (sequential).
            let mlp_in = match (&w.ln_mlp, parallel) {
                (Some(n), true) => {
                    n.apply(backend, &x, t, hid, eps, &mut hm)?;
                    &hm
                }
                (None, _) => &ha,
                (Some(n), false) => {
                    backend.add_assign(&mut x, &oa, t * hid)?;
                    n.apply(backend, &x, t, hid, eps, &mut hm)?;
                    &hm
                }
            };
            backend.matmul(mlp_in, &w.w_up, w.b_up.as_ref(), t, hid, f, &mut u)?;
            backend.act(&mut u, t * f, c.hidden_act)?;
            backend.matmul(&u, &w.w_down, w.b_down.as_ref(), t, f, hid, &mut om)?;
            tp.all_reduce_sum(backend, &mut om, t * hid)?;
            if parallel {
                backend.add_assign(&mut x, &oa, t * hid)?;
            }
            backend.add_assign(&mut x, &om, t * hid)?;
        }
        s.output(backend, x, batch)
    }
}
