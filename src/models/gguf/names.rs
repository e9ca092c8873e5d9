//! HF tensor names to GGUF ones (llama.cpp's `blk.N.*`), and how a GGUF tensor differs from
//! its HF counterpart (llama's permuted Q/K rows, Gemma's `1 + w` norms).

use anyhow::{Result, bail};

/// How a GGUF tensor differs from its HF counterpart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufFix {
    /// llama.cpp's row permutation of the Q projection of `llama` (undone on load).
    UnpermuteQ,
    /// The same for the K projection.
    UnpermuteK,
    /// Stored as `1 + w` (Gemma's RMSNorm weights): 1 is subtracted on load.
    SubtractOne,
    /// Stored `[out, in]` where HF stores `[in, out]` (GPT-2's `Conv1D`): transposed on load.
    Transpose,
    /// Expert `j`'s `[out, in]` matrix of a 3-D `[experts, out, in]` tensor (llama.cpp's
    /// `ffn_{gate,up,down}_exps`, where HF has one tensor per expert).
    Expert(usize),
}

/// A GGUF tensor name, and how the tensor differs from its HF counterpart.
pub type GgufTensorName = (String, Option<GgufFix>);

/// The GGUF name of an HF tensor name through a family's tables: `globals` maps whole names,
/// `blocks` maps the module of `{layer_prefix}{N}.{module}.{weight|bias}` to llama.cpp's
/// `blk.N.{part}.{weight|bias}` with the fix of that part.
pub fn map_name(
    hf: &str,
    globals: &[(&str, &str)],
    layer_prefix: &str,
    blocks: &[(&str, &str, Option<GgufFix>)],
) -> Option<GgufTensorName> {
    if let Some((_, g)) = globals.iter().find(|(h, _)| *h == hf) {
        return Some((g.to_string(), None));
    }
    let rest = hf.strip_prefix(layer_prefix)?;
    let (idx, rest) = rest.split_once('.')?;
    // Canonical decimal only, so that "01" does not alias "1".
    let layer: usize = idx.parse().ok()?;
    if layer.to_string() != idx {
        return None;
    }
    let (module, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let (_, part, fix) = blocks.iter().find(|(m, _, _)| *m == module)?;
    // NOTE: only weights are transposed or permuted by llama.cpp's converter... except the
    // Q/K biases, which the permutation applies to as well.
    let fix = match fix {
        Some(GgufFix::Transpose) if kind == "bias" => None,
        f => *f,
    };
    Some((format!("blk.{layer}.{part}.{kind}"), fix))
}

/// The GGUF name of an HF tensor name of a mixture of experts: the router
/// (`block_sparse_moe.gate` in Mixtral, `mlp.gate` in the others) as `ffn_gate_inp`, expert
/// `j`'s projections (Mixtral's `w1`, `w3`, `w2`) as its matrix of `ffn_{gate,up,down}_exps`,
/// Qwen2-MoE's shared expert as `ffn_*_shexp` and its gate as `ffn_gate_inp_shexp`: the names
/// llama.cpp's converter writes.
pub fn moe_tensor_name(hf: &str) -> Option<GgufTensorName> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (idx, rest) = rest.split_once('.')?;
    let layer: usize = idx.parse().ok()?;
    if layer.to_string() != idx {
        return None;
    }
    let rest = rest
        .strip_prefix("mlp.")
        .or_else(|| rest.strip_prefix("block_sparse_moe."))?
        .strip_suffix(".weight")?;
    let blk = |part: &str, fix| Some((format!("blk.{layer}.{part}.weight"), fix));
    match rest {
        "gate" => return blk("ffn_gate_inp", None),
        "shared_expert_gate" => return blk("ffn_gate_inp_shexp", None),
        "shared_expert.gate_proj" => return blk("ffn_gate_shexp", None),
        "shared_expert.up_proj" => return blk("ffn_up_shexp", None),
        "shared_expert.down_proj" => return blk("ffn_down_shexp", None),
        _ => {}
    }
    let (j, proj) = rest.strip_prefix("experts.")?.split_once('.')?;
    let expert: usize = j.parse().ok()?;
    if expert.to_string() != j {
        return None;
    }
    let part = match proj {
        "gate_proj" | "w1" => "ffn_gate_exps",
        "up_proj" | "w3" => "ffn_up_exps",
        "down_proj" | "w2" => "ffn_down_exps",
        _ => return None,
    };
    blk(part, Some(GgufFix::Expert(expert)))
}

/// The GGUF name of an HF tensor name in the Llama-like families (llama.cpp's `blk.N.*`), the
/// mixtures of experts among them.
pub fn llama_tensor_name(hf: &str) -> Option<GgufTensorName> {
    if let Some(n) = moe_tensor_name(hf) {
        return Some(n);
    }
    map_name(
        hf,
        &[
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ],
        "model.layers.",
        &[
            ("input_layernorm", "attn_norm", None),
            ("post_attention_layernorm", "ffn_norm", None),
            ("self_attn.q_proj", "attn_q", Some(GgufFix::UnpermuteQ)),
            ("self_attn.k_proj", "attn_k", Some(GgufFix::UnpermuteK)),
            ("self_attn.v_proj", "attn_v", None),
            ("self_attn.o_proj", "attn_output", None),
            ("self_attn.q_norm", "attn_q_norm", None),
            ("self_attn.k_norm", "attn_k_norm", None),
            ("mlp.gate_proj", "ffn_gate", None),
            ("mlp.up_proj", "ffn_up", None),
            ("mlp.down_proj", "ffn_down", None),
        ],
    )
}

/// Whether llama.cpp's converter permutes the Q and K rows of this GGUF architecture (Llama's
/// and Granite's, no other's).
pub fn permutes_qk(arch: &str) -> bool {
    matches!(arch, "llama" | "granite")
}

/// Undoes llama.cpp's Q/K row permutation (HF rotate-half order -> GGML interleaved order):
/// within each of the `n_head` heads of `rows / n_head` rows, GGUF row `2j + t` is HF row
/// `t * half + j`. `data` is `rows x cols`, row-major.
pub fn unpermute_rows(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Result<Vec<f32>> {
    if rows.checked_mul(cols) != Some(data.len()) {
        bail!("internal: {} values for a {rows}x{cols} tensor", data.len());
    }
    let order = unpermute_order(rows, n_head)?;
    let mut out = vec![0f32; data.len()];
    for (dst, &src_row) in out.chunks_exact_mut(cols.max(1)).zip(&order) {
        dst.copy_from_slice(&data[src_row * cols..(src_row + 1) * cols]);
    }
    Ok(out)
}

/// For each HF row, the GGUF row it comes from (see [`unpermute_rows`]).
pub(super) fn unpermute_order(rows: usize, n_head: usize) -> Result<Vec<usize>> {
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        bail!(
            "cannot undo the Q/K permutation: {rows} rows do not split into {n_head} heads of even size"
        );
    }
    let head = rows / n_head;
    let half = head / 2;
    Ok((0..rows)
        .map(|hf_row| {
            let (h, i) = (hf_row / head, hf_row % head);
            let (t, j) = (i / half, i % half);
            h * head + 2 * j + t
        })
        .collect())
}
