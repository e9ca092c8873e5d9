//! GGUF reader on the real test models (fetched by `scripts/fetch-models.sh` into
//! `$PAGODA_CACHE/models`, default `~/.cache/pagoda/models`): tokenizer and config against the
//! golden file, and tensors against the HF-layout f32 copy made by `gguf2hf.py`.

use pagoda::models::config::Arch;
use pagoda::models::gguf::GgufFile;
use serde_json::Value;
use std::time::Instant;

mod common;

use common::{QWEN_GGUF as QWEN, SMOL_GGUF as SMOL, SMOL_HF, golden, ids, model_path as model};

fn open(name: &str) -> GgufFile {
    let t = Instant::now();
    let g = GgufFile::open(&model(name)).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("open {name}: {:.3} s", t.elapsed().as_secs_f64());
    g
}

fn gguf_of(model_id: &str) -> &'static str {
    match model_id {
        "smollm2-135m-instruct-f32" => SMOL,
        "qwen2.5-coder-0.5b-instruct-f32" => QWEN,
        other => panic!("golden model id '{other}' has no GGUF mapping in this test"),
    }
}

#[test]
fn tokenizers_reproduce_golden_prompts_and_texts() {
    let golden = golden();
    let entries = golden["entries"].as_array().unwrap();
    assert!(!entries.is_empty());
    let mut by_model = std::collections::BTreeMap::new();
    for e in entries {
        let id = e["model"].as_str().unwrap();
        by_model.entry(id).or_insert_with(Vec::new).push(e);
    }
    assert_eq!(by_model.len(), 2, "expected entries for both models");
    for (id, entries) in by_model {
        let g = open(gguf_of(id));
        let t = Instant::now();
        let tk = g.tokenizer().unwrap_or_else(|e| panic!("{e:#}"));
        eprintln!(
            "tokenizer of {id}: built in {:.3} s",
            t.elapsed().as_secs_f64()
        );
        for e in entries {
            let name = e["name"].as_str().unwrap();
            let prompt = e["prompt"].as_str().unwrap();
            let enc = tk.encode(prompt, false).unwrap();
            assert_eq!(
                enc.get_ids(),
                ids(&e["prompt_ids"]).as_slice(),
                "{name}: prompt ids"
            );
            // Adding special tokens must not change anything either (no BOS for these models).
            let enc = tk.encode(prompt, true).unwrap();
            assert_eq!(
                enc.get_ids(),
                ids(&e["prompt_ids"]).as_slice(),
                "{name}: prompt ids (special)"
            );
            let text = tk.decode(&ids(&e["generated_ids"]), false).unwrap();
            assert_eq!(
                text,
                e["generated_text"].as_str().unwrap(),
                "{name}: generated text"
            );
            let prompt_back = tk.decode(&ids(&e["prompt_ids"]), false).unwrap();
            assert_eq!(prompt_back, prompt, "{name}: prompt round trip");
        }
        let tmpl = g.chat_template().expect("chat template");
        assert!(tmpl.contains("<|im_start|>"), "{id}: {tmpl}");
    }
}

#[test]
fn smollm2_tokenizer_equals_gguf2hf_tokenizer_json() {
    let g = open(SMOL);
    let ours: Value =
        serde_json::from_str(&g.tokenizer().unwrap().to_string(false).unwrap()).unwrap();
    let path = model(SMOL_HF).join("tokenizer.json");
    let theirs: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for key in [
        "added_tokens",
        "normalizer",
        "pre_tokenizer",
        "post_processor",
        "decoder",
        "model",
    ] {
        assert!(
            ours[key] == theirs[key],
            "tokenizer.json field '{key}' differs from {}",
            path.display()
        );
    }
}

#[test]
fn configs_match_golden() {
    let golden = golden();
    for (id, m) in golden["models"].as_object().unwrap() {
        let g = open(gguf_of(id));
        let c = g.config().unwrap_or_else(|e| panic!("{e:#}"));
        let gc = &m["config"];
        let u = |k: &str| gc[k].as_u64().unwrap_or_else(|| panic!("{id}: golden {k}")) as usize;
        assert_eq!(c.arch.name(), m["arch"].as_str().unwrap(), "{id}");
        assert_eq!(c.hidden_size, u("hidden_size"), "{id}");
        assert_eq!(c.num_layers, u("num_hidden_layers"), "{id}");
        assert_eq!(c.num_heads, u("num_attention_heads"), "{id}");
        assert_eq!(c.num_kv_heads, u("num_key_value_heads"), "{id}");
        assert_eq!(c.vocab_size, u("vocab_size"), "{id}");
        assert_eq!(c.rms_norm_eps, gc["rms_norm_eps"].as_f64().unwrap(), "{id}");
        assert_eq!(c.rope_theta, gc["rope_theta"].as_f64().unwrap(), "{id}");
        assert_eq!(
            c.tie_word_embeddings,
            gc["tie_word_embeddings"].as_bool().unwrap(),
            "{id}"
        );
        assert_eq!(
            c.bos_token_id,
            m["bos_token_id"].as_u64().map(|x| x as u32),
            "{id}"
        );
        assert_eq!(
            c.eos_token_ids,
            vec![m["eos_token_id"].as_u64().unwrap() as u32],
            "{id}"
        );
        assert_eq!(c.head_dim, c.hidden_size / c.num_heads, "{id}");
        assert_eq!(c.rope_scaling, None, "{id}");
        assert_eq!(c.attention_bias, c.arch == Arch::Qwen2, "{id}");
        match c.arch {
            Arch::Llama => assert_eq!(
                (c.intermediate_size, c.max_position_embeddings),
                (1536, 8192)
            ),
            Arch::Qwen2 => assert_eq!(
                (c.intermediate_size, c.max_position_embeddings),
                (4864, 32768)
            ),
            other => panic!("{id}: unexpected architecture {other:?}"),
        }
    }
}

#[test]
fn smollm2_tensors_equal_hf_safetensors() {
    let g = open(SMOL);
    let path = model(SMOL_HF).join("model.safetensors");
    let file = std::fs::File::open(&path).unwrap();
    // SAFETY: read-only map of a test fixture nobody modifies during the test.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let st = safetensors::SafeTensors::deserialize(&mmap).unwrap();
    let names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.17.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ];
    for name in names {
        let t = Instant::now();
        let ours = g
            .tensor(name)
            .unwrap_or_else(|e| panic!("{e:#}"))
            .unwrap_or_else(|| panic!("{name} missing"));
        let dt = t.elapsed().as_secs_f64();
        let view = st.tensor(name).unwrap();
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
        assert_eq!(ours.shape, view.shape(), "{name}: shape");
        let theirs: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(ours.data.len(), theirs.len(), "{name}");
        let bad = ours
            .data
            .iter()
            .zip(&theirs)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        if let Some(i) = bad {
            panic!(
                "{name}: element {i} is {} here but {} in {}",
                ours.data[i],
                theirs[i],
                path.display()
            );
        }
        eprintln!("{name} {:?}: {:.3} s", ours.shape, dt);
    }
    assert!(
        g.tensor("lm_head.weight").unwrap().is_none(),
        "SmolLM2 ties its embeddings"
    );
}

/// Every tensor of both models loads, with the shape the config implies and finite values.
#[test]
fn all_tensors_load_with_config_shapes() {
    for name in [SMOL, QWEN] {
        let g = open(name);
        let c = g.config().unwrap();
        let (h, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let mut expected: Vec<(String, Vec<usize>)> = vec![
            ("model.embed_tokens.weight".into(), vec![v, h]),
            ("model.norm.weight".into(), vec![h]),
        ];
        if !c.tie_word_embeddings {
            expected.push(("lm_head.weight".into(), vec![v, h]));
        }
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            expected.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
                (format!("{p}.mlp.gate_proj.weight"), vec![f, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![f, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, f]),
            ]);
            if c.attention_bias {
                expected.extend([
                    (format!("{p}.self_attn.q_proj.bias"), vec![q]),
                    (format!("{p}.self_attn.k_proj.bias"), vec![kv]),
                    (format!("{p}.self_attn.v_proj.bias"), vec![kv]),
                ]);
            }
        }
        assert_eq!(
            expected.len(),
            g.tensors().len(),
            "{name}: every GGUF tensor is accounted for"
        );
        let t = Instant::now();
        let mut n_values = 0usize;
        for (hf, shape) in &expected {
            let x = g
                .tensor(hf)
                .unwrap_or_else(|e| panic!("{e:#}"))
                .unwrap_or_else(|| panic!("{name}: {hf} missing"));
            assert_eq!(&x.shape, shape, "{name}: {hf}");
            assert!(
                x.data.iter().all(|v| v.is_finite()),
                "{name}: {hf} has non-finite values"
            );
            n_values += x.data.len();
        }
        let dt = t.elapsed().as_secs_f64();
        eprintln!(
            "{name}: all {} tensors ({n_values} values) dequantized in {dt:.3} s",
            expected.len()
        );
    }
}

/// Qwen2.5 tensors (stored in HF row order: no Q/K permutation) against sha256 digests of what
/// the independent reference `gguf.quants.dequantize` (gguf==0.19.0) makes of the same file,
/// as little-endian f32 in HF shape. Covers Q5_0, Q8_0, Q6_K, Q4_K and F32 on real data.
#[test]
fn qwen_tensors_match_gguf_py_digests() {
    use sha2::{Digest, Sha256};
    let g = open(QWEN);
    let cases = [
        (
            "model.layers.0.self_attn.q_proj.weight", // Q5_0
            [896, 896],
            "3311f9674de0bf07422d429666021430ff3c58362b248074c678e5b9eb5cd0a7",
        ),
        (
            "model.layers.0.self_attn.v_proj.weight", // Q8_0
            [128, 896],
            "eaf7101a791d9c8de19271ec4dfaa0bd3f3e1d91d30d9685bc7199cde97408ff",
        ),
        (
            "model.layers.0.mlp.down_proj.weight", // Q6_K
            [896, 4864],
            "ab075951878740c9f8ad4cf65c0ce93f5c0c048c0110a555d872725bba271996",
        ),
        (
            "model.layers.11.mlp.down_proj.weight", // Q4_K
            [896, 4864],
            "f48a7c976f6fce6b8cd9515c4cb0721f8ebe8328d7d2fcf07bf0cd208cc17536",
        ),
        (
            "model.layers.23.self_attn.o_proj.weight", // Q5_0
            [896, 896],
            "c05278d772a1f086bbf316ba8e2ca0e98f8d1ac666feddb656903f3517e76ba9",
        ),
    ];
    let bias_cases = [
        (
            "model.layers.0.self_attn.q_proj.bias",
            896,
            "385ae32149d0064b4327ddffe23ff14db4c444ad358dc4e9ee5d2e546e8c42ef",
        ),
        (
            "model.layers.0.self_attn.k_proj.bias",
            128,
            "2aac120c4241244d26d14c4323ac16c2b20555458d6ba361f7e2ce9d833700cf",
        ),
    ];
    let check = |name: &str, shape: Vec<usize>, digest: &str| {
        let x = g
            .tensor(name)
            .unwrap_or_else(|e| panic!("{e:#}"))
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(x.shape, shape, "{name}");
        let mut h = Sha256::new();
        for v in &x.data {
            h.update(v.to_le_bytes());
        }
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex, digest,
            "{name}: dequantized values differ from gguf.quants"
        );
    };
    for (name, shape, digest) in cases {
        check(name, shape.to_vec(), digest);
    }
    for (name, n, digest) in bias_cases {
        check(name, vec![n], digest);
    }
}
