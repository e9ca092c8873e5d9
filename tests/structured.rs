//! Structured output end to end on SmolLM2: every output matches its constraint (JSON schema,
//! regex, choice, Lark grammar), greedy and sampled, alone and batched with unconstrained
//! requests; a constraint that does not compile is refused before anything is queued.

mod common;

use common::*;
use pagoda::sampling::StructuredOutput;
use pagoda::tokenizer::ChatMessage;
use pagoda::{EngineArgs, LLM, Prompt, SamplingParams};
use serde_json::{Value, json};

fn llm() -> LLM {
    LLM::new(EngineArgs {
        model: Some(model_path(SMOL_GGUF)),
        max_model_len: Some(1024),
        ..Default::default()
    })
    .expect("the model loads")
}

fn constrained(c: StructuredOutput, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        structured: Some(c),
        ..SamplingParams::greedy()
    }
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    })
}

/// Checks `v` against [`person_schema`] by hand.
fn is_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    o.len() == 2
        && o["name"].as_str().is_some_and(|s| s.chars().count() <= 20)
        && o["age"].as_u64().is_some_and(|a| a <= 150)
}

/// Whether JSON text is laid out as Python's `json.dumps` writes it: outside strings, no
/// whitespace but one space after `,` and `:`.
fn dumps_layout(text: &str) -> bool {
    let (mut in_string, mut escaped, mut prev) = (false, false, ' ');
    for c in text.chars() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if c.is_whitespace() && !(c == ' ' && matches!(prev, ',' | ':')) {
            return false;
        }
        prev = c;
    }
    !in_string
}

#[test]
fn json_schema_regex_choice_and_grammar() {
    let mut llm = llm();
    let prompt = llm
        .engine()
        .apply_chat_template(&[ChatMessage::new(
            "user",
            "Give me a JSON object describing a person, with a name and an age.",
        )])
        .unwrap();
    // JSON schema, greedy and sampled (several seeds and n = 3).
    let greedy = constrained(StructuredOutput::Json(person_schema()), 80);
    let sampled = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        n: 3,
        ..greedy.clone()
    };
    for params in [greedy.clone(), sampled] {
        let out = llm.generate(&[prompt.as_str()], &params).unwrap();
        for c in &out[0].outputs {
            let v: Value = serde_json::from_str(&c.text)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", c.text));
            assert!(is_person(&v), "{v}");
            assert!(dumps_layout(&c.text), "{:?}", c.text);
            assert_eq!(c.finish_reason.map(|f| f.as_str()), Some("stop"));
        }
    }
    // Any JSON object.
    let out = llm
        .generate(
            &[prompt.as_str()],
            &constrained(StructuredOutput::JsonObject, 80),
        )
        .unwrap();
    let text = &out[0].outputs[0].text;
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert!(v.is_object(), "{v}");
    // NOTE: with free whitespace, this model padded the object with newlines until max_tokens.
    assert!(dumps_layout(text), "{text:?}");
    assert_eq!(
        out[0].outputs[0].finish_reason.map(|f| f.as_str()),
        Some("stop")
    );
    assert!(!dumps_layout("{\n\"a\": 1}") && !dumps_layout("{\"a\" : 1}"));
    assert!(dumps_layout("{\"a b\": [1, \"x\\\" y\"]}"));
    // A regex: a phone number, whole.
    let out = llm
        .generate(
            &["My phone number is"],
            &constrained(StructuredOutput::Regex("[0-9]{3}-[0-9]{4}".into()), 20),
        )
        .unwrap();
    let t = &out[0].outputs[0].text;
    let b = t.as_bytes();
    assert!(
        b.len() == 8
            && b[3] == b'-'
            && b.iter()
                .enumerate()
                .all(|(i, c)| i == 3 || c.is_ascii_digit()),
        "{t:?}"
    );
    // A choice, and the same choice as a Lark grammar.
    let choices = vec!["Paris".to_string(), "London".into(), "Berlin".into()];
    for c in [
        StructuredOutput::Choice(choices.clone()),
        StructuredOutput::Grammar(r#"start: "Paris" | "London" | "Berlin""#.into()),
    ] {
        let out = llm
            .generate(&["The capital of France is "], &constrained(c, 10))
            .unwrap();
        assert_eq!(out[0].outputs[0].text, "Paris");
    }
}

/// A constrained greedy request gives the same output alone and batched with others, and the
/// others are unchanged by it.
#[test]
fn constrained_output_is_batch_invariant() {
    let mut llm = llm();
    let c = constrained(StructuredOutput::Json(person_schema()), 60);
    let free = SamplingParams {
        max_tokens: Some(12),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let p = "A person, as JSON:";
    let alone = llm.generate(&[p], &c).unwrap();
    let free_alone = llm.generate(&["Once upon a time"], &free).unwrap();
    let mixed = llm
        .generate_each(vec![
            (Prompt::from("Once upon a time"), free.clone()),
            (Prompt::from(p), c.clone()),
            (Prompt::from("The weather today"), free.clone()),
        ])
        .unwrap();
    assert_eq!(mixed[1].outputs[0].text, alone[0].outputs[0].text);
    assert_eq!(mixed[0].outputs[0].text, free_alone[0].outputs[0].text);
}

#[test]
fn constraints_that_do_not_compile_are_refused() {
    let mut llm = llm();
    for c in [
        StructuredOutput::Regex("(unclosed".into()),
        StructuredOutput::Grammar("start: undefined_rule".into()),
        StructuredOutput::Json(json!({"type": "no-such-type"})),
        StructuredOutput::Choice(vec![]),
    ] {
        let e = llm
            .engine()
            .add_request(Prompt::from("x"), constrained(c.clone(), 5))
            .expect_err(&format!("{c:?} should be refused"));
        match e {
            pagoda::engine::RequestError::InvalidParam(p) => {
                assert_eq!(p.param, "structured_outputs", "{c:?}")
            }
            other => panic!("{c:?}: {other:?}"),
        }
    }
    assert!(!llm.engine().has_unfinished());
}
