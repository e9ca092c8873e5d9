//! Quantized GGUFs under `--dtype auto` (the default): the weights stay in their block formats
//! in memory, and greedy generation follows llama.cpp's on the same files up to the first
//! near-tie (tests/data/golden/llama_cpp_quant.json, made by
//! scripts/make-llama-cpp-greedy.py with llama.cpp's own server).

mod common;

use common::*;
use pagoda::{DType, EngineArgs, LLM, Prompt, SamplingParams, WeightDtype};
use serde_json::Value;

/// Where greedy choices may part: the two most likely tokens are closer than this (in log
/// probability) for one engine or the other. Both quantize activations to 8 bits (per 256
/// values for the K-quants, per 32 for the others), but their float sums run in other orders.
const NEAR_TIE: f32 = 0.5;

fn llama_cpp() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/golden/llama_cpp_quant.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn engine(file: &str, dtype: WeightDtype) -> LLM {
    LLM::new(EngineArgs {
        model: Some(model_path(file)),
        dtype,
        max_model_len: Some(1024),
        ..Default::default()
    })
    .unwrap()
}

/// The weights of a quantized file take the file's bytes, in its types: nothing became f32
/// but the norms.
#[test]
fn quantized_weights_stay_quantized_in_memory() {
    let cases: [(&str, &[&str]); 2] = [
        (SMOL_GGUF, &["Q4_1", "Q8_0"]),
        (QWEN_GGUF, &["Q5_0", "Q8_0", "Q6_K", "Q4_K"]),
    ];
    for (file, types) in cases {
        let mut llm = engine(file, WeightDtype::Auto);
        let stats = llm.engine().weight_stats().clone();
        for t in types {
            assert!(
                stats.by_type.contains_key(*t),
                "{file}: no {t} in {stats:?}"
            );
        }
        let f32_bytes = stats.by_type.get("f32").copied().unwrap_or(0);
        assert!(
            f32_bytes < 2 << 20,
            "{file}: {f32_bytes} bytes of f32 weights (norms and biases only expected)"
        );
        // The bytes in memory are the file's tensors' bytes (within the norms' f32).
        let file_bytes = std::fs::metadata(model_path(file)).unwrap().len();
        assert!(
            stats.bytes <= file_bytes && stats.bytes * 10 >= file_bytes * 9,
            "{file}: {} bytes of weights for a {file_bytes}-byte file",
            stats.bytes
        );
        // Every parameter in 4 bytes under --dtype f32: what `auto` saves.
        drop(llm);
        let mut f32 = engine(file, DType::F32.into());
        let s32 = f32.engine().weight_stats();
        assert_eq!(s32.by_type.keys().collect::<Vec<_>>(), ["f32"]);
        assert_eq!(s32.params, stats.params, "{file}");
        assert_eq!(s32.bytes, 4 * s32.params);
        assert!(stats.bytes * 3 < s32.bytes, "{file}: {stats:?}");
    }
}

/// The gap between the two most likely tokens of one step, from (id, logprob) pairs.
fn margin(top: &[(u32, f32)]) -> f32 {
    match top {
        [a, b, ..] => a.1 - b.1,
        _ => f32::INFINITY,
    }
}

/// Greedy ids agree with llama.cpp's until a step where one of the two engines has its top
/// two within [`NEAR_TIE`]; where they part, that must be such a step.
#[test]
fn greedy_follows_llama_cpp_up_to_the_first_near_tie() {
    let reference = llama_cpp();
    let golden = golden();
    let mut report = Vec::new();
    for (model_id, entries) in reference["models"].as_object().unwrap() {
        let file = entries[0]["file"].as_str().unwrap();
        let mut llm = engine(file, WeightDtype::Auto);
        let prompts: Vec<Vec<u32>> = entries
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let g = golden["entries"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|g| g["name"] == e["name"])
                    .unwrap();
                ids(&g["prompt_ids"])
            })
            .collect();
        let reqs = entries
            .as_array()
            .unwrap()
            .iter()
            .zip(&prompts)
            .map(|(e, p)| {
                let n = e["generated_ids"].as_array().unwrap().len();
                let params = SamplingParams {
                    max_tokens: Some(n),
                    logprobs: Some(2),
                    ..SamplingParams::greedy()
                };
                (Prompt::Tokens(p.clone()), params)
            })
            .collect();
        let outs = llm.generate_each(reqs).unwrap();
        for (e, o) in entries.as_array().unwrap().iter().zip(&outs) {
            let theirs = ids(&e["generated_ids"]);
            let ours = &o.outputs[0];
            let name = e["name"].as_str().unwrap();
            let parted = theirs.iter().zip(&ours.token_ids).position(|(a, b)| a != b);
            let Some(p) = parted else {
                report.push(format!(
                    "{model_id} {name}: all {} tokens agree",
                    theirs.len()
                ));
                continue;
            };
            let our_margin = margin(&ours.logprobs[p].top);
            let top2 = &e["top2"][p];
            let their_margin = match (top2[0][1].as_f64(), top2[1][1].as_f64()) {
                (Some(a), Some(b)) => (a - b) as f32,
                _ => f32::INFINITY,
            };
            report.push(format!(
                "{model_id} {name}: agree on {p} tokens, then llama.cpp {} vs ours {} \
                 (top-2 margin ours {our_margin:.3}, llama.cpp {their_margin:.3})",
                theirs[p], ours.token_ids[p]
            ));
            assert!(
                our_margin.min(their_margin) < NEAR_TIE,
                "{}",
                report.last().unwrap()
            );
        }
    }
    println!("{}", report.join("\n"));
}

/// On the emulated GPU (the CUDA kernels on the CPU), a quantized file stays in its blocks, in
/// the CPU's types and bytes, and greedy decoding follows the CPU's. The block products are
/// the CPU's to the bit (`weights_in_blocks_give_the_cpus_bits` in tests/backend_ops.rs); the
/// other ops (attention, norms) sum in other orders, and 8-bit activations turn their last-bit
/// differences into logits that move by up to a few tenths, so the two may part where either
/// has its top two within [`NEAR_TIE`].
#[test]
fn emulated_gpu_keeps_blocks_and_follows_the_cpu() {
    let prompt = ids(&golden()["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "A3-smol-text-once")
        .unwrap()["prompt_ids"]);
    let n = 8;
    let mut runs = Vec::new();
    for backend in [pagoda::BackendKind::Cpu, pagoda::BackendKind::Emu] {
        let mut llm = LLM::new(EngineArgs {
            model: Some(model_path(SMOL_GGUF)),
            backend,
            max_model_len: Some(256),
            ..Default::default()
        })
        .unwrap();
        let stats = llm.engine().weight_stats().clone();
        let params = SamplingParams {
            max_tokens: Some(n),
            ignore_eos: true,
            logprobs: Some(2),
            ..SamplingParams::greedy()
        };
        let out = llm
            .generate_each(vec![(Prompt::Tokens(prompt.clone()), params)])
            .unwrap();
        runs.push((stats, out[0].outputs[0].clone()));
    }
    let [(cpu_stats, cpu), (emu_stats, emu)] = &runs[..] else {
        unreachable!()
    };
    assert_eq!(emu_stats.by_type, cpu_stats.by_type);
    assert!(emu_stats.by_type.contains_key("Q4_1"));
    match cpu
        .token_ids
        .iter()
        .zip(&emu.token_ids)
        .position(|(a, b)| a != b)
    {
        None => assert_eq!(cpu.token_ids, emu.token_ids),
        Some(p) => {
            let m = margin(&cpu.logprobs[p].top).min(margin(&emu.logprobs[p].top));
            assert!(
                m < NEAR_TIE,
                "the CPU and the emulated GPU part at token {p} of {:?} and {:?}, top-2 margin {m}",
                cpu.token_ids,
                emu.token_ids
            );
        }
    }
}
