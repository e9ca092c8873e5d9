//! End to end against the golden outputs of tests/data/golden (a float64 numpy reference): greedy
//! decoding in f32 reproduces the token ids exactly, and the top-5 logits of the first three
//! positions agree within 1e-3 relative; on the emulated GPU (the CUDA kernels on the CPU), the
//! first golden tokens of two prompts.

mod common;

use common::*;
use pagoda::backend::{CpuBackend, DeviceBatch};
use pagoda::models::{KvCache, load_model, registry};
use pagoda::tensor::DType;
use pagoda::{EngineArgs, LLM, Prompt, SamplingParams};

fn entries(model_id: &str) -> Vec<serde_json::Value> {
    golden()["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["model"] == model_id)
        .cloned()
        .collect()
}

/// Greedy decoding of every golden prompt of `model_id`, all in one batch.
fn check_greedy(path: std::path::PathBuf, model_id: &str) {
    let entries = entries(model_id);
    assert!(!entries.is_empty());
    let mut llm = LLM::new(EngineArgs {
        model: Some(path),
        // NOTE: the goldens are f32 computations; `auto` would keep a GGUF's blocks quantized.
        dtype: DType::F32.into(),
        ..Default::default()
    })
    .unwrap();
    let stop = ids(&golden()["models"][model_id]["stop_token_ids"]);
    let mut eos = llm.engine().eos_token_ids().to_vec();
    eos.sort();
    assert_eq!(eos, stop, "stop token ids");
    let reqs = entries
        .iter()
        .map(|e| {
            let want = ids(&e["generated_ids"]);
            let p = SamplingParams {
                max_tokens: Some(want.len()),
                ..SamplingParams::greedy()
            };
            (Prompt::Tokens(ids(&e["prompt_ids"])), p)
        })
        .collect();
    let outs = llm.generate_each(reqs).unwrap();
    for (e, o) in entries.iter().zip(&outs) {
        assert_eq!(
            o.outputs[0].token_ids,
            ids(&e["generated_ids"]),
            "{}",
            e["name"]
        );
    }
}

/// The model forward alone (no engine): logits of the first three generated positions.
fn check_logits(path: std::path::PathBuf, model_id: &str) {
    let model = load_model(&path).unwrap();
    let be = CpuBackend::new();
    let llama = registry::load(
        &be,
        &model.config,
        model.weights.as_ref(),
        DType::F32.into(),
        1024,
        &Default::default(),
        &mut |_, _| {},
    )
    .unwrap();
    let bs = 16;
    let mut kv = KvCache::new(&be, &llama.kv_spec(), 64, bs).unwrap();
    let vocab = model.config.vocab_size;
    for e in entries(model_id) {
        let prompt = ids(&e["prompt_ids"]);
        let generated = ids(&e["generated_ids"]);
        // blocks 1.. in reverse order, so the block table is not the identity
        let table: Vec<u32> = (1..64u32).rev().collect();
        let mut done = 0;
        for (step, want) in e["first_steps"].as_array().unwrap().iter().enumerate() {
            let toks: Vec<u32> = if step == 0 {
                prompt.clone()
            } else {
                vec![generated[step - 1]]
            };
            let n = toks.len();
            let input = single_sequence_step(toks, done, &table, bs);
            done += n;
            let batch = DeviceBatch::upload(&be, input).unwrap();
            let logits = be_download(&be, &llama.forward(&be, &batch, &mut kv).unwrap());
            assert_eq!(logits.len(), vocab);
            for pair in want["top5"].as_array().unwrap() {
                let (id, gold) = (
                    pair[0].as_u64().unwrap() as usize,
                    pair[1].as_f64().unwrap(),
                );
                let got = logits[id] as f64;
                let rel = (got - gold).abs() / gold.abs().max(1.0);
                assert!(
                    rel < 1e-3,
                    "{} step {step} token {id}: logit {got} vs golden {gold}",
                    e["name"]
                );
            }
            let top = pagoda::backend::argmax(&logits);
            assert_eq!(
                top as u64,
                want["top5"][0][0].as_u64().unwrap(),
                "{} step {step}",
                e["name"]
            );
        }
    }
}

fn be_download(be: &CpuBackend, b: &<CpuBackend as pagoda::backend::Backend>::Buf) -> Vec<f32> {
    use pagoda::backend::Backend;
    be.download_f32(b).unwrap()
}

/// Weights in f16/bf16: greedy tokens agree with the golden ones up to the first position whose
/// top-2 margin is below the logit error of that precision. Log-probabilities are checked
/// against the golden logits through their differences (log-softmax shifts all by one constant).
fn check_half(dtype: DType, logit_err: f64) {
    let entries = entries(SMOL_HF);
    let mut llm = LLM::new(EngineArgs {
        model: Some(model_path(SMOL_GGUF)),
        dtype: dtype.into(),
        ..Default::default()
    })
    .unwrap();
    let mut compared = 0;
    for e in &entries {
        let want = ids(&e["generated_ids"]);
        let margins: Vec<f64> = e["top2_margin"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_f64().unwrap())
            .collect();
        let n = margins
            .iter()
            .position(|&m| m < logit_err)
            .unwrap_or(want.len());
        if n == 0 {
            continue;
        }
        let p = SamplingParams {
            max_tokens: Some(n),
            logprobs: Some(5),
            ..SamplingParams::greedy()
        };
        let out = llm
            .generate(&[Prompt::Tokens(ids(&e["prompt_ids"]))], &p)
            .unwrap()
            .remove(0);
        assert_eq!(
            out.outputs[0].token_ids,
            want[..n],
            "{} in {dtype:?}",
            e["name"]
        );
        compared += n;
        let lp = &out.outputs[0].logprobs[0];
        let top5 = e["first_steps"][0]["top5"].as_array().unwrap();
        let (id0, l0) = (
            top5[0][0].as_u64().unwrap() as u32,
            top5[0][1].as_f64().unwrap(),
        );
        assert_eq!(lp.token_id, id0);
        for pair in top5 {
            let (id, l) = (pair[0].as_u64().unwrap() as u32, pair[1].as_f64().unwrap());
            if let Some(&(_, got)) = lp.top.iter().find(|(t, _)| *t == id) {
                let diff = (got - lp.logprob) as f64 - (l - l0);
                assert!(
                    diff.abs() < 2.0 * logit_err,
                    "{}: logprob difference off by {diff}",
                    e["name"]
                );
            }
        }
    }
    assert!(compared >= 8, "too few positions compared ({compared})");
}

#[test]
fn smollm2_f16_and_bf16_follow_golden_within_their_precision() {
    check_half(DType::F16, 0.1);
    check_half(DType::BF16, 0.25);
}

#[test]
fn smollm2_gguf_greedy_matches_golden() {
    check_greedy(model_path(SMOL_GGUF), SMOL_HF);
}

#[test]
fn smollm2_hf_f32_greedy_matches_golden() {
    check_greedy(model_path(SMOL_HF), SMOL_HF);
}

#[test]
fn qwen25_gguf_greedy_matches_golden() {
    check_greedy(model_path(QWEN_GGUF), "qwen2.5-coder-0.5b-instruct-f32");
}

#[test]
fn smollm2_logits_match_golden() {
    check_logits(model_path(SMOL_GGUF), SMOL_HF);
}

#[test]
fn qwen25_logits_match_golden() {
    check_logits(model_path(QWEN_GGUF), "qwen2.5-coder-0.5b-instruct-f32");
}

/// The CUDA kernels and the GPU backends' host code, run on the CPU by the emulator, on the real
/// model in f32: 6 tokens of two prompts (the emulator runs about 0.3 tokens/s here).
#[test]
fn smollm2_f32_on_the_emulated_gpu_matches_golden() {
    golden_prefixes(
        EngineArgs {
            model: Some(model_path(SMOL_HF)),
            backend: pagoda::BackendKind::Emu,
            dtype: DType::F32.into(),
            kv_budget: Some(pagoda::engine::KvBudget::Bytes(1024 * 46080)),
            max_model_len: Some(512),
            ..Default::default()
        },
        6,
    );
}
