//! Embeddings and scores (`--task embed`, `--task score`) on tiny random-weight models against
//! the references sentence-transformers and transformers computed for them
//! (`scripts/make-tiny-pooling.py`, `tests/data/tiny/pooling/references.json`): every pooling
//! mode, Normalize, Matryoshka cuts, a cross-encoder and a decoder reranker, on the CPU, the
//! emulated GPU and (built with `--features wgpu`) wgpu, in one batch, in chunks, and through the
//! HTTP routes.

use pagoda::engine::{PoolingParams, Prompt};
use pagoda::models::pooling::Task;
use pagoda::{BackendKind, EngineArgs, LLM, WeightDtype};
use serde_json::Value;
use std::path::PathBuf;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tiny/pooling")
        .join(name)
}

fn refs() -> Value {
    let text = std::fs::read_to_string(dir("references.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn args(name: &str, task: Task, backend: BackendKind) -> EngineArgs {
    EngineArgs {
        model: Some(dir(name)),
        backend,
        dtype: WeightDtype::Fixed(pagoda::tensor::DType::F32),
        task,
        kv_budget: Some(pagoda::engine::KvBudget::Bytes(16 << 20)),
        ..Default::default()
    }
}

/// `got` agrees with `want`: cosine above 0.9999 and every value within 1e-4.
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let cos = pagoda::engine::cosine(got, want);
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        cos > 0.9999 && worst < 1e-4,
        "{what}: cosine {cos}, largest difference {worst}"
    );
}

/// Every text embedded at once, as the reference made them, token ids first.
fn check_embeddings(name: &str, backend: BackendKind, max_batched: Option<usize>) {
    let r = refs();
    let m = &r["models"][name];
    let texts = strings(&r["texts"]);
    let mut a = args(name, Task::Embed, backend);
    a.max_num_batched_tokens = max_batched;
    let mut llm = LLM::new(a).unwrap();
    let out = llm.embed(&texts, &PoolingParams::default()).unwrap();
    for (i, o) in out.iter().enumerate() {
        assert_eq!(
            o.prompt_token_ids,
            ids(&m["token_ids"][i]),
            "{name}: tokens of text {i}"
        );
        let what = format!("{name} on {backend:?}: text {i}");
        assert_close(&o.data, &floats(&m["embeddings"][i]), &what);
    }
}

#[test]
fn embeddings_agree_with_sentence_transformers_in_each_pooling_mode() {
    for name in ["embed-mean", "embed-cls", "embed-last"] {
        check_embeddings(name, BackendKind::Cpu, None);
    }
}

#[test]
fn embeddings_agree_on_the_emulated_gpu() {
    for name in ["embed-mean", "embed-last"] {
        check_embeddings(name, BackendKind::Emu, None);
    }
}

/// wgpu (Mesa's llvmpipe in CI): the same rows, pooled the same way.
#[cfg(feature = "wgpu")]
#[test]
fn embeddings_and_scores_agree_on_wgpu() {
    check_embeddings("embed-mean", BackendKind::Wgpu, None);
    let r = refs();
    let docs = strings(&r["documents"]);
    let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
    let mut llm = LLM::new(args("rerank-tokens", Task::Score, BackendKind::Wgpu)).unwrap();
    let got = llm.score(r["query"].as_str().unwrap(), &docs).unwrap();
    let want = floats(&r["models"]["rerank-tokens"]["scores"]);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
}

/// A budget of 7 tokens a step cuts every prompt into chunks (mean pooling adds the rows of
/// several steps) and mixes the requests' chunks in one step.
#[test]
fn embeddings_of_prompts_computed_in_chunks_are_the_same() {
    for name in ["embed-mean", "embed-last", "embed-cls"] {
        check_embeddings(name, BackendKind::Cpu, Some(7));
    }
}

#[test]
fn matryoshka_dimensions_cut_then_normalize() {
    let r = refs();
    let texts = strings(&r["texts"]);
    let mut llm = LLM::new(args("embed-last", Task::Embed, BackendKind::Cpu)).unwrap();
    let params = PoolingParams {
        dimensions: Some(16),
        ..Default::default()
    };
    let out = llm.embed(&texts, &params).unwrap();
    for (i, o) in out.iter().enumerate() {
        let want = floats(&r["models"]["embed-last"]["embeddings_16"][i]);
        assert_close(&o.data, &want, &format!("16 dimensions of text {i}"));
    }
    for bad in [0, 33] {
        let p = PoolingParams {
            dimensions: Some(bad),
            ..Default::default()
        };
        let e = format!("{:#}", llm.embed(&texts[..1], &p).unwrap_err());
        assert!(e.contains("dimensions must be between 1 and 32"), "{e}");
    }
    // a model without Matryoshka training refuses a cut
    let mut llm = LLM::new(args("embed-mean", Task::Embed, BackendKind::Cpu)).unwrap();
    let e = format!("{:#}", llm.embed(&texts[..1], &params).unwrap_err());
    assert!(e.contains("does not support Matryoshka"), "{e}");
}

#[test]
fn rerankers_agree_with_transformers() {
    let r = refs();
    let query = r["query"].as_str().unwrap();
    let docs = strings(&r["documents"]);
    let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
    for name in ["rerank-cls", "rerank-tokens"] {
        for backend in [BackendKind::Cpu, BackendKind::Emu] {
            let mut llm = LLM::new(args(name, Task::Score, backend)).unwrap();
            let got = llm.score(query, &docs).unwrap();
            let want = floats(&r["models"][name]["scores"]);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() < 1e-5,
                    "{name} on {backend:?}: {got:?} vs {want:?}"
                );
            }
        }
    }
}

/// The pair's token ids are the ones transformers' tokenizer(query, document) gives.
#[test]
fn score_pairs_are_tokenized_as_transformers_does() {
    let r = refs();
    let query = r["query"].as_str().unwrap();
    for name in ["rerank-cls", "rerank-tokens"] {
        let mut llm = LLM::new(args(name, Task::Score, BackendKind::Cpu)).unwrap();
        let tok = llm.engine().tokenizer().clone();
        for (i, d) in strings(&r["documents"]).iter().enumerate() {
            let got = tok.encode_pair(query, d).unwrap();
            assert_eq!(
                got,
                ids(&r["models"][name]["token_ids"][i]),
                "{name}: pair {i}"
            );
        }
    }
}

#[test]
fn embedding_models_score_with_the_cosine() {
    let r = refs();
    let texts = strings(&r["texts"]);
    let mut llm = LLM::new(args("embed-mean", Task::Embed, BackendKind::Cpu)).unwrap();
    let docs: Vec<&str> = texts[1..].iter().map(String::as_str).collect();
    let got = llm.score(&texts[0], &docs).unwrap();
    let e = |i: usize| floats(&r["models"]["embed-mean"]["embeddings"][i]);
    for (k, g) in got.iter().enumerate() {
        let want = pagoda::engine::cosine(&e(0), &e(k + 1));
        assert!((g - want).abs() < 1e-4, "pair {k}: {g} vs {want}");
    }
}

#[test]
fn refusals_name_what_is_wrong() {
    let err = |a: EngineArgs| match LLM::new(a) {
        Ok(_) => panic!("the engine started"),
        Err(e) => format!("{e:#}"),
    };
    // no classifier in an embedding checkpoint
    let e = err(args("embed-mean", Task::Score, BackendKind::Cpu));
    assert!(e.contains("needs a classifier"), "{e}");
    let mut a = args("embed-mean", Task::Generate, BackendKind::Cpu);
    a.pooling_type = Some(pagoda::models::pooling::PoolingType::Mean);
    assert!(err(a).contains("--pooling-type"));
    let mut a = args("rerank-tokens", Task::Score, BackendKind::Cpu);
    a.classifier_from_token = Some(vec!["no such token at all".into()]);
    assert!(err(a).contains("is not one token"));

    let mut llm = LLM::new(args("embed-last", Task::Embed, BackendKind::Cpu)).unwrap();
    // generation on an embedding model
    let e = format!(
        "{:#}",
        llm.generate(&["hi"], &pagoda::SamplingParams::greedy())
            .unwrap_err()
    );
    assert!(e.contains("served for embeddings"), "{e}");
    // over the context: refused, unless truncated to the last tokens
    let long = vec![5u32; 200];
    let e = format!(
        "{:#}",
        llm.embed(&[Prompt::Tokens(long.clone())], &PoolingParams::default())
            .unwrap_err()
    );
    assert!(e.contains("maximum context length is 128"), "{e}");
    let mut tail = vec![7u32; 100];
    tail.extend([9, 11, 13]);
    let mut long = vec![5u32; 200];
    long.extend(&tail);
    let p = PoolingParams {
        truncate_prompt_tokens: Some(103),
        ..Default::default()
    };
    let cut = llm.embed(&[Prompt::Tokens(long)], &p).unwrap();
    let whole = llm
        .embed(&[Prompt::Tokens(tail.clone())], &PoolingParams::default())
        .unwrap();
    assert_eq!(cut[0].prompt_token_ids, tail);
    assert_eq!(cut[0].data, whole[0].data);
    // a prompt filling the whole context is embedded (nothing is generated after it)
    let full = llm
        .embed(
            &[Prompt::Tokens(vec![5u32; 128])],
            &PoolingParams::default(),
        )
        .unwrap();
    assert_eq!(full[0].data.len(), 32);
}

mod server_util;

fn serve(name: &str, task: Task) -> pagoda::server::ServerHandle {
    let engine = pagoda::Engine::new(args(name, task, BackendKind::Cpu)).unwrap();
    let server = pagoda::server::ServerArgs {
        host: "127.0.0.1".into(),
        port: 0,
        ..Default::default()
    };
    pagoda::server::start(engine, server).unwrap()
}

#[test]
fn the_embeddings_route_answers_as_openai() {
    use base64::Engine as _;
    let r = refs();
    let m = &r["models"]["embed-mean"];
    let texts = strings(&r["texts"]);
    let server = serve("embed-mean", Task::Embed);
    let addr = server.addr();
    let post = |body: Value| server_util::post_json(addr, "/v1/embeddings", None, &body);
    let a = post(serde_json::json!({"input": texts, "encoding_format": "float"}));
    assert_eq!(a.status, 200, "{}", a.text());
    let a = a.json();
    let n: u64 = (0..4).map(|i| ids(&m["token_ids"][i]).len() as u64).sum();
    assert_eq!(a["usage"]["prompt_tokens"], n);
    for i in 0..4 {
        assert_eq!(a["data"][i]["index"], i);
        let got = floats(&a["data"][i]["embedding"]);
        assert_close(&got, &floats(&m["embeddings"][i]), &format!("text {i}"));
    }
    // base64: the little-endian f32 bytes; token ids as input
    let b =
        post(serde_json::json!({"input": [ids(&m["token_ids"][1])], "encoding_format": "base64"}));
    assert_eq!(b.status, 200, "{}", b.text());
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b.json()["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let got: Vec<f32> = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_close(&got, &floats(&m["embeddings"][1]), "base64");
    for (body, param) in [
        (
            serde_json::json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (serde_json::json!({"input": [[]]}), "input"),
        (
            serde_json::json!({"input": "a", "dimensions": 8}),
            "dimensions",
        ),
        (
            serde_json::json!({"input": "a", "truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
        ),
    ] {
        let e = post(body.clone());
        assert_eq!(e.status, 400, "{body}: {}", e.text());
        assert_eq!(e.json()["error"]["param"], param, "{body}");
    }
    // the generating routes and the score routes say what this model is served for
    let e = server_util::post_json(
        addr,
        "/v1/completions",
        None,
        &serde_json::json!({"prompt": "a"}),
    );
    assert_eq!(e.status, 400);
    assert!(e.text().contains("served for embeddings"), "{}", e.text());
}

#[test]
fn the_rerank_and_score_routes_rank_as_the_reference() {
    let r = refs();
    let query = r["query"].as_str().unwrap();
    let docs = strings(&r["documents"]);
    for name in ["rerank-cls", "rerank-tokens"] {
        let want = floats(&r["models"][name]["scores"]);
        let server = serve(name, Task::Score);
        let addr = server.addr();
        let body = serde_json::json!({
            "query": query,
            "documents": [docs[0], {"text": docs[1]}, docs[2]],
            "top_n": 2,
        });
        let a = server_util::post_json(addr, "/v1/rerank", None, &body);
        assert_eq!(a.status, 200, "{}", a.text());
        let results = a.json()["results"].as_array().unwrap().clone();
        let mut order: Vec<usize> = (0..3).collect();
        order.sort_by(|&x, &y| want[y].total_cmp(&want[x]));
        assert_eq!(results.len(), 2);
        for (k, res) in results.iter().enumerate() {
            let i = order[k];
            assert_eq!(res["index"], i, "{name}: rank {k}");
            assert_eq!(res["document"]["text"], docs[i].as_str());
            let s = res["relevance_score"].as_f64().unwrap() as f32;
            assert!((s - want[i]).abs() < 1e-5, "{name}: {s} vs {}", want[i]);
        }
        let body = serde_json::json!({"text_1": query, "text_2": docs});
        let s = server_util::post_json(addr, "/v1/score", None, &body);
        assert_eq!(s.status, 200, "{}", s.text());
        let data = s.json()["data"].as_array().unwrap().clone();
        for (i, d) in data.iter().enumerate() {
            let got = d["score"].as_f64().unwrap() as f32;
            assert!((got - want[i]).abs() < 1e-5, "{name}: score {i}");
        }
        let bad = serde_json::json!({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]});
        let e = server_util::post_json(addr, "/v1/score", None, &bad);
        assert_eq!(e.status, 400, "{}", e.text());
        let e = server_util::post_json(
            addr,
            "/v1/embeddings",
            None,
            &serde_json::json!({"input": "a"}),
        );
        assert_eq!(e.status, 400);
        assert!(e.text().contains("--task embed"), "{}", e.text());
    }
}
