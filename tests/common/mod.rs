//! Shared by the integration tests: where the real models and the golden outputs are.
#![allow(dead_code)]

use std::path::PathBuf;

pub const SMOL_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SMOL_HF: &str = "smollm2-135m-instruct-f32";
pub const QWEN_GGUF: &str = "Qwen2.5-Coder-0.5B-Instruct.gguf";

/// The families whose tiny random-weight models run today: one HF directory each in
/// tests/data/tiny, and its GGUF copy in `$PAGODA_CACHE/models/tiny-gguf`.
pub const TINY_FAMILIES: &[&str] = &[
    "mistral",
    "qwen3",
    "gemma3",
    "phi3",
    "phi3-longrope",
    "gpt2",
    "falcon",
    "falcon-new",
    "falcon-untied",
    "granite",
    "gpt-neox",
    "stablelm",
    "starcoder2",
    "cohere",
    "gpt-bigcode",
    "gptj",
    "olmo2",
    "bloom",
    "mpt",
    "falcon-rw",
    "mixtral",
    "qwen2-moe",
    "qwen3-moe",
    "olmoe",
];

/// The tiny families whose MLP is a mixture of experts.
pub const MOE_FAMILIES: &[&str] = &["mixtral", "qwen2-moe", "qwen3-moe", "olmoe"];

/// The tiny families with a GGUF copy (`tiny-gguf/`): all but those llama.cpp has no form of
/// (Falcon with ALiBi).
pub fn gguf_families() -> impl Iterator<Item = &'static str> {
    TINY_FAMILIES.iter().copied().filter(|&m| m != "falcon-rw")
}

/// A file or model directory under tests/data/tiny.
pub fn tiny(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tiny")
        .join(name)
}

/// A tiny family's golden cases: (prompt ids, transformers' greedy ids).
pub fn tiny_cases(m: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(tiny("goldens.json")).unwrap();
    let goldens: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases: Vec<(Vec<u32>, Vec<u32>)> = goldens["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["model"] == m)
        .map(|e| (ids(&e["prompt_ids"]), ids(&e["generated_ids"])))
        .collect();
    assert!(!cases.is_empty(), "{m}");
    cases
}

/// A model under `$PAGODA_CACHE/models`; fails (never skips) when it is missing.
pub fn model_path(name: &str) -> PathBuf {
    let cache = std::env::var_os("PAGODA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/pagoda")
        });
    let p = cache.join("models").join(name);
    assert!(
        p.exists(),
        "test model {} is missing: run scripts/fetch-models.sh",
        p.display()
    );
    p
}

pub fn golden() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/golden/golden_public.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    serde_json::from_str(&text).expect("golden_public.json is valid JSON")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// One step of a single sequence for a model's forward alone: `toks` at positions
/// `done .. done + n`, written through `table` (block ids) with `bs` tokens a block; the last
/// row's logits are wanted.
pub fn single_sequence_step(
    toks: Vec<u32>,
    done: usize,
    table: &[u32],
    bs: usize,
) -> pagoda::backend::BatchInput {
    let n = toks.len();
    pagoda::backend::BatchInput {
        token_ids: toks,
        positions: (done..done + n).map(|p| p as u32).collect(),
        slot_mapping: (done..done + n)
            .map(|p| table[p / bs] * bs as u32 + (p % bs) as u32)
            .collect(),
        query_start: vec![0, n as u32],
        seq_lens: vec![(done + n) as u32],
        block_tables: table.to_vec(),
        max_blocks: table.len(),
        logits_rows: vec![n as u32 - 1],
        lora_slots: Vec::new(),
    }
}

/// Greedy decoding of SmolLM2 in f32 on the engine `args` makes reproduces the first `n` golden
/// tokens of the two shortest public prompts, both in one batch (backends too slow for more:
/// llvmpipe, the emulated GPU).
#[allow(dead_code)]
pub fn golden_prefixes(args: pagoda::EngineArgs, n: usize) {
    use pagoda::{LLM, Prompt, SamplingParams};
    let golden = golden();
    let entries: Vec<&serde_json::Value> = golden["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["model"] == SMOL_HF)
        .filter(|e| {
            ["A3-smol-text-once", "A4-smol-text-list"].contains(&e["name"].as_str().unwrap())
        })
        .collect();
    assert_eq!(entries.len(), 2);
    let backend = args.backend;
    let mut llm = LLM::new(args).unwrap();
    assert!(llm.engine().backend_name().starts_with(backend.name()));
    let reqs = entries
        .iter()
        .map(|e| {
            let p = SamplingParams {
                max_tokens: Some(n),
                ignore_eos: true,
                ..SamplingParams::greedy()
            };
            (Prompt::Tokens(ids(&e["prompt_ids"])), p)
        })
        .collect();
    let outs = llm.generate_each(reqs).unwrap();
    for (e, o) in entries.iter().zip(&outs) {
        let want = &ids(&e["generated_ids"])[..n];
        assert_eq!(o.outputs[0].token_ids, want, "{}", e["name"]);
    }
}
