//! Bad input gets a clear error that names the problem, never a panic.

mod common;

use common::*;
use pagoda::engine::RequestError;
use pagoda::models::load_model;
use pagoda::{Engine, EngineArgs, Prompt, SamplingParams};
use std::path::Path;

fn load_err(path: &Path) -> String {
    match load_model(path) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => format!("{e:#}"),
    }
}

/// An HF directory with SmolLM2's tokenizer and a config edited by `edit`.
fn hf_dir(edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let src = model_path(SMOL_HF);
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// SmolLM2's weights in `dir`, linked.
fn link_weights(dir: &Path) {
    std::os::unix::fs::symlink(
        model_path(SMOL_HF).join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
}

#[test]
fn missing_model_path() {
    let e = load_err(Path::new("/nonexistent/model.gguf"));
    assert!(
        e.contains("/nonexistent/model.gguf") && e.contains("does not exist"),
        "{e}"
    );
}

/// `load_model` on another thread, failing the test instead of hanging when it blocks.
fn load_err_soon(path: &Path) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(load_model(&p).map(|_| ()).map_err(|e| format!("{e:#}")));
    });
    match rx.recv_timeout(std::time::Duration::from_secs(20)) {
        Ok(Err(e)) => e,
        Ok(Ok(())) => panic!("{} loaded but should not have", path.display()),
        Err(_) => panic!("loading {} blocked", path.display()),
    }
}

fn mkfifo(path: &Path) {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mkfifo {}", path.display());
}

#[test]
fn symlink_loops_and_dangling_links_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.gguf"), dir.path().join("b.gguf"));
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    let e = load_err(&a);
    assert!(
        e.contains("a.gguf") && e.contains("symbolic links") && !e.contains("does not exist"),
        "{e}"
    );
    let c = dir.path().join("c.gguf");
    std::os::unix::fs::symlink(dir.path().join("gone.gguf"), &c).unwrap();
    let e = load_err(&c);
    assert!(
        e.contains("c.gguf is a symbolic link to") && e.contains("gone.gguf, which does not exist"),
        "{e}"
    );
}

/// A FIFO, a device or a directory that is not a model fails at once (opening a FIFO blocks).
#[test]
fn files_that_are_not_regular_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.gguf");
    mkfifo(&fifo);
    let e = load_err_soon(&fifo);
    assert!(
        e.contains("model.gguf is a FIFO")
            && e.contains("not a GGUF file or an HF model directory"),
        "{e}"
    );
    let e = load_err_soon(Path::new("/dev/zero"));
    assert!(e.contains("/dev/zero is a character device"), "{e}");
    let e = load_err_soon(dir.path());
    assert!(e.contains("a directory without config.json"), "{e}");

    // in an HF directory: config.json, tokenizer.json, the weights, generation_config.json
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
        "generation_config.json",
    ] {
        let dir = hf_dir(|_| {});
        if f != "model.safetensors" {
            link_weights(dir.path());
        }
        let p = dir.path().join(f);
        let _ = std::fs::remove_file(&p);
        mkfifo(&p);
        let e = load_err_soon(dir.path());
        assert!(
            e.contains(&format!("{f} is a FIFO (named pipe), not a regular file")),
            "{f}: {e}"
        );
    }
}

#[test]
fn truncated_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.gguf");
    let bytes = std::fs::read(model_path(SMOL_GGUF)).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&p);
    assert!(e.contains("cut.gguf"), "error does not name the file: {e}");
    assert!(
        e.to_lowercase().contains("trunc") || e.contains("beyond") || e.contains("end of"),
        "{e}"
    );
}

#[test]
fn not_a_gguf_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("junk.gguf");
    std::fs::write(&p, b"this is not a model file at all").unwrap();
    let e = load_err(&p);
    assert!(e.contains("junk.gguf"), "{e}");
}

#[test]
fn corrupt_and_truncated_safetensors() {
    let dir = hf_dir(|_| {});
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}....",
    )
    .unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("model.safetensors") && e.contains("not a valid safetensors"),
        "{e}"
    );

    let real = std::fs::read(model_path(SMOL_HF).join("model.safetensors")).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        &real[..real.len() / 3],
    )
    .unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn unknown_architecture() {
    let dir = hf_dir(|c| c["model_type"] = "mamba".into());
    let e = load_err(dir.path());
    assert!(e.contains("unknown architecture 'mamba'"), "{e}");
    assert!(e.contains("config.json") && e.contains("model_type"), "{e}");
}

/// What does not fit a family is refused with the file and the key named.
#[test]
fn family_configs_that_do_not_fit() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "sliding_window",
            Box::new(|c| {
                c["model_type"] = "mistral".into();
                c["sliding_window"] = 0.into();
            }),
        ),
        (
            "not a multiple of num_key_value_heads",
            Box::new(|c| c["num_key_value_heads"] = 2.into()),
        ),
        (
            "layer types for 30 layers",
            Box::new(|c| {
                c["model_type"] = "gemma3_text".into();
                c["sliding_window"] = 512.into();
                c["layer_types"] = serde_json::json!(["sliding_attention", "full_attention"]);
            }),
        ),
        (
            "gemma3_text needs a positive sliding_window",
            Box::new(|c| c["model_type"] = "gemma3_text".into()),
        ),
        (
            "activation 'relu6' is not supported",
            Box::new(|c| c["hidden_act"] = "relu6".into()),
        ),
        (
            "mpt with qk_ln: true is not supported",
            Box::new(|c| {
                c["model_type"] = "mpt".into();
                c["attn_config"] = serde_json::json!({"alibi": true, "qk_ln": true});
            }),
        ),
        (
            "rope_scaling.short_factor",
            Box::new(|c| {
                c["model_type"] = "phi3".into();
                c["rope_scaling"] = serde_json::json!({"type": "longrope", "long_factor": [1.0]});
                c["original_max_position_embeddings"] = 4096.into();
            }),
        ),
    ];
    for (want, edit) in cases {
        let dir = hf_dir(edit);
        let e = load_err(dir.path());
        assert!(e.contains(want) && e.contains("config.json"), "{want}: {e}");
    }
}

/// A field that is present with a value of the wrong type, or a token id that is not a token,
/// is an error naming the key and the value, never silently the default.
#[test]
fn wrong_types_and_bad_token_ids_are_named() {
    use serde_json::json;
    let cases: Vec<(&str, &str, serde_json::Value)> = vec![
        (
            "'rope_theta' must be a number, found \"64\"",
            "rope_theta",
            json!("64"),
        ),
        (
            "'max_position_embeddings' must be a non-negative integer, found -1",
            "max_position_embeddings",
            json!(-1),
        ),
        (
            "'num_key_value_heads' must be a non-negative integer, found 1.5",
            "num_key_value_heads",
            json!(1.5),
        ),
        (
            "'tie_word_embeddings' must be true or false",
            "tie_word_embeddings",
            json!("yes"),
        ),
        (
            "'hidden_act' must be a string, found 3",
            "hidden_act",
            json!(3),
        ),
        (
            "'rope_scaling' must be an object",
            "rope_scaling",
            json!("llama3"),
        ),
        (
            "'rope_scaling.factor' must be a number, found \"8\"",
            "rope_scaling",
            json!({"rope_type": "llama3", "factor": "8"}),
        ),
        (
            "'eos_token_id' must be a token id",
            "eos_token_id",
            json!(-1),
        ),
        (
            "'eos_token_id' must be a token id",
            "eos_token_id",
            json!(4294967298u64),
        ),
        (
            "'eos_token_id' must be a token id",
            "eos_token_id",
            json!([2, "x"]),
        ),
        (
            "'bos_token_id' must be a token id",
            "bos_token_id",
            json!(1e10),
        ),
        (
            "eos_token_id 49152 is not a token: the vocabulary has 49152",
            "eos_token_id",
            json!([2, 49152]),
        ),
        (
            "bos_token_id 100000 is not a token",
            "bos_token_id",
            json!(100000),
        ),
    ];
    for (want, key, value) in cases {
        let dir = hf_dir(|c| c[key] = value.clone());
        let e = load_err(dir.path());
        assert!(e.contains(want) && e.contains("config.json"), "{key}: {e}");
    }
    // a float with no fraction is an integer (Python writes 8192.0 for floats); null is absent
    let dir = hf_dir(|c| {
        c["max_position_embeddings"] = json!(8192.0);
        c["rope_theta"] = serde_json::Value::Null;
        c["eos_token_id"] = serde_json::Value::Null;
    });
    link_weights(dir.path());
    let m = load_model(dir.path()).unwrap();
    assert_eq!(m.config.max_position_embeddings, 8192);
    assert_eq!(m.config.rope_theta, 10000.0);
    assert!(m.config.eos_token_ids.is_empty());

    // family fields and generation_config.json alike
    let dir = hf_dir(|c| {
        c["model_type"] = "gemma3_text".into();
        c["sliding_window"] = 512.into();
        c["query_pre_attn_scalar"] = json!("256");
    });
    let e = load_err(dir.path());
    assert!(
        e.contains("'query_pre_attn_scalar' must be a number"),
        "{e}"
    );
    let dir = hf_dir(|c| {
        c["model_type"] = "falcon".into();
        c["multi_query"] = json!("false");
    });
    let e = load_err(dir.path());
    assert!(e.contains("'multi_query' must be true or false"), "{e}");
    let dir = hf_dir(|_| {});
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [2, -1]}"#,
    )
    .unwrap();
    link_weights(dir.path());
    let e = load_err(dir.path());
    assert!(
        e.contains("generation_config.json") && e.contains("'eos_token_id' must be a token id"),
        "{e}"
    );
}

#[test]
fn missing_config_and_tokenizer() {
    let dir = hf_dir(|_| {});
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("config.json"), "{e}");
    let dir = hf_dir(|_| {});
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn shape_that_does_not_match_the_config() {
    let dir = hf_dir(|c| c["intermediate_size"] = 1024.into());
    std::os::unix::fs::symlink(
        model_path(SMOL_HF).join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let err = Engine::new(EngineArgs {
        model: Some(dir.path().to_path_buf()),
        ..Default::default()
    })
    .err()
    .expect("a config that does not match the weights must fail");
    let e = format!("{err:#}");
    assert!(
        e.contains("mlp.gate_proj.weight")
            && e.contains("[1536, 576]")
            && e.contains("[1024, 576]"),
        "{e}"
    );
}

/// A max model length past the model's context is refused (vLLM does too), however large;
/// so is a product of the limits that overflows.
#[test]
fn engine_sizes_past_the_model_or_the_arithmetic_are_refused() {
    for len in [8193, 1 << 32, usize::MAX] {
        let err = Engine::new(EngineArgs {
            model: Some(model_path(SMOL_GGUF)),
            max_model_len: Some(len),
            ..Default::default()
        })
        .err()
        .expect("a max_model_len past the context must fail");
        let e = format!("{err:#}");
        assert!(
            e.contains(&format!(
                "max_model_len {len} is greater than the model's context length 8192"
            )),
            "{e}"
        );
    }
    let err = Engine::new(EngineArgs {
        model: Some(model_path(SMOL_GGUF)),
        max_num_seqs: usize::MAX / 2,
        ..Default::default()
    })
    .err()
    .expect("an overflowing product must fail");
    let e = format!("{err:#}");
    assert!(e.contains("overflows"), "{e}");
    let err = Engine::new(EngineArgs {
        model: Some(model_path(SMOL_GGUF)),
        block_size: usize::MAX / 2,
        max_model_len: Some(64),
        ..Default::default()
    })
    .err()
    .expect("a block too large must fail");
    let e = format!("{err:#}");
    assert!(e.contains("more than 2^64 bytes"), "{e}");
}

/// A model whose context is 2^24 positions gets RoPE tables for what the KV pool can hold,
/// not for 2^24 positions (4 GiB of tables for SmolLM2, and minutes to compute them).
#[test]
fn a_huge_context_is_bounded_by_the_kv_pool() {
    let dir = hf_dir(|c| c["max_position_embeddings"] = (1u64 << 24).into());
    link_weights(dir.path());
    let t = std::time::Instant::now();
    let mut engine = Engine::new(EngineArgs {
        model: Some(dir.path().to_path_buf()),
        kv_budget: Some(pagoda::engine::KvBudget::Bytes(16 << 20)),
        ..Default::default()
    })
    .unwrap();
    assert!(t.elapsed().as_secs() < 60, "{:?}", t.elapsed());
    let cap = engine.kv_usage().num_blocks * 16;
    assert_eq!(engine.max_model_len(), cap);
    assert!(cap > 200 && cap < 400, "{cap}");
    // a prompt that reaches the end of the pool still runs
    let n = engine.max_model_len() - 3;
    engine
        .add_request(
            Prompt::Tokens(vec![28; n]),
            SamplingParams {
                max_tokens: Some(2),
                ..SamplingParams::greedy()
            },
        )
        .unwrap();
    let mut out = 0;
    while engine.has_unfinished() {
        out += engine
            .step()
            .unwrap()
            .iter()
            .map(|o| o.new_token_ids.len())
            .sum::<usize>();
    }
    assert_eq!(out, 2);
}

/// Weights that cannot fit in the memory left are refused before anything is loaded: a
/// safetensors file (sparse on disk) claiming a tensor of 4 TiB.
#[test]
fn weights_larger_than_memory_are_refused_before_loading() {
    let dir = hf_dir(|_| {});
    let n: u64 = 1 << 20;
    let header = format!(
        r#"{{"huge":{{"dtype":"F32","shape":[{n},{n}],"data_offsets":[0,{}]}}}}"#,
        n * n * 4
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    let p = dir.path().join("model.safetensors");
    std::fs::write(&p, &bytes).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(bytes.len() as u64 + n * n * 4).unwrap();
    let err = Engine::new(EngineArgs {
        model: Some(dir.path().to_path_buf()),
        ..Default::default()
    })
    .err()
    .expect("4 TiB of weights must be refused");
    let e = format!("{err:#}");
    assert!(
        e.contains("the weights need 4194304 MiB as stored (--dtype auto) but only")
            && e.contains("of available memory (MemAvailable) are left"),
        "{e}"
    );
}

#[test]
fn bad_requests_are_refused_and_nothing_is_lost() {
    let mut engine = Engine::new(EngineArgs {
        model: Some(model_path(SMOL_GGUF)),
        max_model_len: Some(64),
        ..Default::default()
    })
    .unwrap();
    let ok = engine
        .add_request(
            "Hello".into(),
            SamplingParams {
                max_tokens: Some(3),
                ..SamplingParams::greedy()
            },
        )
        .unwrap();

    let long = "word ".repeat(100);
    assert!(matches!(
        engine.add_request(long.as_str().into(), SamplingParams::greedy()),
        Err(RequestError::PromptTooLong(_))
    ));
    let e = engine
        .add_request(
            "Hi".into(),
            SamplingParams {
                max_tokens: Some(100),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(
        e.to_string().contains("maximum context length of 64"),
        "{e}"
    );

    for (p, param) in [
        (
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_k: -5,
                ..Default::default()
            },
            "top_k",
        ),
        (
            SamplingParams {
                min_p: 2.0,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                max_tokens: Some(0),
                ..Default::default()
            },
            "max_tokens",
        ),
        (
            SamplingParams {
                n: 17,
                ..Default::default()
            },
            "n",
        ),
        (
            SamplingParams {
                n: 2,
                best_of: Some(1),
                ..Default::default()
            },
            "best_of",
        ),
        (
            SamplingParams {
                n: 2,
                best_of: Some(17),
                ..Default::default()
            },
            "best_of",
        ),
    ] {
        match engine.add_request("Hi".into(), p) {
            Err(RequestError::InvalidParam(e)) => assert_eq!(e.param, param, "{e}"),
            other => panic!("{param}: expected InvalidParam, got {other:?}"),
        }
    }
    assert!(matches!(
        engine.add_request(Prompt::Tokens(vec![]), SamplingParams::greedy()),
        Err(RequestError::InvalidPrompt(_))
    ));
    assert!(matches!(
        engine.add_request(Prompt::Tokens(vec![1, 999_999]), SamplingParams::greedy()),
        Err(RequestError::InvalidPrompt(_))
    ));

    // The good request still completes.
    let mut n = 0;
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            assert_eq!(o.request_id, ok);
            n += o.new_token_ids.len();
        }
    }
    assert_eq!(n, 3);
    assert_eq!(engine.kv_usage().blocks_used, 0);
}

#[test]
fn unavailable_backends_fail_cleanly() {
    for b in ["cuda", "hip", "wgpu"] {
        let compiled = (b == "cuda" && cfg!(feature = "cuda"))
            || (b == "hip" && cfg!(feature = "hip"))
            || (b == "wgpu" && cfg!(feature = "wgpu"));
        let res = Engine::new(EngineArgs {
            model: Some(model_path(SMOL_GGUF)),
            backend: b.parse().unwrap(),
            ..Default::default()
        });
        let err = match res {
            Err(e) => e,
            // a compiled GPU backend on a machine that has the GPU
            Ok(_) if compiled => continue,
            Ok(_) => panic!("backend {b} should not be available in this build"),
        };
        let e = format!("{err:#}");
        // Not compiled: "rebuild with --features"; compiled without a device or runtime: the
        // backend says which library or device is missing.
        assert!(
            e.contains("feature")
                || e.contains("not implemented")
                || (compiled && (e.contains("not found") || e.contains("no GPU"))),
            "{b}: {e}"
        );
    }
    assert!("tpu".parse::<pagoda::BackendKind>().is_err());
}

/// `--threads` and `PAGODA_CPU_ISA` reach the CPU backend (`info` names both), and bad values
/// of either are refused by name.
#[test]
fn threads_and_the_cpu_instruction_set_are_taken_or_refused() {
    let info = |args: &[&str], isa: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pagoda"))
            .args(["info", "--model", tiny("qwen3").to_str().unwrap()])
            .args(args)
            .env("PAGODA_CPU_ISA", isa)
            .env_remove("RAYON_NUM_THREADS")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, text) = info(&["--threads", "1"], "portable");
    assert!(ok && text.contains("cpu (1 threads, portable)"), "{text}");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        let (ok, text) = info(&["--threads", "3"], "avx2");
        assert!(ok && text.contains("cpu (3 threads, avx2)"), "{text}");
    }
    let (ok, text) = info(&[], "avx3");
    assert!(!ok && text.contains("PAGODA_CPU_ISA=avx3"), "{text}");
    let (ok, text) = info(&["--threads", "0"], "avx512");
    assert!(!ok && text.contains("--threads"), "{text}");
}
