//! The tokenizer of the real SmolLM2-135M-Instruct HF directory (made by
//! `scripts/fetch-models.sh` under `$PAGODA_CACHE/models`, default `~/.cache/pagoda/models`)
//! against the golden file: chat template, encoding, decoding and streamed decoding.

use std::sync::Arc;

use pagoda::sampling::IncrementalDetokenizer;
use pagoda::tokenizer::{ChatMessage, Tokenizer};
use serde_json::Value;

mod common;

use common::{SMOL_HF, golden, ids, model_path};

fn smol() -> Tokenizer {
    let dir = model_path(SMOL_HF);
    Tokenizer::from_hf_dir(&dir).unwrap_or_else(|e| panic!("{e:#}"))
}

fn entries<'a>(golden: &'a Value, kind: Option<&str>) -> Vec<&'a Value> {
    let all = golden["entries"]
        .as_array()
        .expect("golden entries are an array");
    let picked: Vec<&Value> = all
        .iter()
        .filter(|e| e["model"] == SMOL_HF && kind.is_none_or(|k| e["kind"] == k))
        .collect();
    assert!(!picked.is_empty(), "no {kind:?} entries for {SMOL_HF}");
    picked
}

#[test]
fn chat_template_and_encoding_match_golden_prompts() {
    let tok = smol();
    assert!(tok.has_chat_template());
    let golden = golden();
    for e in entries(&golden, Some("chat")) {
        let name = e["name"].as_str().unwrap_or("?");
        let messages: Vec<ChatMessage> =
            serde_json::from_value(e["messages"].clone()).expect("messages are {role, content}");
        let prompt = tok
            .apply_chat_template(&messages, true)
            .unwrap_or_else(|err| panic!("{name}: {err:#}"));
        let want = e["prompt"].as_str().expect("prompt is a string");
        assert_eq!(prompt, want, "{name}: rendered prompt");
        assert_eq!(
            tok.encode(&prompt).unwrap(),
            ids(&e["prompt_ids"]),
            "{name}: prompt ids"
        );
    }
}

#[test]
fn special_token_ids_match_golden() {
    let tok = smol();
    let golden = golden();
    let model = &golden["models"][SMOL_HF];
    assert_eq!(
        tok.bos_token_id().map(u64::from),
        model["bos_token_id"].as_u64()
    );
    assert_eq!(
        tok.eos_token_id().map(u64::from),
        model["eos_token_id"].as_u64()
    );
    assert_eq!(
        tok.add_bos_token(),
        model["add_bos_token"].as_bool().unwrap()
    );
    assert_eq!(
        tok.vocab_size() as u64,
        model["config"]["vocab_size"].as_u64().unwrap()
    );
}

#[test]
fn all_prompts_encode_and_outputs_decode_and_stream() {
    let tok = Arc::new(smol());
    let golden = golden();
    for e in entries(&golden, None) {
        let name = e["name"].as_str().unwrap_or("?");
        let prompt = e["prompt"].as_str().expect("prompt is a string");
        let prompt_ids = ids(&e["prompt_ids"]);
        assert_eq!(
            tok.encode(prompt).unwrap(),
            prompt_ids,
            "{name}: prompt ids"
        );
        assert_eq!(
            tok.decode(&prompt_ids, false).unwrap(),
            prompt,
            "{name}: round trip"
        );

        let generated = ids(&e["generated_ids"]);
        let text = e["generated_text"]
            .as_str()
            .expect("generated_text is a string");
        assert_eq!(
            tok.decode(&generated, false).unwrap(),
            text,
            "{name}: decode"
        );
        // Streamed token by token (special tokens kept, like generated_text).
        let mut detok = IncrementalDetokenizer::new(tok.clone(), &prompt_ids, false);
        let streamed: String = generated.iter().map(|&t| detok.push(t).unwrap()).collect();
        assert_eq!(streamed, text, "{name}: streamed");
    }
}
