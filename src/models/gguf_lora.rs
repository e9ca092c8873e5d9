//! llama.cpp's LoRA adapters: a GGUF file with `general.type = adapter` and
//! `adapter.type = lora`, as its `convert_lora_to_gguf.py` writes them from PEFT's. Each adapted
//! weight of the base, by its GGUF name `W` (`blk.0.attn_q.weight`), has two tensors: `W.lora_a`
//! `[r, in]` and `W.lora_b` `[out, r]`; `adapter.lora.alpha` is the alpha, and
//! `general.architecture` the base's.
//!
//! Where they differ from PEFT's files, they are read as llama.cpp applies them:
//! - the scale is `alpha / r`, with r the module's own rank, or 1 where alpha is 0 or missing;
//!   rsLoRA cannot be said (the converter drops `use_rslora`);
//! - Llama's and Granite's Q and K B rows are in llama.cpp's permuted order, as the base's
//!   weights are; it is undone with the base's head counts (the adapter does not store them).

use super::config::ModelConfig;
use super::gguf::{GgufFile, GgufFix, GgufValue, permutes_qk, unpermute_rows};
use super::lora::{FactorPairs, LoraAdapter};
use super::registry::Family;
use crate::untrusted::text;
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::path::Path;

/// The projections adapters may change, by HF module path: what the families' GGUF name maps
/// are asked for.
const PROJECTIONS: [&str; 9] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
];

/// A projection's GGUF weight name → (layer, PEFT module name, how the GGUF rows differ).
type Projections = HashMap<String, (usize, &'static str, Option<GgufFix>)>;

/// The GGUF names a family gives the projections of `layers` layers.
fn projections(family: &Family, layers: usize) -> Projections {
    let mut out = HashMap::new();
    for layer in 0..layers {
        for path in PROJECTIONS {
            let hf = format!("model.layers.{layer}.{path}.weight");
            if let Some((gguf, fix)) = (family.gguf_tensor_name)(&hf) {
                let module = path.rsplit('.').next().unwrap_or(path);
                out.insert(gguf, (layer, module, fix));
            }
        }
    }
    out
}

/// Reads the GGUF LoRA adapter `path` for the model `base`.
pub fn load_gguf_adapter(path: &Path, base: &ModelConfig) -> Result<LoraAdapter> {
    let shown = text(&path.display().to_string());
    let file = GgufFile::open(path).with_context(|| {
        format!(
            "{shown}: a LoRA adapter is a PEFT directory (adapter_config.json and \
             adapter_model.safetensors) or a GGUF adapter file"
        )
    })?;
    let meta = file.metadata();
    let string = |k: &str| meta.get(k).and_then(GgufValue::as_str);
    match string("general.type") {
        Some("adapter") => {}
        Some(t) => bail!(
            "{shown} is a GGUF {} file, not an adapter (general.type)",
            text(t)
        ),
        None => {
            bail!("{shown} is a GGUF model, not a LoRA adapter (its general.type is not `adapter`)")
        }
    }
    match string("adapter.type") {
        Some("lora") => {}
        other => bail!(
            "{shown}: adapter.type is {}, and only `lora` adapters are supported",
            other.map_or("missing".to_string(), text)
        ),
    }
    if meta.contains_key("adapter.alora.invocation_tokens") {
        bail!("{shown} is an activated LoRA (aLoRA) adapter, which is not supported");
    }
    let alpha = match meta.get("adapter.lora.alpha") {
        None => 0.0,
        Some(v) => v
            .as_f64()
            .with_context(|| format!("{shown}: adapter.lora.alpha is not a number"))?,
    };
    let arch = file.architecture()?;
    // NOTE: as llama.cpp, only an adapter converted for the base's architecture: another
    // family may name its projections alike but order their rows otherwise.
    if base.arch.gguf_architecture() != Some(arch) {
        bail!(
            "{shown} is an adapter for `{}` models, not for this {} model",
            text(arch),
            base.arch.name()
        );
    }
    let names = projections(base.arch.family(), base.num_layers);
    let mut pairs = FactorPairs::new(&shown);
    for info in file.tensors() {
        let name = text(&info.name);
        let (weight, is_a) = match (
            info.name.strip_suffix(".lora_a"),
            info.name.strip_suffix(".lora_b"),
        ) {
            (Some(w), _) => (w, true),
            (_, Some(w)) => (w, false),
            _ => bail!(
                "{shown}: `{name}` is not a LoRA factor (adapters that replace norms or other \
                 weights are not supported)"
            ),
        };
        let Some(&(layer, module, fix)) = names.get(weight) else {
            bail!(
                "{shown}: `{name}` is not on a projection of a decoder layer of this model \
                 (adapters on the embeddings or the output are not supported)"
            );
        };
        let (mut t, stored) = file.hf_tensor(info)?;
        if !is_a && t.shape.len() == 2 && permutes_qk(arch) {
            let heads = match fix {
                Some(GgufFix::UnpermuteQ) => Some(base.num_heads),
                Some(GgufFix::UnpermuteK) => Some(base.num_kv_heads),
                _ => None,
            };
            // NOTE: a B of another height is left for the shape check to name.
            if let Some(n_head) = heads.filter(|h| h * base.head_dim == t.shape[0]) {
                let (rows, cols) = (t.shape[0], t.shape[1]);
                t.data = unpermute_rows(&t.data, rows, cols, n_head)
                    .with_context(|| format!("{shown}: `{name}`"))?;
            }
        }
        pairs.add(layer, module.to_string(), is_a, t, stored)?;
    }
    // NOTE: llama.cpp scales each module by its own rank: `alpha / r`, 1 without an alpha.
    pairs.finish(None, |r| match alpha {
        0.0 => 1.0,
        a => (a / r as f64) as f32,
    })
}
