//! The LayerNorm families with rotary positions, written once over the [`Backend`] trait:
//! GPT-NeoX (Pythia), StableLM, StarCoder2 and Cohere (Command-R). A layer is
//!
//! ```text
//!   sequential (StarCoder2, StableLM):  x += attn(ln1(x));  x += mlp(ln2(x))
//!   parallel, two norms (GPT-NeoX):     x += attn(ln1(x)) + mlp(ln2(x))
//!   parallel, one norm (Cohere, StableLM with use_parallel_residual):
//!                                       x += attn(ln1(x)) + mlp(ln1(x))
//! ```
//!
//! with a plain (up, activation, down) or gated (SwiGLU) MLP, biases where the family has them,
//! and RoPE over all or part of each head, paired by halves or interleaved (the one RoPE op
//! after reordering Q and K: `rope.rs`). Cohere's LayerNorm has no bias (a zero one here).
//!
//! Shapes: T = tokens in the step, R = rows whose logits are wanted, H = query heads,
//! Hkv = kv heads, D = head_dim, F = intermediate size.

use super::config::{Fields, ModelConfig};
use super::gguf::{GgufFile, GgufTensorName, map_name};
use super::kv_cache::KvCache;
use super::rope::reorder_heads;
use super::shard::Head;
use super::shard::Lin::{File, Have};
use super::stack::{Family, Load, Stack};
use super::{Norm, Uploader, Weight, attend};
use crate::backend::{Activation, Backend, DeviceBatch};
use crate::tensor::DType;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// The families' own config keys, copied to the common names.
pub fn hf_prepare(v: &mut Value) -> Result<()> {
    for (from, to) in [
        ("layer_norm_eps", "rms_norm_eps"),
        ("norm_epsilon", "rms_norm_eps"),
        ("rotary_emb_base", "rope_theta"),
    ] {
        if !v[from].is_null() && v[to].is_null() {
            v[to] = v[from].clone();
        }
    }
    Ok(())
}

/// The part of each head RoPE rotates: `partial_rotary_factor` (top level or in
/// `rope_parameters`) or GPT-NeoX's `rotary_pct`, else `default`; rounded down as transformers
/// does.
fn hf_rotary(v: &Value, c: &mut ModelConfig, default: f64) -> Result<()> {
    let f = Fields::top(v);
    let nested = match f.object("rope_parameters")? {
        Some(p) => p.f64("partial_rotary_factor")?,
        None => None,
    };
    let factor = match (
        f.f64("partial_rotary_factor")?,
        f.f64("rotary_pct")?,
        nested,
    ) {
        (Some(p), _, _) | (None, Some(p), _) | (None, None, Some(p)) => p,
        (None, None, None) => default,
    };
    if !(factor > 0.0 && factor <= 1.0) {
        bail!("the partial rotary factor must be in (0, 1], got {factor}");
    }
    let r = (c.head_dim as f64 * factor) as usize;
    c.rotary_dim = (r != c.head_dim).then_some(r);
    Ok(())
}

/// The layer's shape, kept in `extra`.
#[allow(clippy::too_many_arguments)]
fn shape(
    c: &mut ModelConfig,
    gpt_neox_names: bool,
    gated: bool,
    parallel: bool,
    two_norms: bool,
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool,
    norm_bias: bool,
) {
    c.extra = json!({
        "gpt_neox_names": gpt_neox_names,
        "gated": gated,
        "parallel": parallel,
        "two_norms": two_norms,
        "qkv_bias": qkv_bias,
        "o_bias": o_bias,
        "mlp_bias": mlp_bias,
        "norm_bias": norm_bias,
        // GPT-NeoX's fused QKV: per head q, k, v in HF files; [q | k | v] in GGUF ones
        "qkv_per_head": gpt_neox_names,
    });
}

/// `model_type: gpt_neox`.
pub fn hf_config_gpt_neox(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    hf_rotary(v, c, 0.25)?;
    if c.num_kv_heads != c.num_heads {
        bail!("gpt_neox has one KV head per query head");
    }
    let parallel = f.bool("use_parallel_residual")?.unwrap_or(true);
    let bias = f.bool("attention_bias")?.unwrap_or(true);
    shape(c, true, false, parallel, true, bias, bias, true, true);
    Ok(())
}

/// `model_type: stablelm`.
pub fn hf_config_stablelm(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    if f.bool("qk_layernorm")? == Some(true) {
        bail!("stablelm with qk_layernorm: true (per-head Q/K LayerNorm) is not supported");
    }
    hf_rotary(v, c, 0.25)?;
    let parallel = f.bool("use_parallel_residual")?.unwrap_or(false);
    let qkv_bias = f.bool("use_qkv_bias")?.unwrap_or(false);
    shape(
        c, false, true, parallel, !parallel, qkv_bias, false, false, true,
    );
    Ok(())
}

/// `model_type: starcoder2`: biases where `use_bias` says, a window where `sliding_window` does.
pub fn hf_config_starcoder2(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let bias = Fields::top(v).bool("use_bias")?.unwrap_or(true);
    c.sliding_window = super::llama::hf_sliding_window(v)?;
    shape(c, false, false, false, true, bias, bias, bias, true);
    Ok(())
}

/// `model_type: cohere`: interleaved RoPE, logits times `logit_scale`.
pub fn hf_config_cohere(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    if f.bool("use_qk_norm")? == Some(true) {
        bail!("cohere with use_qk_norm: true (Command R+) is not supported");
    }
    c.rope_interleaved = true;
    c.logit_scale = Some(f.f64("logit_scale")?.unwrap_or(0.0625));
    let bias = f.bool("attention_bias")?.unwrap_or(false);
    shape(c, false, true, true, false, bias, bias, false, false);
    Ok(())
}

/// llama.cpp's files of these families: `gptneox`, `stablelm`, `starcoder2` and `command-r`.
/// Which biases and norms exist is read off layer 0's tensors.
pub fn gguf_config(g: &GgufFile, arch: &str, c: &mut ModelConfig) -> Result<()> {
    c.rms_norm_eps = super::gpt2::layer_norm_eps(g, arch)?;
    let has = |t: &str| g.tensor_info(&format!("blk.0.{t}")).is_some();
    let parallel = match g.metadata().get(&format!("{arch}.use_parallel_residual")) {
        Some(v) => v
            .as_bool()
            .with_context(|| format!("metadata '{arch}.use_parallel_residual' is not a bool"))?,
        None => matches!(arch, "gptneox" | "command-r"),
    };
    let q_bias = has("attn_q.bias") || has("attn_qkv.bias");
    let (o_bias, mlp_bias) = (has("attn_output.bias"), has("ffn_up.bias"));
    let (norm_bias, two_norms) = (has("attn_norm.bias"), has("ffn_norm.weight"));
    let gated = has("ffn_gate.weight");
    let neox = arch == "gptneox";
    if !parallel && !two_norms {
        bail!(
            "a sequential {arch} layer needs its MLP norm, but the file has no blk.0.ffn_norm.weight"
        );
    }
    shape(
        c, neox, gated, parallel, two_norms, q_bias, o_bias, mlp_bias, norm_bias,
    );
    c.extra["qkv_per_head"] = false.into();
    c.hidden_act = match arch {
        // NOTE: Pythia's "gelu" is the exact one (llama.cpp computes the tanh approximation)
        "gptneox" => Activation::Gelu,
        "starcoder2" => Activation::GeluTanh,
        _ => Activation::Silu,
    };
    if arch == "command-r" {
        c.rope_interleaved = true;
        c.logit_scale = Some(g.meta_f64("command-r.logit_scale")?.unwrap_or(0.0625));
    }
    if let Some(w) = g.meta_usize(&format!("{arch}.attention.sliding_window"))?
        && w > 0
    {
        c.sliding_window = Some(w);
    }
    Ok(())
}

pub fn gguf_tensor_name(hf: &str) -> Option<GgufTensorName> {
    let blocks = [
        ("input_layernorm", "attn_norm", None),
        ("post_attention_layernorm", "ffn_norm", None),
        ("self_attn.q_proj", "attn_q", None),
        ("self_attn.k_proj", "attn_k", None),
        ("self_attn.v_proj", "attn_v", None),
        ("self_attn.o_proj", "attn_output", None),
        ("attention.query_key_value", "attn_qkv", None),
        ("attention.dense", "attn_output", None),
        ("mlp.gate_proj", "ffn_gate", None),
        ("mlp.up_proj", "ffn_up", None),
        ("mlp.down_proj", "ffn_down", None),
        ("mlp.c_fc", "ffn_up", None),
        ("mlp.c_proj", "ffn_down", None),
        ("mlp.dense_h_to_4h", "ffn_up", None),
        ("mlp.dense_4h_to_h", "ffn_down", None),
    ];
    let globals = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("model.norm.bias", "output_norm.bias"),
        ("lm_head.weight", "output.weight"),
        ("gpt_neox.embed_in.weight", "token_embd.weight"),
        ("gpt_neox.final_layer_norm.weight", "output_norm.weight"),
        ("gpt_neox.final_layer_norm.bias", "output_norm.bias"),
        ("embed_out.weight", "output.weight"),
    ];
    let prefix = match hf.starts_with("gpt_neox.") {
        true => "gpt_neox.layers.",
        false => "model.layers.",
    };
    map_name(hf, &globals, prefix, &blocks)
}

fn flag(c: &ModelConfig, k: &str) -> bool {
    c.extra[k].as_bool().unwrap_or(false)
}

/// The checkpoint's tensor names.
struct Names {
    embed: &'static str,
    layers: &'static str,
    norm: &'static str,
    head: &'static str,
}

const GPT_NEOX: Names = Names {
    embed: "gpt_neox.embed_in.weight",
    layers: "gpt_neox.layers.",
    norm: "gpt_neox.final_layer_norm",
    head: "embed_out.weight",
};

const MODEL: Names = Names {
    embed: "model.embed_tokens.weight",
    layers: "model.layers.",
    norm: "model.norm",
    head: "lm_head.weight",
};

/// GPT-NeoX's fused QKV `[(3 H) D, ..]` (weight or bias) as ours: per head q, k, v rows to
/// `[q | k | v]` (`per_head`; GGUF files have it already), Q and K heads in RoPE's order.
fn fused_qkv(w: Weight, c: &ModelConfig, per_head: bool) -> Result<Weight> {
    let (h, d) = (c.num_heads, c.head_dim);
    let order = super::rope::head_order(c).unwrap_or_else(|| (0..d).collect());
    let rows: Vec<usize> = (0..3 * h)
        .flat_map(|dst| {
            let (part, head) = (dst / h, dst % h);
            let src = match per_head {
                true => head * 3 + part,
                false => dst,
            };
            let order = &order;
            (0..d).map(move |j| src * d + if part < 2 { order[j] } else { j })
        })
        .collect();
    w.permute_rows(&rows)
}

struct Layer<B: Backend> {
    ln1: Norm<B>,
    ln2: Option<Norm<B>>, // the MLP's norm (two norms, or sequential)
    w_qkv: B::Buf,        // [(H + 2 Hkv) D, hidden] of this rank's heads
    b_qkv: Option<B::Buf>,
    w_o: B::Buf,         // [hidden, H D]
    b_o: Option<B::Buf>, // on tensor rank 0 only (added once to the sum)
    w_up: B::Buf,        // [F, hidden], or [2 F, hidden] gate and up stacked (gated)
    b_up: Option<B::Buf>,
    w_down: B::Buf,         // [hidden, F]
    b_down: Option<B::Buf>, // on tensor rank 0 only
}

pub struct NeoX<B: Backend> {
    stack: Stack<B>,
    layers: Vec<Layer<B>>,
    rope_cos: B::Buf, // [max_positions, D / 2]
    rope_sin: B::Buf,
}

impl<B: Backend> NeoX<B> {
    /// Uploads the weights of one worker's shard ([`Load`]).
    pub fn load(ld: Load<'_, B>, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let (c, backend, max_positions) = (ld.cfg, ld.backend, ld.max_positions);
        let (h, hkv, d, hid, f) = c.layer_sizes();
        let names = if flag(c, "gpt_neox_names") {
            &GPT_NEOX
        } else {
            &MODEL
        };
        let gated = flag(c, "gated");
        let (sh, mut up, total) = ld.start()?;
        let place = ld.place;
        let embed = match place.first_stage() || (c.tie_word_embeddings && place.last_stage()) {
            true => Some(sh.vocab_table(&mut up, names.embed, hid, c.vocab_size)?),
            false => None,
        };
        progress(1, total);
        let ln = |up: &mut Uploader<B>, name: &str| -> Result<Norm<B>> {
            let w = up.weight(&format!("{name}.weight"), &[hid], DType::F32)?;
            let b = match flag(c, "norm_bias") {
                true => up.weight(&format!("{name}.bias"), &[hid], DType::F32)?,
                // NOTE: Cohere's LayerNorm has no bias: a zero one
                false => up.backend.upload_f32(&vec![0.0; hid])?,
            };
            Ok(Norm::Layer(w, b))
        };
        // NOTE: a row-parallel projection's bias is added once, by rank 0, before the sum.
        let rank0 = place.tp_rank() == 0;
        let row_bias = |up: &mut Uploader<B>, name: &str, has: bool| -> Result<Option<B::Buf>> {
            match has && rank0 {
                true => Ok(Some(up.weight(name, &[hid], DType::F32)?)),
                false => Ok(None),
            }
        };
        let bias = |up: &mut Uploader<B>, w: Weight| -> Result<Option<B::Buf>> {
            Ok(Some(up.upload_bias(w)?))
        };
        let mut layers = Vec::with_capacity(place.layers.len());
        for l in place.layers.clone() {
            let n = |s: &str| format!("{}{l}.{s}", names.layers);
            let (w_qkv, b_qkv, w_o, o_name, up_name, down_name);
            if flag(c, "gpt_neox_names") {
                let per_head = flag(c, "qkv_per_head");
                let rows = (h + 2 * hkv) * d;
                let w = up.fetch_linear(&n("attention.query_key_value.weight"), &[rows, hid])?;
                w_qkv = sh.qkv_fused(&up, Have(fused_qkv(w, c, per_head)?))?;
                b_qkv = match flag(c, "qkv_bias") {
                    true => {
                        let b = up.fetch(&n("attention.query_key_value.bias"), &[rows])?;
                        let b = fused_qkv(Weight::dense(b, DType::F32), c, per_head)?;
                        let b = sh.qkv_fused(&up, Have(b))?;
                        bias(&mut up, b)?
                    }
                    false => None,
                };
                o_name = n("attention.dense");
                (up_name, down_name) = (n("mlp.dense_h_to_4h"), n("mlp.dense_4h_to_h"));
            } else {
                let q = up.fetch_linear(&n("self_attn.q_proj.weight"), &[h * d, hid])?;
                let k = up.fetch_linear(&n("self_attn.k_proj.weight"), &[hkv * d, hid])?;
                w_qkv = sh.qkv(
                    &up,
                    Have(reorder_heads(q, h, c)?),
                    Have(reorder_heads(k, hkv, c)?),
                    File(&n("self_attn.v_proj.weight"), [hkv * d, hid]),
                )?;
                b_qkv = match flag(c, "qkv_bias") {
                    true => {
                        let b = |s: &str, heads: usize| -> Result<Weight> {
                            let t = up.fetch(&n(&format!("self_attn.{s}.bias")), &[heads * d])?;
                            reorder_heads(Weight::dense(t, DType::F32), heads, c)
                        };
                        let v = up.fetch(&n("self_attn.v_proj.bias"), &[hkv * d])?;
                        let v = Weight::dense(v, DType::F32);
                        let b =
                            sh.qkv(&up, Have(b("q_proj", h)?), Have(b("k_proj", hkv)?), Have(v))?;
                        bias(&mut up, b)?
                    }
                    false => None,
                };
                o_name = n("self_attn.o_proj");
                (up_name, down_name) = match gated {
                    true => (n("mlp.up_proj"), n("mlp.down_proj")),
                    false => (n("mlp.c_fc"), n("mlp.c_proj")),
                };
            }
            w_o = sh.o_proj(&up, File(&format!("{o_name}.weight"), [hid, h * d]))?;
            let w_up = match gated {
                true => sh.gate_up(
                    &up,
                    File(&n("mlp.gate_proj.weight"), [f, hid]),
                    File(&format!("{up_name}.weight"), [f, hid]),
                )?,
                false => sh.ffn_rows(&up, File(&format!("{up_name}.weight"), [f, hid]))?,
            };
            let b_up = match flag(c, "mlp_bias") {
                true => {
                    let b = up.fetch(&format!("{up_name}.bias"), &[f])?;
                    let b = sh.ffn_rows(&up, Have(Weight::dense(b, DType::F32)))?;
                    bias(&mut up, b)?
                }
                false => None,
            };
            let w_down = sh.down(&up, File(&format!("{down_name}.weight"), [hid, f]))?;
            let ln2 = match flag(c, "two_norms") {
                true => Some(ln(&mut up, &n("post_attention_layernorm"))?),
                false => None,
            };
            layers.push(Layer {
                ln1: ln(&mut up, &n("input_layernorm"))?,
                ln2,
                w_qkv: up.upload_linear(w_qkv)?,
                b_qkv,
                w_o: up.upload_linear(w_o)?,
                b_o: row_bias(&mut up, &format!("{o_name}.bias"), flag(c, "o_bias"))?,
                w_up: up.upload_linear(w_up)?,
                b_up,
                w_down: up.upload_linear(w_down)?,
                b_down: row_bias(&mut up, &format!("{down_name}.bias"), flag(c, "mlp_bias"))?,
            });
            progress(l - place.layers.start + 2, total);
        }
        let head = match place.last_stage() {
            true => {
                let table = (embed.is_some(), names.embed);
                let head = Head::load_named(&mut up, &sh, c, names.head, table, &ld.head)?;
                Some((ln(&mut up, names.norm)?, head))
            }
            false => None,
        };
        progress(total, total);
        let (cos, sin) = super::rope::tables(c, c.rope_theta, max_positions);
        Ok(NeoX {
            stack: Stack::new(c, sh, embed, head, max_positions, up.stats, place),
            layers,
            rope_cos: backend.upload_f32(&cos)?,
            rope_sin: backend.upload_f32(&sin)?,
        })
    }
}

impl<B: Backend> Family<B> for NeoX<B> {
    fn stack(&self) -> &Stack<B> {
        &self.stack
    }

    fn forward(&self, backend: &B, batch: &DeviceBatch<B>, kv: &mut KvCache<B>) -> Result<B::Buf> {
        let s = &self.stack;
        let (c, tp, t) = (&s.cfg, &s.place.tp, batch.host.num_tokens());
        let (hid, f, ql, eps) = s.sizes();
        let (parallel, gated) = (flag(c, "parallel"), flag(c, "gated"));
        let mut x = s.input(backend, batch)?; // [T, hidden] residual stream
        let mut ha = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] ln1(x)
        let mut hm = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] ln2(x)
        let mut qkv = backend.alloc_scratch_f32(t * ql.row_len())?; // [T, (H + 2 Hkv) D] of this rank
        let mut attn = backend.alloc_scratch_f32(t * ql.q_len())?; // [T, H D]
        let mut gu = backend.alloc_scratch_f32(t * if gated { 2 * f } else { f })?; // [T, F] or [T, 2 F]
        let mut act = backend.alloc_scratch_f32(t * f)?; // [T, F] (gated)
        let mut oa = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] attention output
        let mut om = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] MLP output

        for (j, w) in self.layers.iter().enumerate() {
            let l = s.place.layers.start + j;
            w.ln1.apply(backend, &x, t, hid, eps, &mut ha)?;
            let n = ql.row_len();
            backend.matmul(&ha, &w.w_qkv, w.b_qkv.as_ref(), t, hid, n, &mut qkv)?;
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
            backend.matmul(&attn, &w.w_o, w.b_o.as_ref(), t, ql.q_len(), hid, &mut oa)?;
            tp.all_reduce_sum(backend, &mut oa, t * hid)?;
            let mlp_in = match (&w.ln2, parallel) {
                (None, _) => &ha,
                (Some(n), true) => {
                    n.apply(backend, &x, t, hid, eps, &mut hm)?;
                    &hm
                }
                (Some(n), false) => {
                    backend.add_assign(&mut x, &oa, t * hid)?;
                    n.apply(backend, &x, t, hid, eps, &mut hm)?;
                    &hm
                }
            };
            let down_in = match gated {
                true => {
                    let a = c.hidden_act;
                    backend.matmul_gated_act(mlp_in, &w.w_up, t, hid, f, a, &mut gu, &mut act)?;
                    &act
                }
                false => {
                    backend.matmul(mlp_in, &w.w_up, w.b_up.as_ref(), t, hid, f, &mut gu)?;
                    backend.act(&mut gu, t * f, c.hidden_act)?;
                    &gu
                }
            };
            backend.matmul(down_in, &w.w_down, w.b_down.as_ref(), t, f, hid, &mut om)?;
            tp.all_reduce_sum(backend, &mut om, t * hid)?;
            if parallel {
                backend.add_assign(&mut x, &oa, t * hid)?;
            }
            backend.add_assign(&mut x, &om, t * hid)?;
        }
        s.output(backend, x, batch)
    }
}
