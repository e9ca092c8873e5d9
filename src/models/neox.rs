//! The LayerNorm families with rotary positions or ALiBi, written once over the [`Backend`]
//! trait: GPT-NeoX (Pythia), GPT-J, StableLM, StarCoder2, Cohere (Command-R), BLOOM and MPT.
//! A layer is
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
//! after reordering Q and K: `rope.rs`), or ALiBi (BLOOM, MPT: no RoPE, a bias on each score
//! by the key's distance). Cohere's and MPT's LayerNorms have no bias (a zero one here);
//! BLOOM's embeddings go through a LayerNorm of their own; MPT may clamp Q, K and V
//! (`clip_qkv`). StableLM (`qk_layernorm`) and Cohere (`use_qk_norm`) may normalise each Q and
//! K head before RoPE: a LayerNorm without bias with weights of its own per head.
//!
//! Shapes: T = tokens in the step, R = rows whose logits are wanted, H = query heads,
//! Hkv = kv heads, D = head_dim, F = intermediate size.

use super::config::{Fields, ModelConfig};
use super::gguf::{GgufFile, GgufTensorName, map_name};
use super::kv_cache::KvCache;
use super::rope::{Positions, reorder_heads};
use super::shard::Head;
use super::shard::Lin::{File, Have};
use super::stack::{Family, Load, Stack};
use super::{Norm, Uploader, Weight, attend};
use crate::backend::{Activation, Backend, DeviceBatch, QkNormSpan};
use crate::tensor::{DType, HostTensor};
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

/// The layer's shape, kept in `extra` for the model: the checkpoint's names ([`Names`]), the
/// residual form, which biases there are.
#[derive(Default)]
struct Shape {
    names: &'static str,
    parallel: bool,
    two_norms: bool,
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool,
    norm_bias: bool,
    /// A LayerNorm without bias of each Q and K head, each its own weights, before RoPE
    /// (StableLM's `qk_layernorm`, Cohere's `use_qk_norm`).
    qk_norm: bool,
}

impl Shape {
    fn set(self, c: &mut ModelConfig) {
        c.extra = json!({
            "names": self.names,
            "parallel": self.parallel,
            "two_norms": self.two_norms,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            "norm_bias": self.norm_bias,
            "qk_norm": self.qk_norm,
            // GPT-NeoX's fused QKV: per head q, k, v in HF files; [q | k | v] in GGUF ones
            "qkv_per_head": matches!(self.names, "gpt_neox" | "bloom"),
        });
    }
}

/// `model_type: gpt_neox`.
pub fn hf_config_gpt_neox(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    hf_rotary(v, c, 0.25)?;
    if c.num_kv_heads != c.num_heads {
        bail!("gpt_neox has one KV head per query head");
    }
    let bias = f.bool("attention_bias")?.unwrap_or(true);
    Shape {
        names: "gpt_neox",
        parallel: f.bool("use_parallel_residual")?.unwrap_or(true),
        two_norms: true,
        qkv_bias: bias,
        o_bias: bias,
        mlp_bias: true,
        norm_bias: true,
        qk_norm: false,
    }
    .set(c);
    Ok(())
}

/// `model_type: stablelm`.
pub fn hf_config_stablelm(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    hf_rotary(v, c, 0.25)?;
    let parallel = f.bool("use_parallel_residual")?.unwrap_or(false);
    Shape {
        names: "stablelm",
        parallel,
        two_norms: !parallel,
        qkv_bias: f.bool("use_qkv_bias")?.unwrap_or(false),
        norm_bias: true,
        qk_norm: f.bool("qk_layernorm")?.unwrap_or(false),
        ..Shape::default()
    }
    .set(c);
    Ok(())
}

/// `model_type: starcoder2`: biases where `use_bias` says, a window where `sliding_window` does.
pub fn hf_config_starcoder2(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let bias = Fields::top(v).bool("use_bias")?.unwrap_or(true);
    c.sliding_window = super::llama::hf_sliding_window(v)?;
    Shape {
        names: "starcoder2",
        parallel: false,
        two_norms: true,
        qkv_bias: bias,
        o_bias: bias,
        mlp_bias: bias,
        norm_bias: true,
        qk_norm: false,
    }
    .set(c);
    Ok(())
}

/// `model_type: cohere`: interleaved RoPE, logits times `logit_scale`.
pub fn hf_config_cohere(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    c.rope_interleaved = true;
    c.logit_scale = Some(f.f64("logit_scale")?.unwrap_or(0.0625));
    let bias = f.bool("attention_bias")?.unwrap_or(false);
    Shape {
        names: "model",
        parallel: true,
        qkv_bias: bias,
        o_bias: bias,
        qk_norm: f.bool("use_qk_norm")?.unwrap_or(false),
        ..Shape::default()
    }
    .set(c);
    Ok(())
}

/// GPT-J's config names the common fields as GPT-2's does; its head is untied by default.
pub fn hf_prepare_gptj(v: &mut Value) -> Result<()> {
    if v["tie_word_embeddings"].is_null() {
        v["tie_word_embeddings"] = false.into();
    }
    super::gpt2::hf_prepare(v)
}

/// `model_type: gptj`: interleaved RoPE over the first `rotary_dim` dimensions of each head
/// (all of them where it is null).
pub fn hf_config_gptj(v: &Value, c: &mut ModelConfig) -> Result<()> {
    c.rope_interleaved = true;
    c.rotary_dim = Fields::top(v)
        .usize("rotary_dim")?
        .filter(|&r| r != c.head_dim);
    Shape {
        names: "gptj",
        parallel: true,
        mlp_bias: true,
        norm_bias: true,
        ..Shape::default()
    }
    .set(c);
    Ok(())
}

/// BLOOM's and MPT's config names, copied to the common ones; their MLPs are 4 (BLOOM) or
/// `expansion_ratio` (MPT) times the hidden size.
pub fn hf_prepare_alibi(v: &mut Value) -> Result<()> {
    for (from, to) in [
        ("n_embed", "hidden_size"),
        ("d_model", "hidden_size"),
        ("n_head", "num_attention_heads"),
        ("n_heads", "num_attention_heads"),
        ("n_layer", "num_hidden_layers"),
        ("n_layers", "num_hidden_layers"),
        ("max_seq_len", "max_position_embeddings"),
        ("layer_norm_epsilon", "rms_norm_eps"),
    ] {
        if !v[from].is_null() && v[to].is_null() {
            v[to] = v[from].clone();
        }
    }
    let f = Fields::top(v);
    let hidden = f.req_usize("hidden_size")?;
    let ratio = f.usize("expansion_ratio")?.unwrap_or(4);
    v["intermediate_size"] = hidden
        .checked_mul(ratio)
        .context("'hidden_size' is too large")?
        .into();
    // NOTE: BLOOM's GELU is the tanh approximation, MPT's the exact one
    let mpt = v["model_type"] == "mpt";
    v["hidden_act"] = if mpt { "gelu" } else { "gelu_pytorch_tanh" }.into();
    if v["tie_word_embeddings"].is_null() {
        v["tie_word_embeddings"] = true.into();
    }
    Ok(())
}

/// `model_type: bloom`: ALiBi, the embeddings' LayerNorm, biases everywhere.
pub fn hf_config_bloom(v: &Value, c: &mut ModelConfig) -> Result<()> {
    if Fields::top(v).bool("apply_residual_connection_post_layernorm")? == Some(true) {
        bail!("bloom with apply_residual_connection_post_layernorm: true is not supported");
    }
    Shape {
        names: "bloom",
        parallel: false,
        two_norms: true,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        norm_bias: true,
        qk_norm: false,
    }
    .set(c);
    c.extra["alibi_max_bias"] = 8.0.into();
    Ok(())
}

/// `model_type: mpt`: ALiBi (`attn_config`), biases unless `no_bias`.
pub fn hf_config_mpt(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let f = Fields::top(v);
    let a = f
        .object("attn_config")?
        .context("mpt's config has no attn_config")?;
    if a.bool("alibi")? != Some(true) {
        bail!("mpt without alibi (learned positions) is not supported");
    }
    if a.bool("qk_ln")? == Some(true) {
        bail!("mpt with qk_ln: true is not supported");
    }
    let bias = !f.bool("no_bias")?.unwrap_or(true);
    Shape {
        names: "mpt",
        parallel: false,
        two_norms: true,
        qkv_bias: bias,
        o_bias: bias,
        mlp_bias: bias,
        norm_bias: bias,
        qk_norm: false,
    }
    .set(c);
    c.attn_scale = a.f64("softmax_scale")?.or(c.attn_scale);
    // NOTE: MPT's own code multiplies the logits by `logit_scale` where it is set
    c.logit_scale = match f.get("logit_scale").as_str() {
        Some("inv_sqrt_d_model") => Some(1.0 / (c.hidden_size as f64).sqrt()),
        _ => f.f64("logit_scale")?,
    };
    c.extra["alibi_max_bias"] = a.f64("alibi_bias_max")?.unwrap_or(8.0).into();
    c.extra["clip_qkv"] = clip_qkv(a.f64("clip_qkv")?)?;
    Ok(())
}

/// MPT's limit on Q, K and V, where it has one: positive and finite.
fn clip_qkv(v: Option<f64>) -> Result<Value> {
    match v {
        Some(c) if !(c > 0.0 && c.is_finite()) => bail!("clip_qkv must be positive, got {c}"),
        v => Ok(v.into()),
    }
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
        None => matches!(arch, "gptneox" | "command-r" | "gptj"),
    };
    let two_norms = has("ffn_norm.weight");
    if !parallel && !two_norms {
        bail!(
            "a sequential {arch} layer needs its MLP norm, but the file has no blk.0.ffn_norm.weight"
        );
    }
    Shape {
        names: match arch {
            "gptneox" => "gpt_neox",
            "starcoder2" => "starcoder2",
            "gptj" => "gptj",
            "bloom" => "bloom",
            "mpt" => "mpt",
            "stablelm" => "stablelm",
            _ => "model",
        },
        parallel,
        two_norms,
        qkv_bias: has("attn_q.bias") || has("attn_qkv.bias"),
        o_bias: has("attn_output.bias"),
        mlp_bias: has("ffn_up.bias"),
        norm_bias: has("attn_norm.bias"),
        qk_norm: has("attn_q_norm.weight"),
    }
    .set(c);
    c.extra["qkv_per_head"] = false.into();
    c.hidden_act = match arch {
        // NOTE: Pythia's "gelu" is the exact one (llama.cpp computes the tanh approximation)
        "gptneox" => Activation::Gelu,
        "starcoder2" | "gptj" | "bloom" => Activation::GeluTanh,
        "mpt" => Activation::Gelu,
        _ => Activation::Silu,
    };
    c.rope_interleaved = matches!(arch, "command-r" | "gptj");
    if matches!(arch, "bloom" | "mpt") {
        let key = format!("{arch}.attention.max_alibi_bias");
        c.extra["alibi_max_bias"] = g.meta_f64(&key)?.unwrap_or(8.0).into();
        c.extra["clip_qkv"] = clip_qkv(g.meta_f64(&format!("{arch}.attention.clamp_kqv"))?)?;
    }
    if arch == "command-r" {
        c.logit_scale = Some(g.meta_f64("command-r.logit_scale")?.unwrap_or(0.0625));
    }
    if let Some(w) = g.meta_usize(&format!("{arch}.attention.sliding_window"))?
        && w > 0
    {
        c.sliding_window = Some(w);
    }
    Ok(())
}

/// The GGUF name of an HF tensor name, by the table of the names it is written in.
pub fn gguf_tensor_name(hf: &str) -> Option<GgufTensorName> {
    ALL.iter().find_map(|n| {
        let head_bias = n.head.replace(".weight", ".bias");
        let en = n.embed_norm.unwrap_or("-");
        let globals = [
            (n.embed, "token_embd.weight"),
            (&format!("{en}.weight"), "token_embd_norm.weight"),
            (&format!("{en}.bias"), "token_embd_norm.bias"),
            (&format!("{}.weight", n.norm), "output_norm.weight"),
            (&format!("{}.bias", n.norm), "output_norm.bias"),
            (n.head, "output.weight"),
            (&head_bias, "output.bias"),
        ];
        let mut blocks = vec![
            (n.ln1, "attn_norm", None),
            (n.ln2, "ffn_norm", None),
            (n.o, "attn_output", None),
            (n.up, "ffn_up", None),
            (n.down, "ffn_down", None),
        ];
        match n.qkv {
            Qkv::Fused(f) => blocks.push((f, "attn_qkv", None)),
            Qkv::Split(q, k, v) => blocks.extend([
                (q, "attn_q", None),
                (k, "attn_k", None),
                (v, "attn_v", None),
            ]),
        }
        if let Some(g) = n.gate {
            blocks.push((g, "ffn_gate", None));
        }
        blocks.extend([
            (n.q_norm, "attn_q_norm", None),
            (n.k_norm, "attn_k_norm", None),
        ]);
        map_name(hf, &globals, n.layers, &blocks)
    })
}

fn flag(c: &ModelConfig, k: &str) -> bool {
    c.extra[k].as_bool().unwrap_or(false)
}

enum Qkv {
    Fused(&'static str),
    Split(&'static str, &'static str, &'static str),
}

/// The checkpoint's tensor names: whole ones (`embed`, `head`), prefixes of a `.weight` and a
/// `.bias` (`norm`), and a layer's modules under `{layers}{N}.`.
struct Names {
    key: &'static str,
    embed: &'static str,
    layers: &'static str,
    norm: &'static str,
    head: &'static str,
    /// A LayerNorm on the embeddings (BLOOM).
    embed_norm: Option<&'static str>,
    ln1: &'static str,
    ln2: &'static str,
    qkv: Qkv,
    o: &'static str,
    gate: Option<&'static str>,
    up: &'static str,
    down: &'static str,
    /// The per-head Q and K norms (read by [`per_head_norm`]).
    q_norm: &'static str,
    k_norm: &'static str,
}

const MODEL: Names = Names {
    key: "model",
    embed: "model.embed_tokens.weight",
    layers: "model.layers.",
    norm: "model.norm",
    head: "lm_head.weight",
    embed_norm: None,
    ln1: "input_layernorm",
    ln2: "post_attention_layernorm",
    qkv: Qkv::Split("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    o: "self_attn.o_proj",
    gate: Some("mlp.gate_proj"),
    up: "mlp.up_proj",
    down: "mlp.down_proj",
    q_norm: "self_attn.q_norm",
    k_norm: "self_attn.k_norm",
};

const ALL: [Names; 7] = [
    MODEL,
    Names {
        key: "stablelm",
        q_norm: "self_attn.q_layernorm",
        k_norm: "self_attn.k_layernorm",
        ..MODEL
    },
    Names {
        key: "starcoder2",
        gate: None,
        up: "mlp.c_fc",
        down: "mlp.c_proj",
        ..MODEL
    },
    Names {
        key: "gpt_neox",
        embed: "gpt_neox.embed_in.weight",
        layers: "gpt_neox.layers.",
        norm: "gpt_neox.final_layer_norm",
        head: "embed_out.weight",
        embed_norm: None,
        ln1: "input_layernorm",
        ln2: "post_attention_layernorm",
        qkv: Qkv::Fused("attention.query_key_value"),
        o: "attention.dense",
        gate: None,
        up: "mlp.dense_h_to_4h",
        down: "mlp.dense_4h_to_h",
        ..MODEL
    },
    Names {
        key: "gptj",
        embed: "transformer.wte.weight",
        layers: "transformer.h.",
        norm: "transformer.ln_f",
        head: "lm_head.weight",
        embed_norm: None,
        ln1: "ln_1",
        ln2: "ln_2",
        qkv: Qkv::Split("attn.q_proj", "attn.k_proj", "attn.v_proj"),
        o: "attn.out_proj",
        gate: None,
        up: "mlp.fc_in",
        down: "mlp.fc_out",
        ..MODEL
    },
    Names {
        key: "bloom",
        embed: "transformer.word_embeddings.weight",
        layers: "transformer.h.",
        norm: "transformer.ln_f",
        head: "lm_head.weight",
        embed_norm: Some("transformer.word_embeddings_layernorm"),
        ln1: "input_layernorm",
        ln2: "post_attention_layernorm",
        qkv: Qkv::Fused("self_attention.query_key_value"),
        o: "self_attention.dense",
        gate: None,
        up: "mlp.dense_h_to_4h",
        down: "mlp.dense_4h_to_h",
        ..MODEL
    },
    Names {
        key: "mpt",
        embed: "transformer.wte.weight",
        layers: "transformer.blocks.",
        norm: "transformer.norm_f",
        head: "lm_head.weight",
        embed_norm: None,
        ln1: "norm_1",
        ln2: "norm_2",
        qkv: Qkv::Fused("attn.Wqkv"),
        o: "attn.out_proj",
        gate: None,
        up: "ffn.up_proj",
        down: "ffn.down_proj",
        ..MODEL
    },
];

/// GPT-NeoX's fused QKV `[(3 H) D, ..]` (weight or bias) as ours: `[q | k | v]` (the HF
/// file's rows are per head q, k, v: `per_head`), Q and K heads in RoPE's order.
fn fused_qkv(w: Weight, c: &ModelConfig, per_head: bool) -> Result<Weight> {
    let order = super::rope::head_order(c);
    w.permute_rows(&super::qkv_rows(
        c.num_heads,
        c.head_dim,
        per_head,
        order.as_deref(),
    ))
}

/// A per-head norm's weights `[heads D]`: one tensor `{m}.weight` (`[heads, D]`: Cohere's, and
/// every GGUF file's, which llama.cpp's converter stacks), or one per head, `{m}.norms.{i}.weight`
/// (StableLM's HF files); in RoPE's order of each head, as Q and K are.
fn per_head_norm<B: Backend>(
    up: &Uploader<B>,
    m: &str,
    heads: usize,
    c: &ModelConfig,
) -> Result<Weight> {
    let d = c.head_dim;
    let t = match up.fetch_opt(&format!("{m}.weight"), &[heads, d])? {
        Some(t) => t,
        None => super::stack(
            (0..heads)
                .map(|i| up.fetch(&format!("{m}.norms.{i}.weight"), &[d]))
                .collect::<Result<_>>()?,
        ),
    };
    let t = HostTensor::new(vec![heads * d], t.data);
    reorder_heads(Weight::dense(t, DType::F32), heads, c)
}

struct Layer<B: Backend> {
    ln1: Norm<B>,
    ln2: Option<Norm<B>>, // the MLP's norm (two norms, or sequential)
    w_qkv: B::Buf,        // [(H + 2 Hkv) D, hidden] of this rank's heads
    b_qkv: Option<B::Buf>,
    qk_norm: Option<(B::Buf, B::Buf)>, // [H D], [Hkv D]: each head's LayerNorm weights
    w_o: B::Buf,                       // [hidden, H D]
    b_o: Option<B::Buf>,               // on tensor rank 0 only (added once to the sum)
    w_up: B::Buf,                      // [F, hidden], or [2 F, hidden] gate and up stacked (gated)
    b_up: Option<B::Buf>,
    w_down: B::Buf,         // [hidden, F]
    b_down: Option<B::Buf>, // on tensor rank 0 only
}

pub struct NeoX<B: Backend> {
    stack: Stack<B>,
    gated: bool,
    layers: Vec<Layer<B>>,
    /// BLOOM's LayerNorm of the embeddings, on the first stage.
    embed_norm: Option<Norm<B>>,
    positions: Positions<B>,
}

impl<B: Backend> NeoX<B> {
    /// Uploads the weights of one worker's shard ([`Load`]).
    pub fn load(ld: Load<'_, B>, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let (c, backend, max_positions) = (ld.cfg, ld.backend, ld.max_positions);
        let (h, hkv, d, hid, f) = c.layer_sizes();
        let key = c.extra["names"].as_str().unwrap_or_default();
        let names = ALL
            .iter()
            .find(|n| n.key == key)
            .context("no tensor names")?;
        let gated = names.gate.is_some();
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
                // NOTE: Cohere's and MPT's LayerNorms have no bias: a zero one
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
        let mut layers = Vec::with_capacity(place.layers.len());
        for l in place.layers.clone() {
            let n = |s: &str| format!("{}{l}.{s}", names.layers);
            let bias = |up: &Uploader<B>, m: &str, rows: usize| -> Result<Weight> {
                Ok(Weight::dense(
                    up.fetch(&n(&format!("{m}.bias")), &[rows])?,
                    DType::F32,
                ))
            };
            let has_qkv_bias = flag(c, "qkv_bias");
            let (w_qkv, b_qkv) = match names.qkv {
                Qkv::Fused(m) => {
                    let per_head = flag(c, "qkv_per_head");
                    let rows = (h + 2 * hkv) * d;
                    let w = up.fetch_linear(&n(&format!("{m}.weight")), &[rows, hid])?;
                    let w = sh.qkv_fused(&up, Have(fused_qkv(w, c, per_head)?))?;
                    let b = match has_qkv_bias {
                        true => {
                            let b = fused_qkv(bias(&up, m, rows)?, c, per_head)?;
                            Some(sh.qkv_fused(&up, Have(b))?)
                        }
                        false => None,
                    };
                    (w, b)
                }
                Qkv::Split(qm, km, vm) => {
                    let q = up.fetch_linear(&n(&format!("{qm}.weight")), &[h * d, hid])?;
                    let k = up.fetch_linear(&n(&format!("{km}.weight")), &[hkv * d, hid])?;
                    let w = sh.qkv(
                        &up,
                        Have(reorder_heads(q, h, c)?),
                        Have(reorder_heads(k, hkv, c)?),
                        File(&n(&format!("{vm}.weight")), [hkv * d, hid]),
                    )?;
                    let b = match has_qkv_bias {
                        true => {
                            let q = reorder_heads(bias(&up, qm, h * d)?, h, c)?;
                            let k = reorder_heads(bias(&up, km, hkv * d)?, hkv, c)?;
                            let v = bias(&up, vm, hkv * d)?;
                            Some(sh.qkv(&up, Have(q), Have(k), Have(v))?)
                        }
                        false => None,
                    };
                    (w, b)
                }
            };
            let b_qkv = b_qkv.map(|b| up.upload_bias(b)).transpose()?;
            let qk_norm = match flag(c, "qk_norm") {
                true => {
                    let q = per_head_norm(&up, &n(names.q_norm), h, c)?;
                    let k = per_head_norm(&up, &n(names.k_norm), hkv, c)?;
                    let (q, k) = sh.qk_rows(q, k)?;
                    Some((up.upload_bias(q)?, up.upload_bias(k)?))
                }
                false => None,
            };
            let w_o = sh.o_proj(&up, File(&n(&format!("{}.weight", names.o)), [hid, h * d]))?;
            let up_w = n(&format!("{}.weight", names.up));
            let w_up = match names.gate {
                Some(g) => sh.gate_up(
                    &up,
                    File(&n(&format!("{g}.weight")), [f, hid]),
                    File(&up_w, [f, hid]),
                )?,
                None => sh.ffn_rows(&up, File(&up_w, [f, hid]))?,
            };
            let b_up = match flag(c, "mlp_bias") {
                true => {
                    let b = sh.ffn_rows(&up, Have(bias(&up, names.up, f)?))?;
                    Some(up.upload_bias(b)?)
                }
                false => None,
            };
            let w_down = sh.down(&up, File(&n(&format!("{}.weight", names.down)), [hid, f]))?;
            let ln2 = match flag(c, "two_norms") {
                true => Some(ln(&mut up, &n(names.ln2))?),
                false => None,
            };
            let (o_bias, down_bias) = (
                n(&format!("{}.bias", names.o)),
                n(&format!("{}.bias", names.down)),
            );
            layers.push(Layer {
                ln1: ln(&mut up, &n(names.ln1))?,
                ln2,
                w_qkv: up.upload_linear(w_qkv)?,
                b_qkv,
                qk_norm,
                w_o: up.upload_linear(w_o)?,
                b_o: row_bias(&mut up, &o_bias, flag(c, "o_bias"))?,
                w_up: up.upload_linear(w_up)?,
                b_up,
                w_down: up.upload_linear(w_down)?,
                b_down: row_bias(&mut up, &down_bias, flag(c, "mlp_bias"))?,
            });
            progress(l - place.layers.start + 2, total);
        }
        let embed_norm = match (names.embed_norm, place.first_stage()) {
            (Some(name), true) => Some(ln(&mut up, name)?),
            _ => None,
        };
        let head = match place.last_stage() {
            true => {
                let table = (embed.is_some(), names.embed);
                let head = Head::load_named(&mut up, &sh, c, names.head, table, &ld.head)?;
                Some((ln(&mut up, names.norm)?, head))
            }
            false => None,
        };
        progress(total, total);
        let alibi = c.extra["alibi_max_bias"].as_f64().map(|b| (b, 1.0));
        let first_head = sh.heads.q.start;
        let positions = Positions::load(backend, c, first_head, alibi, max_positions)?;
        Ok(NeoX {
            gated,
            embed_norm,
            stack: Stack::new(c, sh, embed, head, max_positions, up.stats, place),
            layers,
            positions,
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
        let parallel = flag(c, "parallel");
        let clip_qkv = c.extra["clip_qkv"].as_f64().map(|v| v as f32);
        let gated = self.gated;
        let mut x = s.input(backend, batch)?; // [T, hidden] residual stream
        let mut ha = backend.alloc_scratch_f32(t * hid)?; // [T, hidden] ln1(x)
        if let Some(n) = &self.embed_norm {
            n.apply(backend, &x, t, hid, eps, &mut ha)?;
            std::mem::swap(&mut x, &mut ha);
        }
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
            if let Some(clip) = clip_qkv {
                backend.clamp(&mut qkv, clip, t * n)?;
            }
            if let Some((qn, kn)) = &w.qk_norm {
                backend.qk_norm(&mut qkv, qn, kn, t, ql, QkNormSpan::HeadLayer, eps)?;
            }
            let (rope, opts) = (self.positions.rope(), c.attention_options(l));
            let opts = self.positions.options(opts);
            attend(backend, kv, j, &mut qkv, rope, batch, ql, opts, &mut attn)?;
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

#[cfg(test)]
mod tests {
    use crate::models::registry::hf_config;
    use serde_json::json;

    /// The configs on the hub predate transformers 5's `rope_parameters`: Pythia's
    /// `rotary_pct` and `rotary_emb_base`, StableLM's top-level `partial_rotary_factor` and
    /// `rope_theta`, GPT-J's `rotary_dim`, BLOOM's and MPT's own names; what is not supported
    /// is refused by name.
    #[test]
    fn hub_configs_read_as_their_families_mean_them() {
        let neox = hf_config(&json!({
            "model_type": "gpt_neox", "hidden_size": 512, "num_attention_heads": 8,
            "intermediate_size": 2048, "num_hidden_layers": 6, "vocab_size": 50304,
            "rotary_pct": 0.25, "rotary_emb_base": 10000, "layer_norm_eps": 1e-5,
            "use_parallel_residual": true, "hidden_act": "gelu",
        }))
        .unwrap();
        assert_eq!((neox.rotary_dim, neox.rope_interleaved), (Some(16), false));
        assert_eq!((neox.rope_theta, neox.rms_norm_eps), (10000.0, 1e-5));
        assert_eq!(neox.extra["qkv_per_head"], true);
        let stablelm = json!({
            "model_type": "stablelm", "hidden_size": 2048, "num_attention_heads": 32,
            "num_key_value_heads": 32, "intermediate_size": 5632, "num_hidden_layers": 24,
            "vocab_size": 100352, "partial_rotary_factor": 0.25, "rope_theta": 10000,
            "layer_norm_eps": 1e-5, "use_qkv_bias": true,
        });
        let c = hf_config(&stablelm).unwrap();
        assert_eq!(
            (c.rotary_dim, c.extra["qkv_bias"].as_bool()),
            (Some(16), Some(true))
        );
        let mut qk = stablelm.clone();
        qk["qk_layernorm"] = true.into();
        assert_eq!(hf_config(&qk).unwrap().extra["qk_norm"], true);
        let gptj = hf_config(&json!({
            "model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_layer": 28,
            "n_positions": 2048, "rotary_dim": 64, "vocab_size": 50400,
            "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
        }))
        .unwrap();
        assert_eq!((gptj.rotary_dim, gptj.rope_interleaved), (Some(64), true));
        assert!(!gptj.tie_word_embeddings, "GPT-J's head is its own");
        let cohere = json!({
            "model_type": "cohere", "hidden_size": 8192, "num_attention_heads": 64,
            "num_key_value_heads": 8, "intermediate_size": 22528, "num_hidden_layers": 40,
            "vocab_size": 256000, "layer_norm_eps": 1e-5, "logit_scale": 0.0625,
            "rope_theta": 8000000.0,
        });
        let c = hf_config(&cohere).unwrap();
        assert_eq!(
            (c.logit_scale, c.rope_interleaved, c.rotary_dim),
            (Some(0.0625), true, None)
        );
        let mut plus = cohere.clone();
        plus["use_qk_norm"] = true.into();
        assert_eq!(hf_config(&plus).unwrap().extra["qk_norm"], true);
        let mut odd = cohere;
        odd["model_type"] = "stablelm".into();
        odd["partial_rotary_factor"] = 0.3.into(); // 128 · 0.3 = 38.4: 38 dimensions
        assert_eq!(hf_config(&odd).unwrap().rotary_dim, Some(38));
        odd["partial_rotary_factor"] = 1.5.into();
        assert!(hf_config(&odd).is_err());
        // BLOOM's and MPT's names; what MPT has and this graph has not is refused by name
        let bloom = hf_config(&json!({
            "model_type": "bloom", "n_embed": 1024, "n_head": 16, "n_layer": 24,
            "vocab_size": 250880, "layer_norm_epsilon": 1e-5,
        }))
        .unwrap();
        assert_eq!((bloom.intermediate_size, bloom.num_layers), (4096, 24));
        assert_eq!(bloom.extra["alibi_max_bias"], 8.0);
        assert!(bloom.tie_word_embeddings);
        let mpt = json!({
            "model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32,
            "expansion_ratio": 4, "max_seq_len": 2048, "vocab_size": 50432, "no_bias": true,
            "attn_config": {"alibi": true, "alibi_bias_max": 8, "clip_qkv": null},
            "logit_scale": "inv_sqrt_d_model",
        });
        let c = hf_config(&mpt).unwrap();
        assert_eq!(
            (c.intermediate_size, c.max_position_embeddings),
            (16384, 2048)
        );
        assert_eq!(c.logit_scale, Some(1.0 / 64.0));
        let mut clip = mpt.clone();
        clip["attn_config"]["clip_qkv"] = json!(6.0);
        assert_eq!(hf_config(&clip).unwrap().extra["clip_qkv"], 6.0);
        for (key, value, says) in [
            ("clip_qkv", json!(-1.0), "clip_qkv must be positive"),
            ("alibi", json!(false), "without alibi"),
            ("qk_ln", json!(true), "qk_ln"),
        ] {
            let mut bad = mpt.clone();
            bad["attn_config"][key] = value;
            let e = hf_config(&bad).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        // a Llama with partial rotary would need its loader to reorder Q and K: refused
        let e = hf_config(&json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 16,
        }))
        .map(|mut c| {
            c.rotary_dim = Some(8);
            c.validate()
        })
        .unwrap()
        .unwrap_err()
        .to_string();
        assert!(e.contains("not supported for llama"), "{e}");
    }
}
