//! Multi-LoRA serving against transformers + peft: tiny random PEFT adapters on the tiny Mistral,
//! Phi-3, Gemma 3 and OLMo 2 models (`tests/data/tiny/lora/`, made by
//! `scripts/make-tiny-lora.py`: ranks 8 and 16, attention-only and all-linear, `lora_alpha` !=
//! `r`, rsLoRA, Phi-3's fused projections) and their greedy goldens. Pagoda in f32 reproduces
//! the ids exactly: each adapter alone, every adapter and the base in one batch, after loading,
//! unloading and loading again at run time; on the CPU and on the emulated GPU, and (built with
//! `--features wgpu`) on wgpu.

mod common;
mod server_util;

use common::tiny;
use pagoda::engine::{LoraArgs, LoraError, LoraModule, RequestError};
use pagoda::parallel::ParallelConfig;
use pagoda::{BackendKind, EngineArgs, LLM, Prompt, SamplingParams};
use serde_json::json;
use server_util::{get, post_json};
use std::path::PathBuf;

const BACKENDS: [BackendKind; 2] = [BackendKind::Cpu, BackendKind::Emu];

fn goldens() -> serde_json::Value {
    let p = tiny("lora/goldens.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Each output's name (`base`, an adapter, a merged copy) and its 24 ids per prompt.
type Outputs = Vec<(String, Vec<Vec<u32>>)>;

/// The prompts of `model`, and its outputs.
fn cases(model: &str) -> (Vec<Vec<u32>>, Outputs) {
    let g = &goldens()["models"][model];
    let prompts = g["prompts"].as_array().unwrap().iter().map(ids).collect();
    let outputs = g["outputs"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, o)| {
            let g = o["generated_ids"].as_array().unwrap().iter().map(ids);
            (name.clone(), g.collect())
        })
        .collect();
    (prompts, outputs)
}

fn adapter(name: &str) -> PathBuf {
    tiny(&format!("lora/{name}"))
}

/// `--lora-modules NAME=tests/data/tiny/lora/DIR`.
fn module(name: &str, dir: &str) -> LoraModule {
    LoraModule {
        name: name.into(),
        path: adapter(dir),
        base_model_name: None,
    }
}

fn greedy() -> SamplingParams {
    SamplingParams {
        max_tokens: Some(24),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

/// An engine on `model` with LoRA on and `modules` loaded; small blocks and a small token
/// budget, so that prompts are chunked and blocks shared where the prefix cache allows.
fn engine(model: &str, backend: BackendKind, modules: &[&str], max_loras: usize) -> LLM {
    engine_split(
        model,
        backend,
        modules,
        max_loras,
        ParallelConfig::default(),
    )
}

/// [`engine`] split over workers.
fn engine_split(
    model: &str,
    backend: BackendKind,
    modules: &[&str],
    max_loras: usize,
    parallel: ParallelConfig,
) -> LLM {
    LLM::new(EngineArgs {
        model: Some(tiny(model)),
        backend,
        block_size: 4,
        max_num_batched_tokens: Some(32),
        parallel,
        lora: LoraArgs {
            enable: true,
            max_loras,
            modules: modules.iter().map(|m| module(m, m)).collect(),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap()
}

/// Runs `(prompt, adapter)` pairs in one batch; the generated ids of each.
fn run(llm: &mut LLM, reqs: &[(Vec<u32>, Option<&str>)]) -> Vec<Vec<u32>> {
    let reqs = reqs
        .iter()
        .map(|(p, l)| (Prompt::Tokens(p.clone()), greedy(), l.map(String::from)))
        .collect();
    let out = llm.generate_with_lora(reqs).unwrap();
    out.into_iter()
        .map(|r| r.outputs[0].token_ids.clone())
        .collect()
}

fn adapters_of(outputs: &[(String, Vec<Vec<u32>>)]) -> Vec<&str> {
    outputs
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| *n != "base" && !n.ends_with("-merged"))
        .collect()
}

/// Each adapter alone (one request at a time, the base's cached blocks beside it), then every
/// adapter and the base over every prompt in one batch.
fn alone_and_mixed(backend: BackendKind, models: &[&str]) {
    alone_and_mixed_split(backend, models, ParallelConfig::default());
}

fn alone_and_mixed_split(backend: BackendKind, models: &[&str], parallel: ParallelConfig) {
    for &model in models {
        let (prompts, outputs) = cases(model);
        let names = adapters_of(&outputs);
        let mut llm = engine_split(model, backend, &names, names.len(), parallel);
        for (name, want) in &outputs {
            if name.ends_with("-merged") {
                continue;
            }
            let lora = (name != "base").then_some(name.as_str());
            for (p, w) in prompts.iter().zip(want) {
                let got = run(&mut llm, &[(p.clone(), lora)]);
                assert_eq!(
                    &got[0], w,
                    "{backend:?} {parallel:?} {model} {name} alone, prompt {p:?}"
                );
            }
        }
        let mut reqs = Vec::new();
        let mut wants = Vec::new();
        for (name, want) in outputs.iter().filter(|(n, _)| !n.ends_with("-merged")) {
            let lora = (name != "base").then_some(name.as_str());
            for (p, w) in prompts.iter().zip(want) {
                reqs.push((p.clone(), lora));
                wants.push((name.clone(), w.clone()));
            }
        }
        let got = run(&mut llm, &reqs);
        for (g, (name, w)) in got.iter().zip(&wants) {
            assert_eq!(
                g, w,
                "{backend:?} {parallel:?} {model} {name} in a mixed batch"
            );
        }
    }
}

const MODELS: [&str; 4] = ["mistral", "phi3", "gemma3", "olmo2"];

#[test]
fn adapters_alone_and_mixed_in_one_batch_give_peft_tokens() {
    for backend in BACKENDS {
        alone_and_mixed(backend, &MODELS);
    }
}

/// The same under tensor parallelism (2 workers on the CPU): each rank keeps its rows of B
/// (QKV, gate and up; OLMo 2's QKV whole) or its columns of A (o, down), and the all-reduce
/// sums the row-parallel updates. Pipeline parallelism is refused at start.
#[test]
fn adapters_under_tensor_parallelism_give_peft_tokens() {
    let tp2 = ParallelConfig {
        tensor: 2,
        pipeline: 1,
    };
    alone_and_mixed_split(BackendKind::Cpu, &MODELS, tp2);
    let r = LLM::new(EngineArgs {
        model: Some(tiny("mistral")),
        parallel: ParallelConfig {
            tensor: 1,
            pipeline: 2,
        },
        lora: LoraArgs {
            enable: true,
            ..Default::default()
        },
        ..Default::default()
    });
    let m = format!("{:#}", r.err().unwrap());
    assert!(m.contains("pipeline parallelism are not supported"), "{m}");
}

/// The same on wgpu (Mesa's llvmpipe in CI).
#[cfg(feature = "wgpu")]
#[test]
fn adapters_alone_and_mixed_give_peft_tokens_on_wgpu() {
    alone_and_mixed(BackendKind::Wgpu, &MODELS);
}

/// llama.cpp's GGUF copies of the adapters (`tiny-gguf/lora-*.gguf`, written by
/// `scripts/tiny2gguf.py` as its `convert_lora_to_gguf.py` does: Llama's Q/K rows permuted,
/// Phi-3's fused projections under their GGUF names) give their PEFT originals' tokens, on the
/// HF base and on its GGUF copy, all in one batch with the base.
#[test]
fn gguf_adapters_give_the_tokens_of_their_peft_originals() {
    for backend in BACKENDS {
        for model in ["mistral", "phi3", "gemma3"] {
            let (prompts, outputs) = cases(model);
            let gguf = |n: &str| common::model_path(&format!("tiny-gguf/lora-{n}.gguf"));
            // NOTE: rsLoRA has no GGUF form (llama.cpp's converter drops it).
            let names: Vec<&str> = adapters_of(&outputs)
                .into_iter()
                .filter(|n| !n.ends_with("-rslora"))
                .collect();
            let bases = [
                tiny(model),
                common::model_path(&format!("tiny-gguf/{model}.gguf")),
            ];
            for base in bases {
                let mut llm = LLM::new(EngineArgs {
                    model: Some(base.clone()),
                    backend,
                    block_size: 4,
                    lora: LoraArgs {
                        enable: true,
                        max_loras: names.len(),
                        modules: names
                            .iter()
                            .map(|n| LoraModule {
                                name: n.to_string(),
                                path: gguf(n),
                                base_model_name: None,
                            })
                            .collect(),
                        ..Default::default()
                    },
                    ..Default::default()
                })
                .unwrap();
                let mut reqs = Vec::new();
                let mut wants = Vec::new();
                for (name, want) in &outputs {
                    let lora = match name.as_str() {
                        "base" => None,
                        n if names.contains(&n) => Some(n),
                        _ => continue,
                    };
                    for (p, w) in prompts.iter().zip(want) {
                        reqs.push((p.clone(), lora));
                        wants.push((name, w));
                    }
                }
                let got = run(&mut llm, &reqs);
                for (g, (name, w)) in got.iter().zip(&wants) {
                    assert_eq!(g, *w, "{backend:?} {} with {name}.gguf", base.display());
                }
            }
        }
    }
}

/// A step holds at most `--max-loras` adapters; with 1 the others wait their turn (while the
/// base model's request goes on) and still get their own tokens. The device holds one
/// adapter at a time: each moves in from host memory when its turn comes.
#[test]
fn adapters_beyond_max_loras_wait_and_give_the_same_tokens() {
    let (prompts, outputs) = cases("mistral");
    let names = adapters_of(&outputs);
    let mut llm = engine("mistral", BackendKind::Cpu, &names, 1);
    let e = llm.engine();
    let mut want = std::collections::HashMap::new();
    for (name, w) in outputs.iter().filter(|(n, _)| !n.ends_with("-merged")) {
        let lora = (name != "base").then_some(name.as_str());
        let id = e
            .add_request_with_lora(Prompt::Tokens(prompts[1].clone()), greedy(), lora)
            .unwrap();
        want.insert(id, (name.clone(), w[1].clone()));
    }
    let mut got: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut seen = std::collections::BTreeSet::new();
    while e.has_unfinished() {
        let (running, _) = e.lora_requests();
        assert!(running.len() <= 1, "adapters running at once: {running:?}");
        let on_device: Vec<String> = e
            .loras()
            .into_iter()
            .filter(|l| l.on_device)
            .map(|l| l.name)
            .collect();
        assert!(
            on_device.len() <= 1,
            "adapters on the device: {on_device:?}"
        );
        seen.extend(running);
        for o in e.step().unwrap() {
            got.entry(o.request_id).or_default().extend(o.new_token_ids);
        }
    }
    assert_eq!(seen.len(), names.len(), "every adapter ran: {seen:?}");
    for (id, (name, w)) in want {
        assert_eq!(got[&id], w, "{name}");
    }
}

/// peft's merge_and_unload of mistral-all, served as a plain model, gives the tokens of the
/// adapter served unmerged.
#[test]
fn a_merged_copy_gives_the_tokens_of_the_adapter_unmerged() {
    let (prompts, outputs) = cases("mistral");
    let want = |n: &str| outputs.iter().find(|o| o.0 == n).unwrap().1.clone();
    assert_eq!(want("mistral-all-merged"), want("mistral-all"));
    let mut merged = LLM::new(EngineArgs {
        model: Some(adapter("mistral-all-merged")),
        ..Default::default()
    })
    .unwrap();
    let got = merged.generate(
        &prompts
            .iter()
            .cloned()
            .map(Prompt::Tokens)
            .collect::<Vec<_>>(),
        &greedy(),
    );
    let got: Vec<Vec<u32>> = got
        .unwrap()
        .into_iter()
        .map(|r| r.outputs[0].token_ids.clone())
        .collect();
    assert_eq!(got, want("mistral-all"));
}

/// Loading at run time, unloading while a request uses the adapter (it finishes with it; new
/// requests are refused), and loading again under the same name.
#[test]
fn adapters_load_unload_and_load_again_at_run_time() {
    for backend in BACKENDS {
        let (prompts, outputs) = cases("mistral");
        let want = outputs
            .iter()
            .find(|o| o.0 == "mistral-rslora")
            .unwrap()
            .1
            .clone();
        let mut llm = engine("mistral", backend, &[], 2);
        let e = llm.engine();
        let refused =
            e.add_request_with_lora(Prompt::Tokens(prompts[0].clone()), greedy(), Some("rs"));
        assert!(matches!(refused, Err(RequestError::UnknownLora(n)) if n == "rs"));
        let info = e.load_lora("rs", &adapter("mistral-rslora")).unwrap();
        assert_eq!((info.rank, info.name.as_str()), (8, "rs"));
        assert!(matches!(
            e.load_lora("rs", &adapter("mistral-rslora")),
            Err(LoraError::Exists(_))
        ));
        assert_eq!(
            run(&mut llm, &[(prompts[2].clone(), Some("rs"))])[0],
            want[2]
        );

        // unloaded after its request started: the request ends with the adapter's tokens
        let e = llm.engine();
        let id = e
            .add_request_with_lora(Prompt::Tokens(prompts[1].clone()), greedy(), Some("rs"))
            .unwrap();
        let mut tokens = Vec::new();
        let mut first = true;
        while e.has_unfinished() {
            for o in e.step().unwrap() {
                assert_eq!(o.request_id, id);
                tokens.extend(o.new_token_ids);
            }
            if first {
                e.unload_lora("rs").unwrap();
                assert!(e.loras().is_empty());
                let refused = e.add_request_with_lora(
                    Prompt::Tokens(prompts[0].clone()),
                    greedy(),
                    Some("rs"),
                );
                assert!(matches!(refused, Err(RequestError::UnknownLora(_))));
                first = false;
            }
        }
        assert_eq!(
            tokens, want[1],
            "{backend:?}: the request that outlived its unload"
        );
        assert!(matches!(e.unload_lora("rs"), Err(LoraError::NotFound(_))));

        // loaded again under the same name
        e.load_lora("rs", &adapter("mistral-rslora")).unwrap();
        assert_eq!(
            run(&mut llm, &[(prompts[0].clone(), Some("rs"))])[0],
            want[0]
        );
    }
}

/// What cannot be served is refused with the reason: a rank above --max-lora-rank, a
/// projection the model lacks, no adapter files, LoRA not enabled, modules without it.
#[test]
fn adapters_that_cannot_be_served_are_refused_clearly() {
    let mut llm = LLM::new(EngineArgs {
        model: Some(tiny("mistral")),
        lora: LoraArgs {
            enable: true,
            max_lora_rank: 8,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let e = llm.engine();
    let err = |r: Result<_, LoraError>| {
        r.map(|_: pagoda::engine::LoraInfo| ())
            .unwrap_err()
            .to_string()
    };
    let m = err(e.load_lora("all", &adapter("mistral-all")));
    assert!(
        m.contains("rank 16") && m.contains("--max-lora-rank 8"),
        "{m}"
    );
    let m = err(e.load_lora("phi", &adapter("phi3-all")));
    assert!(m.contains("maps 96 to 64"), "Phi-3's MLP is wider: {m}");
    for (tensor, says) in [
        (
            "model.layers.0.mlp.fc1",
            "`fc1`, which this model has no linear layer for",
        ),
        (
            "model.layers.7.self_attn.q_proj",
            "layer 7, but the model has 3 layers",
        ),
        ("model.embed_tokens", "not in a decoder layer"),
    ] {
        let dir = synthetic_adapter(tensor);
        let m = err(e.load_lora("bad", dir.path()));
        assert!(m.contains(says), "{tensor}: {m}");
    }
    let m = err(e.load_lora("none", &tiny("mistral")));
    assert!(m.contains("adapter_config.json"), "{m}");
    let m = err(e.load_lora("file", &tiny("mistral/model.safetensors")));
    assert!(m.contains("GGUF"), "{m}");
    let gguf = |n: &str| common::model_path(&format!("tiny-gguf/{n}.gguf"));
    for (path, says) in [
        ("mistral", "is a GGUF model, not a LoRA adapter"),
        (
            "lora-phi3-all",
            "is an adapter for `phi3` models, not for this mistral model",
        ),
    ] {
        let m = err(e.load_lora("bad", &gguf(path)));
        assert!(m.contains(says), "{path}: {m}");
    }
    assert!(e.loras().is_empty());

    let mut plain = LLM::new(EngineArgs {
        model: Some(tiny("mistral")),
        ..Default::default()
    })
    .unwrap();
    let r = plain.engine().load_lora("rs", &adapter("mistral-rslora"));
    assert!(matches!(r, Err(LoraError::Disabled)));
    let no_flag = LLM::new(EngineArgs {
        model: Some(tiny("mistral")),
        lora: LoraArgs {
            modules: vec![module("rs", "mistral-rslora")],
            ..Default::default()
        },
        ..Default::default()
    });
    let m = no_flag.err().unwrap().to_string();
    assert!(m.contains("--enable-lora"), "{m}");
    for (model, says) in [
        ("gpt2", "not supported for"),
        ("mixtral", "mixture-of-experts"),
    ] {
        let r = LLM::new(EngineArgs {
            model: Some(tiny(model)),
            lora: LoraArgs {
                enable: true,
                ..Default::default()
            },
            ..Default::default()
        });
        let m = format!("{:#}", r.err().unwrap());
        assert!(
            m.contains(says) && m.contains("--enable-lora"),
            "{model}: {m}"
        );
    }
}

/// An adapter of rank 2 on one module `name` (`[2, 64]` and `[64, 2]` factors of ones).
fn synthetic_adapter(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
        "target_modules": [name.rsplit('.').next().unwrap()], "bias": "none"});
    std::fs::write(dir.path().join("adapter_config.json"), cfg.to_string()).unwrap();
    let ones: Vec<u8> = std::iter::repeat_n(1.0f32.to_le_bytes(), 128)
        .flatten()
        .collect();
    let view = |shape: Vec<usize>| {
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, &ones).unwrap()
    };
    let tensors = [
        (
            format!("base_model.model.{name}.lora_A.weight"),
            view(vec![2, 64]),
        ),
        (
            format!("base_model.model.{name}.lora_B.weight"),
            view(vec![64, 2]),
        ),
    ];
    let bytes = safetensors::serialize(tensors, None).unwrap();
    std::fs::write(dir.path().join("adapter_model.safetensors"), bytes).unwrap();
    dir
}

/// The server: `model` names the base or an adapter (404 for an unknown one), `/v1/models`
/// lists adapters with their parent, and adapters load and unload at run time behind the API
/// key; without --enable-lora the routes say so.
#[test]
fn the_server_serves_adapters_by_model_name_and_loads_them_at_run_time() {
    let (prompts, outputs) = cases("mistral");
    let want = |n: &str| outputs.iter().find(|o| o.0 == n).unwrap().1.clone();
    let key = Some("k");
    let engine = pagoda::Engine::new(EngineArgs {
        model: Some(tiny("mistral")),
        lora: LoraArgs {
            enable: true,
            max_loras: 2,
            modules: vec![module("attn", "mistral-attn")],
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let args = pagoda::server::ServerArgs {
        host: "127.0.0.1".into(),
        port: 0,
        api_key: Some("k".into()),
        ..Default::default()
    };
    let server = pagoda::server::start(engine, args).unwrap();
    let addr = server.addr();
    let complete = |model: &str, p: usize| {
        let body = json!({"model": model, "prompt": prompts[p], "max_tokens": 24,
            "temperature": 0, "ignore_eos": true, "return_token_ids": true});
        post_json(addr, "/v1/completions", key, &body)
    };
    let tokens = |r: server_util::HttpResponse| -> Vec<u32> {
        assert_eq!(r.status, 200, "{}", r.text());
        ids(&r.json()["choices"][0]["token_ids"])
    };
    let base = tiny("mistral")
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    let models = get(addr, "/v1/models", key).json();
    let cards: Vec<(String, serde_json::Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["id"].as_str().unwrap().to_string(), c["parent"].clone()))
        .collect();
    assert_eq!(
        cards,
        vec![(base.clone(), json!(null)), ("attn".into(), json!(base))]
    );
    assert_eq!(tokens(complete("attn", 2)), want("mistral-attn")[2]);
    assert_eq!(tokens(complete(&base, 2)), want("base")[2]);
    assert_eq!(complete("rs", 0).status, 404);

    let load = json!({"lora_name": "rs", "lora_path": adapter("mistral-rslora")});
    assert_eq!(
        post_json(addr, "/v1/load_lora_adapter", None, &load).status,
        401
    );
    let r = post_json(addr, "/v1/load_lora_adapter", key, &load);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(tokens(complete("rs", 1)), want("mistral-rslora")[1]);
    let again = post_json(addr, "/v1/load_lora_adapter", key, &load);
    assert_eq!(again.status, 400, "{}", again.text());
    let big = json!({"lora_name": "big", "lora_path": adapter("phi3-all")});
    let r = post_json(addr, "/v1/load_lora_adapter", key, &big);
    assert!(
        r.status == 400 && r.text().contains("maps 96 to 64"),
        "{}",
        r.text()
    );
    let unload = json!({"lora_name": "rs"});
    assert_eq!(
        post_json(addr, "/v1/unload_lora_adapter", key, &unload).status,
        200
    );
    assert_eq!(complete("rs", 1).status, 404);
    assert_eq!(
        post_json(addr, "/v1/unload_lora_adapter", key, &unload).status,
        404
    );
    let ids: Vec<String> = get(addr, "/v1/models", key).json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, vec![base, "attn".to_string()]);
    let metrics = get(addr, "/metrics", None).text();
    assert!(
        metrics.contains("max_lora=\"2\",running_lora_adapters=\"\""),
        "{metrics}"
    );
    server.shutdown().unwrap();

    let plain = server_util::start(tiny("mistral"), 16, Default::default());
    let r = post_json(plain.addr(), "/v1/load_lora_adapter", None, &load);
    assert!(
        r.status == 404 && r.text().contains("--enable-lora"),
        "{}",
        r.text()
    );
    plain.shutdown().unwrap();
}

/// An adapter unloaded while its request runs keeps its slot until the request ends: one
/// loaded right after takes another, and both requests get their own tokens.
#[test]
fn an_adapter_loaded_while_an_unloaded_one_drains_gets_its_own_slot() {
    let (prompts, outputs) = cases("mistral");
    let want = |n: &str| outputs.iter().find(|o| o.0 == n).unwrap().1.clone();
    let mut llm = engine("mistral", BackendKind::Cpu, &["mistral-attn"], 2);
    let e = llm.engine();
    let a = e
        .add_request_with_lora(
            Prompt::Tokens(prompts[2].clone()),
            greedy(),
            Some("mistral-attn"),
        )
        .unwrap();
    let mut got: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut b = None;
    while e.has_unfinished() {
        for o in e.step().unwrap() {
            got.entry(o.request_id).or_default().extend(o.new_token_ids);
        }
        if b.is_none() {
            e.unload_lora("mistral-attn").unwrap();
            e.load_lora("rs", &adapter("mistral-rslora")).unwrap();
            let id =
                e.add_request_with_lora(Prompt::Tokens(prompts[2].clone()), greedy(), Some("rs"));
            b = Some(id.unwrap());
        }
    }
    assert_eq!(got[&a], want("mistral-attn")[2]);
    assert_eq!(got[&b.unwrap()], want("mistral-rslora")[2]);
}
