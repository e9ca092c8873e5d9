//! The wgpu backend end to end (llvmpipe in CI, with `WGPU_BACKEND=vulkan`): greedy decoding of
//! SmolLM2 in f32 reproduces the golden tokens, a batch of 8 concurrent requests gives each one
//! the tokens it gets alone, and adapter failures are errors, not panics.
#![cfg(feature = "wgpu")]

mod common;

use common::*;
use pagoda::backend::wgpu::{WgpuBackend, WgpuOptions};
use pagoda::backend::{Backend, BackendKind};
use pagoda::engine::KvBudget;
use pagoda::{EngineArgs, LLM, SamplingParams};

/// Golden tokens compared per prompt (the shortest prompts: llvmpipe runs about 1 GFLOP/s).
const GOLDEN_TOKENS: usize = 16;

fn wgpu_args() -> EngineArgs {
    EngineArgs {
        model: Some(model_path(SMOL_HF)),
        backend: BackendKind::Wgpu,
        // 4096 tokens of KV (SmolLM2: 46080 bytes a token)
        kv_budget: Some(KvBudget::Bytes(4096 * 46080)),
        max_model_len: Some(512),
        ..Default::default()
    }
}

#[test]
fn smollm2_f32_greedy_matches_golden() {
    golden_prefixes(wgpu_args(), GOLDEN_TOKENS);
}

#[test]
fn batch_of_8_equals_each_alone() {
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "The three primary colors are",
        "To make a cup of tea, first",
        "1, 2, 3, 4,",
        "The quick brown fox",
        "Water boils at",
    ];
    let params = SamplingParams {
        max_tokens: Some(6),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let mut llm = LLM::new(wgpu_args()).unwrap();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            llm.generate(&[*p], &params)
                .unwrap()
                .remove(0)
                .outputs
                .remove(0)
                .token_ids
        })
        .collect();
    let together = llm.generate(&prompts, &params).unwrap();
    for (i, o) in together.iter().enumerate() {
        assert_eq!(
            o.outputs[0].token_ids, alone[i],
            "prompt {i}: {:?}",
            prompts[i]
        );
    }
}

#[test]
fn buffer_too_large_is_an_error() {
    let be = WgpuBackend::new().unwrap();
    let err = be
        .alloc_f32(1 << 40)
        .err()
        .expect("a 4 TiB buffer must fail");
    let msg = format!("{err:#}");
    assert!(msg.contains("largest"), "{msg}");
    // the device still works afterwards
    let x = be.upload_f32(&[1.0, 2.0]).unwrap();
    assert_eq!(be.download_f32(&x).unwrap(), [1.0, 2.0]);
}

#[test]
fn lost_device_is_an_error() {
    let be = WgpuBackend::new().unwrap();
    let x = be.upload_f32(&[1.0; 64]).unwrap();
    be.destroy_device();
    let mut y = match be.alloc_f32(64) {
        Ok(y) => y,
        Err(e) => {
            assert!(format!("{e:#}").contains("lost"), "{e:#}");
            return;
        }
    };
    let err = be
        .add_assign(&mut y, &x, 64)
        .and_then(|_| be.download_f32(&y))
        .expect_err("a destroyed device must fail");
    assert!(format!("{err:#}").contains("lost"), "{err:#}");
}

#[test]
fn no_adapter_is_an_error() {
    // No Vulkan, Metal or DX12 adapter can be found with an empty set of APIs.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args(["info", "--backend", "wgpu", "--model"])
        .arg(model_path(SMOL_HF))
        .env("WGPU_BACKEND", "none")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no wgpu adapter"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn auto_never_picks_a_software_adapter() {
    let be = WgpuBackend::with_options(WgpuOptions::default()).unwrap();
    match WgpuBackend::new_hardware() {
        Ok(hw) => assert!(!hw.is_software()),
        Err(e) => {
            assert!(be.is_software(), "{e:#}");
            assert!(format!("{e:#}").contains("software"), "{e:#}");
        }
    }
}
