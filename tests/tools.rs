//! Tool calling on Qwen2.5-Coder-0.5B (whose chat template renders tools): the template's
//! rendering of tools, calls and tool answers against transformers' (the golden file made by
//! scripts/make-tool-template-golden.py), and `/v1/chat/completions` with `tool_choice`
//! required, named and auto (the Hermes parser), streamed and not, and a conversation that
//! carries the calls and their answers back.

mod common;
mod server_util;

use common::{QWEN_GGUF, model_path};
use pagoda::server::tools::ToolCallParser;
use pagoda::server::{ServerArgs, ServerHandle};
use pagoda::tokenizer::ChatMessage;
use serde_json::{Value, json};
use server_util::*;
use std::net::SocketAddr;
use std::sync::OnceLock;

#[test]
fn qwen_template_renders_tools_as_transformers_does() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/golden/qwen_tools.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let model = pagoda::models::load_model(&model_path(QWEN_GGUF)).unwrap();
    let messages: Vec<ChatMessage> = serde_json::from_value(golden["messages"].clone()).unwrap();
    let tools = golden["tools"].as_array().unwrap();
    let prompt = model
        .tokenizer
        .apply_chat_template_with_tools(&messages, true, Some(tools))
        .unwrap();
    assert_eq!(prompt, golden["prompt"].as_str().unwrap());
}

fn server() -> SocketAddr {
    static SERVER: OnceLock<ServerHandle> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            start(
                model_path(QWEN_GGUF),
                64,
                ServerArgs {
                    tool_call_parser: Some(ToolCallParser::Hermes),
                    ..ServerArgs::default()
                },
            )
        })
        .addr()
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": false
            }
        }},
        {"type": "function", "function": {"name": "get_time", "description": "The current time"}}
    ])
}

fn ask(tool_choice: Value, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": "What is the weather like in Paris right now?"}],
        "tools": weather_tools(),
        "tool_choice": tool_choice,
        "max_tokens": 60,
        "temperature": 0,
        "stream": stream,
    })
}

fn post(body: &Value) -> Value {
    let r = post_json(server(), "/v1/chat/completions", None, body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// The calls of a streamed response, assembled as a client does: by index, the first piece
/// with the id and name, then the arguments in order.
fn streamed_calls(body: &Value) -> (Vec<Value>, String, Option<String>) {
    let events = Sse::open(server(), "/v1/chat/completions", &[], body).all();
    let mut calls: Vec<Value> = Vec::new();
    let mut content = String::new();
    let mut finish = None;
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            if let Some(t) = c["delta"]["content"].as_str() {
                content.push_str(t);
            }
            for d in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                let i = d["index"].as_u64().unwrap() as usize;
                if i == calls.len() {
                    assert!(d["id"].as_str().unwrap().starts_with("call_"), "{d}");
                    assert_eq!(d["type"], "function");
                    calls.push(
                        json!({"id": d["id"], "name": d["function"]["name"], "arguments": ""}),
                    );
                }
                let args = format!(
                    "{}{}",
                    calls[i]["arguments"].as_str().unwrap(),
                    d["function"]["arguments"].as_str().unwrap_or("")
                );
                calls[i]["arguments"] = Value::from(args);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (calls, content, finish)
}

fn city_of(arguments: &str) -> String {
    let v: Value = serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{e}: {arguments}"));
    v["city"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string()
}

#[test]
fn required_and_named_tool_choices_always_parse() {
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        let v = post(&ask(choice.clone(), false));
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        assert!(c["message"]["content"].is_null(), "{v}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty());
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["function"]["name"], "get_weather", "{v}");
        let city = city_of(calls[0]["function"]["arguments"].as_str().unwrap());
        assert!(city.contains("Paris"), "{city}");
        // Streamed: the same calls.
        let (streamed, content, finish) = streamed_calls(&ask(choice, true));
        assert_eq!(finish.as_deref(), Some("tool_calls"));
        assert!(content.is_empty(), "{content:?}");
        assert_eq!(streamed.len(), calls.len());
        for (s, c) in streamed.iter().zip(calls) {
            assert_eq!(s["name"], c["function"]["name"]);
            assert_eq!(s["arguments"], c["function"]["arguments"]);
        }
    }
}

#[test]
fn auto_parses_what_the_model_writes_and_the_answers_go_back() {
    let v = post(&ask(json!("auto"), false));
    let c = &v["choices"][0];
    // NOTE: greedy Qwen2.5-Coder calls the weather tool here, in its own <tool_call> format.
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    let call = &c["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather", "{v}");
    let args = call["function"]["arguments"].as_str().unwrap().to_string();
    assert!(city_of(&args).contains("Paris"));
    let (streamed, _, finish) = streamed_calls(&ask(json!("auto"), true));
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(streamed[0]["arguments"].as_str().unwrap(), args);
    // The call and the tool's answer, sent back: the model answers in text.
    let body = json!({
        "messages": [
            {"role": "user", "content": "What is the weather like in Paris right now?"},
            {"role": "assistant", "content": null, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "{\"temperature_c\": 21, \"sky\": \"sunny\"}"}
        ],
        "tools": weather_tools(),
        "max_tokens": 40,
        "temperature": 0,
    });
    let v = post(&body);
    let c = &v["choices"][0];
    assert!(c["message"]["tool_calls"].is_null(), "{v}");
    let text = c["message"]["content"].as_str().unwrap();
    assert!(
        text.contains("21") || text.to_lowercase().contains("sunny"),
        "{text:?}"
    );
    // tool_choice none: no parsing, plain content.
    let v = post(&ask(json!("none"), false));
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string());
}

#[test]
fn bad_tools_and_choices_are_400s() {
    let base = ask(json!("required"), false);
    for (field, value) in [
        ("tools", json!([{"type": "function", "function": {}}])),
        ("tools", json!([{"type": "code_interpreter"}])),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "missing"}}),
        ),
        ("tool_choice", json!("sometimes")),
    ] {
        let mut body = base.clone();
        body[field] = value;
        let r = post_json(server(), "/v1/chat/completions", None, &body);
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.json()["error"]["param"], field);
    }
    let mut body = base.clone();
    body["response_format"] = json!({"type": "json_object"});
    let r = post_json(server(), "/v1/chat/completions", None, &body);
    assert_eq!(r.status, 400, "{}", r.text());
}

/// Qwen2.5-Coder's FIM token ids (its vocabulary's `<|fim_prefix|>`, ...).
const FIM_PREFIX: u64 = 151659;
const FIM_MIDDLE: u64 = 151660;
const FIM_SUFFIX: u64 = 151661;
const REPO_NAME: u64 = 151663;
const FILE_SEP: u64 = 151664;

const PREFIX: &str = "def fibonacci(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n";
const SUFFIX: &str = "\n\nprint(fibonacci(10))\n";

fn ids_of(text: &str) -> Vec<u64> {
    let r = post_json(
        server(),
        "/tokenize",
        None,
        &json!({"prompt": text, "add_special_tokens": false}),
    );
    r.json()["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// OpenAI's `suffix`: the prompt is PRE prefix SUF suffix MID, as llama.cpp lays it out (no
/// BOS: Qwen adds none), and the middle it writes is code.
#[test]
fn suffix_fills_in_the_middle() {
    let r = post_json(
        server(),
        "/v1/completions",
        None,
        &json!({"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 40, "temperature": 0,
                "return_token_ids": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let c = &v["choices"][0];
    let want: Vec<u64> = [
        vec![FIM_PREFIX],
        ids_of(PREFIX),
        vec![FIM_SUFFIX],
        ids_of(SUFFIX),
        vec![FIM_MIDDLE],
    ]
    .concat();
    assert_eq!(c["prompt_token_ids"], json!(want));
    let middle = c["text"].as_str().unwrap();
    eprintln!("middle: {middle:?}");
    assert!(middle.contains("return"), "{middle:?}");
    // Token ids as the prompt cannot carry a suffix (it needs the prefix's text).
    let r = post_json(
        server(),
        "/v1/completions",
        None,
        &json!({"prompt": [1, 2, 3], "suffix": SUFFIX, "max_tokens": 4}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "suffix");
}

/// llama.cpp's `/infill`: the project's other files first, then the file edited; its answer
/// and its stream agree; a context too small for everything cuts the project first.
#[test]
fn infill_lays_out_the_project_as_llama_cpp() {
    let util = "def add(a, b):\n    return a + b\n";
    let body = json!({
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "    if",
        "input_extra": [{"filename": "util.py", "text": util}],
        "n_predict": 40, "temperature": 0, "return_tokens": true, "cache_prompt": true,
    });
    let r = post_json(server(), "/infill", None, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let layout = [
        vec![REPO_NAME],
        ids_of("myproject\n"),
        vec![FILE_SEP],
        ids_of("util.py\n"),
        ids_of(util),
        vec![FILE_SEP],
        ids_of("filename\n"),
        vec![FIM_PREFIX],
        ids_of(PREFIX),
        ids_of("    if"),
        vec![FIM_SUFFIX],
        ids_of(SUFFIX),
        vec![FIM_MIDDLE],
    ]
    .concat();
    assert_eq!(v["tokens_evaluated"], layout.len(), "{v}");
    assert_eq!((&v["stop"], &v["truncated"]), (&json!(true), &json!(false)));
    let content = v["content"].as_str().unwrap();
    eprintln!("infill: {content:?}");
    assert!(!content.is_empty());
    assert_eq!(
        v["tokens"].as_array().unwrap().len(),
        v["tokens_predicted"].as_u64().unwrap() as usize
    );
    assert!(
        ["eos", "limit", "word"].contains(&v["stop_type"].as_str().unwrap()),
        "{v}"
    );
    // The stream: content pieces with stop false, then one with stop true; no [DONE].
    let mut b = body.clone();
    b["stream"] = json!(true);
    let events = Sse::open(server(), "/infill", &[], &b).all();
    let (last, pieces) = events.split_last().unwrap();
    let mut text = String::new();
    for e in pieces {
        let p: Value = serde_json::from_str(e).unwrap();
        assert_eq!(p["stop"], false, "{p}");
        text.push_str(p["content"].as_str().unwrap());
    }
    let last: Value = serde_json::from_str(last).unwrap();
    assert_eq!(last["stop"], true);
    text.push_str(last["content"].as_str().unwrap());
    assert_eq!(text, content);
    assert_eq!(last["tokens_predicted"], v["tokens_predicted"]);

    // Room for all but 5 tokens of the prompt (n_predict takes the rest of the context): the
    // project loses its first 5, the file edited is whole.
    let models = get(server(), "/v1/models", None).json();
    let context = models["data"][0]["max_model_len"].as_u64().unwrap() as usize;
    let mut b = body.clone();
    b["n_predict"] = json!(context - (layout.len() - 5));
    b["stop"] = json!(["\n"]);
    let r = post_json(server(), "/infill", None, &b);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["tokens_evaluated"], layout.len() - 5, "{v}");
    assert_eq!(v["truncated"], true);
    assert_eq!(
        (&v["stop_type"], &v["stopping_word"]),
        (&json!("word"), &json!("\n")),
        "{v}"
    );
    // Bad values name llama.cpp's fields.
    for (field, value) in [
        ("n_predict", json!(-5)),
        ("n_predict", json!(context)),
        ("mirostat", json!(2)),
        ("grammar", json!("root ::= nowhere")),
    ] {
        let mut b = body.clone();
        b[field] = value;
        let r = post_json(server(), "/infill", None, &b);
        assert_eq!(r.status, 400, "{field}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], field, "{}", r.text());
    }
    // A GBNF grammar constrains the middle.
    let mut b = body.clone();
    b["grammar"] = json!("root ::= \" n < 2:\" [\\n]");
    let v = post_json(server(), "/infill", None, &b).json();
    assert_eq!(v["content"], " n < 2:\n", "{v}");
}
