//! Tensor and pipeline parallelism on the CPU backend (workers are threads, the in-process
//! communicator adds in rank order): every split reproduces the single-device greedy goldens
//! exactly, and its logits agree with the single device's within 1e-4 relative (the sums are
//! split differently, so not to the bit); splits that cannot work are clear errors before any
//! weight is loaded.

mod common;

use common::*;
use pagoda::backend::{BackendKind, BatchInput};
use pagoda::engine::KvBudget;
use pagoda::engine::runner::{ModelRunner, RunnerArgs, create_runner};
use pagoda::models::{LoadedModel, load_model};
use pagoda::parallel::ParallelConfig;
use pagoda::tensor::DType;
use pagoda::{EngineArgs, LLM, Prompt, SamplingParams};
use std::path::{Path, PathBuf};

fn split(tensor: usize, pipeline: usize) -> ParallelConfig {
    ParallelConfig { tensor, pipeline }
}

fn runner(model: &LoadedModel, parallel: ParallelConfig) -> anyhow::Result<Box<dyn ModelRunner>> {
    let args = RunnerArgs {
        backend: BackendKind::Cpu,
        dtype: DType::F32.into(),
        block_size: 16,
        kv_budget: Some(KvBudget::Bytes(256 << 20)),
        max_model_len: 1024,
        max_useful_blocks: 64,
        parallel,
    };
    create_runner(model, &args, &mut |_, _| {})
}

/// The prefill of `prompt` in blocks 1.. (one sequence): its last row's logits.
fn prefill(r: &mut dyn ModelRunner, prompt: &[u32]) -> Vec<f32> {
    let table: Vec<u32> = (1..64u32).rev().collect();
    let input: BatchInput = single_sequence_step(prompt.to_vec(), 0, &table, 16);
    r.execute(input).unwrap()
}

/// Greedy decoding of `(prompt, generated)` pairs, all in one batch, under `parallel`.
fn check_greedy(path: &Path, parallel: ParallelConfig, cases: &[(Vec<u32>, Vec<u32>)], what: &str) {
    let mut llm = LLM::new(EngineArgs {
        model: Some(path.to_path_buf()),
        dtype: DType::F32.into(),
        kv_budget: Some(KvBudget::Bytes(256 << 20)),
        block_size: 4,
        max_num_batched_tokens: Some(64),
        parallel,
        ..Default::default()
    })
    .unwrap();
    assert!(
        llm.engine().backend_name().contains(&format!(
            "tensor parallel {}, pipeline parallel {}",
            parallel.tensor, parallel.pipeline
        )),
        "{}",
        llm.engine().backend_name()
    );
    let reqs = cases
        .iter()
        .map(|(p, want)| {
            let params = SamplingParams {
                max_tokens: Some(want.len()),
                ignore_eos: true,
                ..SamplingParams::greedy()
            };
            (Prompt::Tokens(p.clone()), params)
        })
        .collect();
    let outs = llm.generate_each(reqs).unwrap();
    for (i, ((_, want), o)) in cases.iter().zip(&outs).enumerate() {
        assert_eq!(
            &o.outputs[0].token_ids, want,
            "{what} {parallel:?}: prompt {i}"
        );
    }
    // every block came back to the one pool
    let u = llm.engine().kv_usage();
    assert_eq!(u.blocks_used, 0, "{u:?}");
}

/// The top-5 logits of the single device at the end of each prompt, under each split, within
/// 1e-4 relative.
fn check_logits(model: &LoadedModel, splits: &[ParallelConfig], prompts: &[Vec<u32>]) {
    let mut one = runner(model, ParallelConfig::default()).unwrap();
    let want: Vec<Vec<f32>> = prompts.iter().map(|p| prefill(one.as_mut(), p)).collect();
    drop(one);
    for &s in splits {
        let mut r = runner(model, s).unwrap();
        assert_eq!(r.parallel(), s);
        for (p, want) in prompts.iter().zip(&want) {
            let got = prefill(r.as_mut(), p);
            assert_eq!(got.len(), want.len());
            let mut top: Vec<usize> = (0..want.len()).collect();
            top.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
            for &id in &top[..5] {
                let rel = (got[id] - want[id]).abs() / want[id].abs().max(1.0);
                assert!(rel < 1e-4, "{s:?} token {id}: {} vs {}", got[id], want[id]);
            }
        }
    }
}

fn golden_cases(model_id: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    golden()["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["model"] == model_id)
        .map(|e| (ids(&e["prompt_ids"]), ids(&e["generated_ids"])))
        .collect()
}

#[test]
fn smollm2_tensor_3_pipeline_2_and_both_reproduce_the_goldens() {
    // SmolLM2: 9 heads, 3 KV heads, 30 layers
    let path = model_path(SMOL_HF);
    let cases = golden_cases("smollm2-135m-instruct-f32");
    let splits = [split(3, 1), split(1, 2), split(3, 2)];
    for s in splits {
        check_greedy(&path, s, &cases, "smollm2");
    }
    let model = load_model(&path).unwrap();
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| c.0.clone()).collect();
    check_logits(&model, &splits, &prompts);
}

#[test]
fn qwen25_tensor_2_and_7_with_kv_heads_replicated_reproduce_the_goldens() {
    // Qwen2.5-0.5B: 14 heads, 2 KV heads (QKV biases); at 7 ranks of 2 heads, rank 3 holds
    // heads 6 and 7, which read different KV heads: it keeps both
    let path = model_path(QWEN_GGUF);
    let cases = golden_cases("qwen2.5-coder-0.5b-instruct-f32");
    let splits = [split(2, 1), split(7, 1)];
    for s in splits {
        check_greedy(&path, s, &cases, "qwen2.5");
    }
    let model = load_model(&path).unwrap();
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| c.0.clone()).collect();
    check_logits(&model, &splits, &prompts);
}

fn tiny(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tiny")
        .join(name)
}

/// Every family's tiny model (4 heads, 2 KV heads, 3 layers; Phi-3's projections fused; Gemma 3:
/// 1 KV head, replicated, 6 layers of local and global attention; GPT-2 and Falcon: biases on
/// the row-parallel projections, added by rank 0 only; Falcon: multi-query, attention and MLP
/// in parallel): their transformers goldens under tensor 2, pipeline 2 and both.
#[test]
fn tiny_families_split_reproduce_their_goldens() {
    let text = std::fs::read_to_string(tiny("goldens.json")).unwrap();
    let goldens: serde_json::Value = serde_json::from_str(&text).unwrap();
    for &m in TINY_FAMILIES {
        let cases: Vec<(Vec<u32>, Vec<u32>)> = goldens["entries"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["model"] == m)
            .map(|e| (ids(&e["prompt_ids"]), ids(&e["generated_ids"])))
            .collect();
        assert!(!cases.is_empty(), "{m}");
        for s in [split(2, 1), split(1, 2), split(2, 2)] {
            check_greedy(&tiny(m), s, &cases, m);
        }
    }
}

#[test]
fn splits_that_cannot_work_are_clear_errors_before_loading() {
    let smol = load_model(&model_path(SMOL_HF)).unwrap();
    let err = |m: &LoadedModel, s| format!("{:#}", runner(m, s).err().expect("an error"));
    let e = err(&smol, split(2, 1));
    assert!(
        e.contains("does not divide the model's 9 attention heads"),
        "{e}"
    );
    let e = err(&smol, split(1, 31));
    assert!(e.contains("more than the model's 30 layers"), "{e}");
    let e = err(&smol, split(0, 1));
    assert!(e.contains("at least 1"), "{e}");
    let e = format!(
        "{:#}",
        create_runner(
            &smol,
            &RunnerArgs {
                backend: BackendKind::Cuda,
                dtype: DType::F32.into(),
                block_size: 16,
                kv_budget: None,
                max_model_len: 1024,
                max_useful_blocks: 64,
                parallel: split(3, 1),
            },
            &mut |_, _| {}
        )
        .err()
        .expect("an error")
    );
    assert!(e.contains("CPU backend only"), "{e}");
}

/// A failing step (a position past the RoPE tables, refused by every worker) is an error, and
/// the workers run the next step as if nothing had happened.
#[test]
fn a_failed_step_leaves_the_workers_usable() {
    let model = load_model(&tiny("mistral")).unwrap();
    let mut r = runner(&model, split(2, 2)).unwrap();
    let prompt: Vec<u32> = vec![5, 17, 33, 2, 9];
    let before = prefill(r.as_mut(), &prompt);
    let table: Vec<u32> = (1..64u32).rev().collect();
    let mut bad = single_sequence_step(prompt.clone(), 0, &table, 16);
    bad.positions[2] = 1 << 20;
    let e = format!("{:#}", r.execute(bad).unwrap_err());
    assert!(e.contains("beyond the maximum model length"), "{e}");
    assert!(!e.contains("another worker failed"), "{e}");
    assert_eq!(prefill(r.as_mut(), &prompt), before);
}
