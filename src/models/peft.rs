//! LoRA adapters read from disk: PEFT's directories, `adapter_config.json` (rank, alpha,
//! rsLoRA, and what is refused) and `adapter_model.safetensors` (the factors by layer and
//! module), and llama.cpp's GGUF files (`gguf_lora.rs`).

use super::config::ModelConfig;
use super::loader::{SafetensorsWeights, WeightSource};
use super::lora::{FactorPairs, LoraAdapter, lora_scale};
use crate::untrusted::text;
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::Path;

/// Reads the LoRA adapter `path` for the model `base`: a PEFT directory, or a file (llama.cpp's
/// GGUF adapters, `gguf_lora.rs`).
pub fn load_adapter(path: &Path, base: &ModelConfig) -> Result<LoraAdapter> {
    match path.is_file() {
        true => super::gguf_lora::load_gguf_adapter(path, base),
        false => load_peft_adapter(path),
    }
}

/// Reads a PEFT adapter directory. What PEFT can express but this engine does not apply
/// (DoRA, LoRA biases, `modules_to_save`, per-module ranks or alphas, embedding adapters)
/// is refused by name rather than dropped.
fn load_peft_adapter(dir: &Path) -> Result<LoraAdapter> {
    let shown = text(&dir.display().to_string());
    let cfg_path = dir.join("adapter_config.json");
    // NOTE: not a FIFO or a device that a read would hang on or never finish.
    crate::untrusted::regular_file(&cfg_path)
        .with_context(|| format!("{shown} has no readable adapter_config.json"))?;
    let cfg_text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("{shown} has no readable adapter_config.json"))?;
    let cfg: Value = serde_json::from_str(&cfg_text)
        .with_context(|| format!("{shown}/adapter_config.json is not valid JSON"))?;
    let (rank, alpha, rslora) = check_config(&cfg).with_context(|| {
        format!("{shown}/adapter_config.json: not an adapter this engine can apply")
    })?;
    let file = dir.join("adapter_model.safetensors");
    if !file.is_file() {
        bail!(
            "{shown} has no adapter_model.safetensors (adapters saved as .bin are not read: \
             save them with safe_serialization)"
        );
    }
    let st = SafetensorsWeights::open_files(vec![file])?;
    let scale = lora_scale(alpha, rank, rslora) as f32;
    let mut pairs = FactorPairs::new(&shown);
    let mut names: Vec<&str> = st.names().collect();
    names.sort_unstable();
    for name in names {
        let (layer, module, is_a) =
            parse_name(name).with_context(|| format!("{shown}: tensor `{}`", text(name)))?;
        let (t, stored) = st
            .get_weight(name)?
            .with_context(|| format!("{shown}: tensor `{}` unreadable", text(name)))?
            .into_dense()?;
        pairs.add(layer, module, is_a, t, stored)?;
    }
    pairs.finish(Some(rank), |_| scale)
}

/// `r`, `lora_alpha` and `use_rslora` of an adapter_config.json, after refusing what is not
/// applied.
fn check_config(cfg: &Value) -> Result<(usize, f64, bool)> {
    if let Some(t) = cfg["peft_type"].as_str()
        && t != "LORA"
    {
        bail!("peft_type is {}, not LORA", text(t));
    }
    let rank = cfg["r"]
        .as_u64()
        .filter(|&r| r > 0)
        .context("r must be a positive integer")? as usize;
    let alpha = cfg["lora_alpha"]
        .as_f64()
        .context("lora_alpha must be a number")?;
    let rslora = cfg["use_rslora"].as_bool().unwrap_or(false);
    let set = |k: &str| match &cfg[k] {
        Value::Null | Value::Bool(false) => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::String(s) => !s.is_empty() && s != "none",
        _ => true,
    };
    for (key, what) in [
        (
            "modules_to_save",
            "fully trained modules saved beside the adapter",
        ),
        ("use_dora", "DoRA"),
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
        ("lora_bias", "LoRA biases"),
        ("layers_to_transform", "adapters on some layers by index"),
        ("layer_replication", "layer replication"),
    ] {
        if set(key) {
            bail!("{key} ({what}) is not supported");
        }
    }
    match cfg["bias"].as_str() {
        None | Some("none") => {}
        Some(b) => bail!("bias = {} is not supported (only \"none\")", text(b)),
    }
    // NOTE: `fan_in_fan_out` says the base layer stores its weight transposed (GPT-2's
    // Conv1D); lora_A and lora_B are saved as [r, in] and [out, r] either way, so the factors
    // read the same.
    Ok((rank, alpha, rslora))
}

/// `base_model.model.model.layers.{i}.{path.}{module}.lora_{A|B}.weight` → (i, module,
/// whether A).
fn parse_name(name: &str) -> Result<(usize, String, bool)> {
    let rest = name
        .strip_prefix("base_model.model.")
        .context("not a PEFT LoRA tensor (no base_model.model. prefix)")?;
    let (rest, is_a) = if let Some(r) = rest.strip_suffix(".lora_A.weight") {
        (r, true)
    } else if let Some(r) = rest.strip_suffix(".lora_B.weight") {
        (r, false)
    } else {
        bail!(
            "not a LoRA factor of a linear layer (embedding adapters and biases are not supported)"
        );
    };
    // NOTE: only the decoder's own layers (`model.layers.N`): a multimodal model's vision or
    // audio towers have layers of their own, with the same module names.
    let rest = rest.strip_prefix("model.layers.").context(
        "not in a decoder layer `model.layers.N` (adapters on the embeddings, the head or other towers are not supported)",
    )?;
    let (layer, path) = rest
        .split_once('.')
        .context("no module after the layer index")?;
    let layer = layer.parse().context("the layer index is not a number")?;
    let module = path.rsplit('.').next().unwrap_or(path).to_string();
    Ok((layer, module, is_a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_names_give_the_layer_and_the_module() {
        let (l, m, w) =
            parse_name("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight").unwrap();
        assert_eq!((l, m.as_str(), w), (12, "q_proj", true));
        let (l, m, w) =
            parse_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight").unwrap();
        assert_eq!((l, m.as_str(), w), (0, "down_proj", false));
        for bad in [
            "model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.embed_tokens.lora_embedding_A",
            "base_model.model.lm_head.lora_A.weight",
            "base_model.model.model.layers.x.mlp.up_proj.lora_A.weight",
            "base_model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight",
        ] {
            assert!(parse_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn what_peft_can_say_but_is_not_applied_is_refused_by_name() {
        let ok = serde_json::json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
            "use_rslora": true, "modules_to_save": null, "bias": "none", "use_dora": false,
            "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": false});
        assert_eq!(check_config(&ok).unwrap(), (8, 16.0, true));
        for (k, v) in [
            ("modules_to_save", serde_json::json!(["lm_head"])),
            ("use_dora", serde_json::json!(true)),
            ("rank_pattern", serde_json::json!({"q_proj": 4})),
            ("bias", serde_json::json!("all")),
            ("r", serde_json::json!(0)),
            ("peft_type", serde_json::json!("IA3")),
        ] {
            let mut c = ok.clone();
            c[k] = v;
            let e = check_config(&c).unwrap_err().to_string();
            assert!(
                e.contains(k) || k == "peft_type" && e.contains("IA3"),
                "{k}: {e}"
            );
        }
        assert_eq!(lora_scale(32.0, 16, true), 8.0);
        assert_eq!(lora_scale(8.0, 16, false), 0.5);
    }
}
