//! GPT-2 (`gpt2`): learned position embeddings, LayerNorm with bias before attention and MLP,
//! a plain MLP with GELU (tanh), biases on every projection, no RoPE; `Conv1D` weights are
//! stored `[in, out]` and transposed once at load. GPT-BigCode (`gpt_bigcode`, StarCoder and
//! SantaCoder) is the same graph with multi-query attention (one KV head) and `Linear` weights
//! (`[out, in]`), tied or not.
//!
//! Shapes: T = tokens in the step, R = rows whose logits are wanted, H = heads, D = head_dim,
//! F = inner size (4 × hidden by default).

use super::config::{Fields, ModelConfig};
use super::gguf::{GgufFile, GgufFix, GgufTensorName, map_name};
use super::kv_cache::KvCache;
use super::shard::Head;
use super::shard::Lin::Have;
use super::stack::{Family, Load, Stack};
use super::{Norm, Uploader, Weight, attend};
use crate::backend::{Backend, DeviceBatch};
use crate::tensor::{DType, HostTensor};
use anyhow::{Context, Result, bail};
use serde_json::Value;

/// GPT-2's config names the common fields its own way (`n_embd`, `n_head`, ...): they are
/// copied to the common names before the common parse.
pub fn hf_prepare(v: &mut Value) -> Result<()> {
    let f = Fields::top(v);
    let hidden = f.u64("n_embd")?;
    let inner = f.u64("n_inner")?;
    for k in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
        if f.bool(k)? == Some(true) {
            bail!("GPT-2 with {k}: true is not supported");
        }
    }
    if f.bool("scale_attn_weights")? == Some(false) {
        bail!("GPT-2 with scale_attn_weights: false is not supported");
    }
    for (from, to) in [
        ("n_embd", "hidden_size"),
        ("n_head", "num_attention_heads"),
        ("n_layer", "num_hidden_layers"),
        ("n_positions", "max_position_embeddings"),
        ("layer_norm_epsilon", "rms_norm_eps"),
        ("activation_function", "hidden_act"),
    ] {
        if !v[from].is_null() {
            v[to] = v[from].clone();
        }
    }
    v["intermediate_size"] = match (inner, hidden) {
        (Some(n), _) => n.into(),
        (None, Some(h)) => h.checked_mul(4).context("'n_embd' is too large")?.into(),
        (None, None) => bail!("config.json lacks the integer 'n_embd'"),
    };
    if v["tie_word_embeddings"].is_null() {
        v["tie_word_embeddings"] = true.into();
    }
    Ok(())
}

pub fn hf_config(_v: &Value, _c: &mut ModelConfig) -> Result<()> {
    Ok(())
}

/// GPT-BigCode: GPT-2's names, one KV head with `multi_query` (its default).
pub fn hf_prepare_bigcode(v: &mut Value) -> Result<()> {
    let multi_query = Fields::top(v).bool("multi_query")?.unwrap_or(true);
    hf_prepare(v)?;
    if multi_query {
        v["num_key_value_heads"] = 1.into();
    }
    Ok(())
}

/// GPT-BigCode: `Linear` weights; without multi-query, its fused QKV rows are per head.
pub fn hf_config_bigcode(v: &Value, c: &mut ModelConfig) -> Result<()> {
    let multi_query = Fields::top(v).bool("multi_query")?.unwrap_or(true);
    c.extra = serde_json::json!({ "linear": true, "qkv_per_head": !multi_query });
    Ok(())
}

/// llama.cpp's `starcoder` files: GPT-2's keys, `Linear` weights, `[q | k | v]` rows.
pub fn gguf_config_bigcode(g: &GgufFile, arch: &str, c: &mut ModelConfig) -> Result<()> {
    gguf_config(g, arch, c)?;
    c.extra = serde_json::json!({ "linear": true, "qkv_per_head": false });
    Ok(())
}

/// llama.cpp's `gpt2` files: LayerNorm epsilon, GELU (tanh); `Conv1D` weights stored
/// `[out, in]` (transposed back to HF's `[in, out]` on load).
pub fn gguf_config(g: &GgufFile, arch: &str, c: &mut ModelConfig) -> Result<()> {
    c.rms_norm_eps = layer_norm_eps(g, arch)?;
    c.hidden_act = crate::backend::Activation::GeluTanh;
    Ok(())
}

/// `{arch}.attention.layer_norm_epsilon`, which LayerNorm families must have.
pub fn layer_norm_eps(g: &GgufFile, arch: &str) -> Result<f64> {
    let key = format!("{arch}.attention.layer_norm_epsilon");
    g.metadata()
        .get(&key)
        .and_then(|v| v.as_f64())
        .with_context(|| format!("a {arch} model needs the number metadata '{key}'"))
}

pub fn gguf_tensor_name(hf: &str) -> Option<GgufTensorName> {
    names(hf, Some(GgufFix::Transpose))
}

/// GPT-BigCode's: GPT-2's names, weights as they are, its own head where untied.
pub fn gguf_tensor_name_bigcode(hf: &str) -> Option<GgufTensorName> {
    match hf {
        "lm_head.weight" => Some(("output.weight".into(), None)),
        _ => names(hf, None),
    }
}

fn names(hf: &str, t: Option<GgufFix>) -> Option<GgufTensorName> {
    map_name(
        hf,
        &[
            ("transformer.wte.weight", "token_embd.weight"),
            ("transformer.wpe.weight", "position_embd.weight"),
            ("transformer.ln_f.weight", "output_norm.weight"),
            ("transformer.ln_f.bias", "output_norm.bias"),
        ],
        "transformer.h.",
        &[
            ("ln_1", "attn_norm", None),
            ("attn.c_attn", "attn_qkv", t),
            ("attn.c_proj", "attn_output", t),
            ("ln_2", "ffn_norm", None),
            ("mlp.c_fc", "ffn_up", t),
            ("mlp.c_proj", "ffn_down", t),
        ],
    )
}

/// `[in, out]` → `[out, in]`.
pub fn transpose(t: HostTensor) -> HostTensor {
    let (rows, cols) = (t.shape[0], t.shape[1]);
    let mut data = vec![0f32; t.data.len()];
    for r in 0..rows {
        for c in 0..cols {
            data[c * rows + r] = t.data[r * cols + c];
        }
    }
    HostTensor::new(vec![cols, rows], data)
}

struct Layer<B: Backend> {
    ln_1: Norm<B>,          // LayerNorm [hidden]
    w_qkv: B::Buf,          // [(H + 2 Hkv) D, hidden] (this rank's heads)
    b_qkv: B::Buf,          // [(H + 2 Hkv) D]
    w_o: B::Buf,            // [hidden, H D]
    b_o: Option<B::Buf>,    // [hidden]; on tensor rank 0 only (added once to the sum)
    ln_2: Norm<B>,          // LayerNorm [hidden]
    w_fc: B::Buf,           // [F, hidden]
    b_fc: B::Buf,           // [F]
    w_proj: B::Buf,         // [hidden, F]
    b_proj: Option<B::Buf>, // [hidden]; on tensor rank 0 only
}

pub struct Gpt2<B: Backend> {
    stack: Stack<B>,
    wpe: Option<B::Buf>, // [n_positions, hidden], on the first stage
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Gpt2<B> {
    /// Uploads the weights of one worker's shard ([`Load`]).
    pub fn load(ld: Load<'_, B>, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let (c, _backend, max_positions) = (ld.cfg, ld.backend, ld.max_positions);
        let (hid, f) = (c.hidden_size, c.intermediate_size);
        let q = c.num_heads * c.head_dim;
        let linear = c.extra["linear"].as_bool().unwrap_or(false);
        let rows = q + 2 * c.num_kv_heads * c.head_dim;
        if q != hid || (c.num_kv_heads != c.num_heads && !(linear && c.num_kv_heads == 1)) {
            bail!("GPT-2 needs n_head × head_dim = n_embd and no grouped KV");
        }
        if max_positions > c.max_position_embeddings {
            bail!(
                "GPT-2 learned {} positions; the max model length {max_positions} is longer",
                c.max_position_embeddings
            );
        }
        if !c.tie_word_embeddings && !linear {
            bail!("GPT-2 with an untied lm_head is not supported");
        }
        let (sh, mut up, total) = ld.start()?;
        let place = ld.place;
        // NOTE: where tied, wte is the head too: the first and the last stage have it.
        let wte = match place.first_stage() || (c.tie_word_embeddings && place.last_stage()) {
            true => Some(sh.vocab_table(&mut up, "transformer.wte.weight", hid, c.vocab_size)?),
            false => None,
        };
        let wpe = match place.first_stage() {
            true => Some(up.linear("transformer.wpe.weight", &[c.max_position_embeddings, hid])?),
            false => None,
        };
        progress(1, total);
        let ln = |up: &mut Uploader<B>, name: &str| -> Result<Norm<B>> {
            Ok(Norm::Layer(
                up.weight(&format!("{name}.weight"), &[hid], DType::F32)?,
                up.weight(&format!("{name}.bias"), &[hid], DType::F32)?,
            ))
        };
        // a Conv1D weight `[in, out]`, as `[out, in]` (a Linear one is that already)
        let conv = |up: &Uploader<B>, name: &str, i: usize, o: usize| -> Result<Weight> {
            match linear {
                true => up.fetch_linear(name, &[o, i]),
                false => up.fetch_linear(name, &[i, o])?.map_dense(transpose),
            }
        };
        let per_head = c.extra["qkv_per_head"].as_bool().unwrap_or(false);
        let order = super::qkv_rows(c.num_heads, c.head_dim, per_head, None);
        let qkv = |w: Weight| match per_head {
            true => w.permute_rows(&order),
            false => Ok(w),
        };
        let bias = |up: &Uploader<B>, name: &str, n: usize| -> Result<Weight> {
            Ok(Weight::dense(up.fetch(name, &[n])?, DType::F32))
        };
        // NOTE: a row-parallel projection's bias is added once, by rank 0, before the sum.
        let rank0 = place.tp_rank() == 0;
        let mut layers = Vec::with_capacity(place.layers.len());
        for l in place.layers.clone() {
            let n = |s: &str| format!("transformer.h.{l}.{s}");
            // NOTE: the Conv1D weights are stored transposed: read whole, then cut.
            let b_qkv = qkv(bias(&up, &n("attn.c_attn.bias"), rows)?)?;
            let b_qkv = sh.qkv_fused(&up, Have(b_qkv))?;
            let b_fc = sh.ffn_rows(&up, Have(bias(&up, &n("mlp.c_fc.bias"), f)?))?;
            let w_qkv = qkv(conv(&up, &n("attn.c_attn.weight"), hid, rows)?)?;
            let w_qkv = sh.qkv_fused(&up, Have(w_qkv))?;
            let w_o = sh.o_proj(&up, Have(conv(&up, &n("attn.c_proj.weight"), q, hid)?))?;
            let w_fc = sh.ffn_rows(&up, Have(conv(&up, &n("mlp.c_fc.weight"), hid, f)?))?;
            let w_proj = sh.down(&up, Have(conv(&up, &n("mlp.c_proj.weight"), f, hid)?))?;
            let b_o = up.fetch(&n("attn.c_proj.bias"), &[hid])?;
            let b_proj = up.fetch(&n("mlp.c_proj.bias"), &[hid])?;
            layers.push(Layer {
                ln_1: ln(&mut up, &n("ln_1"))?,
                w_qkv: up.upload_linear(w_qkv)?,
                b_qkv: up.upload_bias(b_qkv)?,
                w_o: up.upload_linear(w_o)?,
                b_o: rank0.then(|| up.upload(&b_o, DType::F32)).transpose()?,
                ln_2: ln(&mut up, &n("ln_2"))?,
                w_fc: up.upload_linear(w_fc)?,
                b_fc: up.upload_bias(b_fc)?,
                w_proj: up.upload_linear(w_proj)?,
                b_proj: rank0.then(|| up.upload(&b_proj, DType::F32)).transpose()?,
            });
            progress(l - place.layers.start + 2, total);
        }
        let head = match place.last_stage() {
            true => {
                let table = (wte.is_some(), "transformer.wte.weight");
                let head = Head::load(&mut up, &sh, c, table, &ld.head)?;
                Some((ln(&mut up, "transformer.ln_f")?, head))
            }
            false => None,
        };
        progress(total, total);
        Ok(Gpt2 {
            stack: Stack::new(c, sh, wte, head, c.max_position_embeddings, up.stats, place),
            wpe,
            layers,
        })
    }
}

impl<B: Backend> Family<B> for Gpt2<B> {
    fn stack(&self) -> &Stack<B> {
        &self.stack
    }

    fn forward(&self, backend: &B, batch: &DeviceBatch<B>, kv: &mut KvCache<B>) -> Result<B::Buf> {
        let s = &self.stack;
        let (c, tp, t) = (&s.cfg, &s.place.tp, batch.host.num_tokens());
        let (hid, f, ql, eps) = s.sizes();
        let mut h = backend.alloc_scratch_f32(t * hid)?; // [T, hidden]
        let mut qkv = backend.alloc_scratch_f32(t * ql.row_len())?; // [T, (H + 2 Hkv) D] of this rank
        let mut attn = backend.alloc_scratch_f32(t * ql.q_len())?; // [T, H D]
        let mut u = backend.alloc_scratch_f32(t * f)?; // [T, F]
        let mut o = backend.alloc_scratch_f32(t * hid)?; // [T, hidden]

        // x = wte[ids] + wpe[positions] on the first stage
        let mut x = s.input(backend, batch)?;
        if let Some(wpe) = &self.wpe {
            backend.embedding(wpe, &batch.positions, hid, &mut o)?;
            backend.add_assign(&mut x, &o, t * hid)?;
        }
        for (j, w) in self.layers.iter().enumerate() {
            let l = s.place.layers.start + j;
            w.ln_1.apply(backend, &x, t, hid, eps, &mut h)?;
            backend.matmul(&h, &w.w_qkv, Some(&w.b_qkv), t, hid, ql.row_len(), &mut qkv)?;
            attend(
                backend,
                kv,
                j,
                &mut qkv,
                None,
                batch,
                ql,
                c.attention_options(l),
                &mut attn,
            )?;
            backend.matmul(&attn, &w.w_o, w.b_o.as_ref(), t, ql.q_len(), hid, &mut o)?;
            tp.all_reduce_sum(backend, &mut o, t * hid)?;
            backend.add_assign(&mut x, &o, t * hid)?;
            w.ln_2.apply(backend, &x, t, hid, eps, &mut h)?;
            backend.matmul(&h, &w.w_fc, Some(&w.b_fc), t, hid, f, &mut u)?;
            backend.act(&mut u, t * f, c.hidden_act)?;
            backend.matmul(&u, &w.w_proj, w.b_proj.as_ref(), t, f, hid, &mut o)?;
            tp.all_reduce_sum(backend, &mut o, t * hid)?;
            backend.add_assign(&mut x, &o, t * hid)?;
        }
        s.output(backend, x, batch)
    }
}
