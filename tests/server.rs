//! The OpenAI-compatible server on the real SmolLM2 model, on an ephemeral loopback port: routes,
//! request shapes, streaming format, errors, authentication, aborts on disconnect, shutdown.

mod common;
mod server_util;

use common::{SMOL_GGUF, model_path};
use pagoda::server::{ServerArgs, ServerHandle};
use serde_json::{Value, json};
use server_util::*;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const KEY: &str = "sk-test-key";
const MODEL: &str = "smol";

/// One server for the tests of this file (the model loads once); it requires [`KEY`].
fn server() -> SocketAddr {
    static SERVER: OnceLock<ServerHandle> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            start(
                model_path(SMOL_GGUF),
                256,
                ServerArgs {
                    served_model_names: vec![MODEL.into(), "smol-alias".into()],
                    api_key: Some(KEY.into()),
                    max_body_bytes: 1 << 20,
                    ..ServerArgs::default()
                },
            )
        })
        .addr()
}

fn post(path: &str, body: Value) -> HttpResponse {
    post_json(server(), path, Some(KEY), &body)
}

fn completion(body: Value) -> Value {
    let r = post("/v1/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn chat(body: Value) -> Value {
    let r = post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn stream(path: &str, body: Value) -> Vec<String> {
    let s = Sse::open(
        server(),
        path,
        &[("Authorization", &format!("Bearer {KEY}"))],
        &body,
    );
    assert_eq!(s.status, 200);
    assert!(
        s.headers
            .iter()
            .any(|(k, v)| k.eq_ignore_ascii_case("content-type")
                && v.starts_with("text/event-stream"))
    );
    s.all()
}

fn assert_error(r: &HttpResponse, status: u16, param: Option<&str>) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
    v
}

const PROMPT: &str = "The capital of France is";

#[test]
fn models_health_version_metrics() {
    let addr = server();
    let r = get(addr, "/v1/models", Some(KEY));
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][1]["id"], "smol-alias");
    assert_eq!(v["data"][0]["object"], "model");
    assert!(v["data"][0]["max_model_len"].as_u64().unwrap() > 100);
    assert_eq!(get(addr, "/health", None).status, 200);
    let v = get(addr, "/version", None).json();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    let m = get(addr, "/metrics", None);
    assert_eq!(m.status, 200);
    let text = m.text();
    for name in [
        "pagoda:num_requests_running",
        "pagoda:num_requests_waiting",
        "pagoda:kv_cache_usage_perc",
        "pagoda:prompt_tokens_total",
        "pagoda:generation_tokens_total",
        "pagoda:request_success_total",
        "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:time_per_output_token_seconds_bucket",
        "pagoda:e2e_request_latency_seconds_bucket",
        "pagoda:prefix_cache_queries_total",
        "pagoda:prefix_cache_hits_total",
        "pagoda:spec_decode_num_accepted_tokens_total",
    ] {
        assert!(text.contains(name), "{name} missing:\n{text}");
    }
    assert_error(&get(addr, "/nope", None), 404, None);
}

#[test]
fn authentication() {
    let addr = server();
    for key in [None, Some("wrong")] {
        let r = get(addr, "/v1/models", key);
        let v = assert_error(&r, 401, None);
        assert_eq!(v["error"]["code"], "invalid_api_key");
        let r = post_json(addr, "/v1/completions", key, &json!({"prompt": "x"}));
        assert_error(&r, 401, None);
    }
    // Routes outside /v1 need no key, as in vLLM.
    assert_eq!(get(addr, "/health", None).status, 200);
}

#[test]
fn completion_greedy_length_and_usage() {
    let v = completion(json!({
        "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": true
    }));
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["model"], MODEL);
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["finish_reason"], "length");
    assert!(!c["text"].as_str().unwrap().is_empty());
    assert_eq!(v["usage"]["completion_tokens"], 6);
    let tokens = post("/tokenize", json!({"prompt": PROMPT})).json();
    assert_eq!(v["usage"]["prompt_tokens"], tokens["count"]);
    assert_eq!(
        v["usage"]["total_tokens"].as_u64().unwrap(),
        tokens["count"].as_u64().unwrap() + 6
    );

    // The same prompt as token ids, in a list of prompts, and under the alias: the same text.
    let ids = tokens["tokens"].clone();
    let v2 = completion(
        json!({"model": "smol-alias", "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(v2["choices"][0]["text"], c["text"]);
    let v3 = completion(
        json!({"prompt": ["Hello", PROMPT], "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(v3["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v3["choices"][1]["index"], 1);
    assert_eq!(v3["choices"][1]["text"], c["text"]);
    assert_eq!(v3["usage"]["completion_tokens"], 12);
    let v4 = completion(
        json!({"prompt": [ids.clone(), ids], "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(v4["choices"][0]["text"], c["text"]);
    assert_eq!(v4["choices"][1]["text"], c["text"]);

    // echo prepends the prompt.
    let v5 = completion(
        json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": true, "echo": true}),
    );
    assert_eq!(
        v5["choices"][0]["text"].as_str().unwrap(),
        format!("{PROMPT}{}", c["text"].as_str().unwrap())
    );
}

#[test]
fn completion_stream_equals_non_stream() {
    let body = json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": true});
    let full = completion(body.clone());
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let events = stream("/v1/completions", sb);
    let (texts, finish, usage) = check_stream(&events, false);
    assert_eq!(texts[0], full["choices"][0]["text"].as_str().unwrap());
    assert_eq!(finish[0], "length");
    assert_eq!(usage.unwrap(), full["usage"]);
    // With include_usage every other chunk has "usage": null.
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert!(first["usage"].is_null() && first.get("usage").is_some());

    // Without stream_options, no usage chunk and no usage field.
    let mut sb = body;
    sb["stream"] = json!(true);
    sb["prompt"] = json!([PROMPT, "Once upon a time"]);
    let events = stream("/v1/completions", sb);
    let (texts, finish, usage) = check_stream(&events, false);
    assert!(usage.is_none());
    assert_eq!(texts.len(), 2);
    assert_eq!(texts[0], full["choices"][0]["text"].as_str().unwrap());
    assert_eq!(finish, vec!["length", "length"]);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert!(first.get("usage").is_none());
}

#[test]
fn chat_non_stream_and_stream() {
    let body = json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}
        ],
        "max_completion_tokens": 12,
        "temperature": 0
    });
    let v = chat(body.clone());
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    let text = c["message"]["content"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
    let mut sb = body;
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let events = stream("/v1/chat/completions", sb);
    let (texts, finish, usage) = check_stream(&events, true);
    assert_eq!(texts[0], text);
    assert_eq!(finish[0], c["finish_reason"].as_str().unwrap());
    assert_eq!(usage.unwrap(), v["usage"]);
}

#[test]
fn stop_strings_and_seeds() {
    let base = json!({"prompt": "Count: 1, 2, 3, 4, 5, 6,", "max_tokens": 16, "temperature": 0, "ignore_eos": true});
    let text = completion(base.clone())["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    // Stop at the second character that is not at the start: the text before it comes back.
    let stop: String = text.chars().skip(3).take(2).collect();
    let cut = text.find(&stop).unwrap();
    let mut b = base.clone();
    b["stop"] = json!(stop);
    let v = completion(b);
    assert_eq!(v["choices"][0]["text"], &text[..cut]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // vLLM's stop_reason: which stop string ended it; null when none did.
    assert_eq!(v["choices"][0]["stop_reason"], stop.as_str());
    assert_eq!(
        completion(base.clone())["choices"][0]["stop_reason"],
        Value::Null
    );

    let sampled = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": true});
    let a = completion(sampled.clone());
    let b = completion(sampled);
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
}

#[test]
fn n_and_best_of_on_both_routes() {
    let prompts = [PROMPT, "Once upon a time"];
    let body = json!({"prompt": prompts, "n": 3, "max_tokens": 6, "temperature": 1.0,
                      "seed": 42, "ignore_eos": true});
    let v = completion(body.clone());
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    let texts: Vec<&str> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i);
            c["text"].as_str().unwrap()
        })
        .collect();
    assert!(texts[..3].iter().any(|t| *t != texts[0]), "{texts:?}");
    assert_eq!(v["usage"]["completion_tokens"], 36);
    // each prompt counts once
    let one = |p: &str| {
        completion(json!({"prompt": p, "max_tokens": 1}))["usage"]["prompt_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        one(prompts[0]) + one(prompts[1])
    );
    // the same seed, the same six texts, streamed interleaved
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let (streamed, finish, usage) = check_stream(&stream("/v1/completions", sb), false);
    assert_eq!(streamed, texts);
    assert_eq!(finish, vec!["length"; 6]);
    assert_eq!(usage.unwrap(), v["usage"]);

    let chat_body = json!({"messages": [{"role": "user", "content": "Name a color."}],
                           "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 7});
    let c = chat(chat_body.clone());
    let cs = c["choices"].as_array().unwrap();
    assert_eq!(cs.len(), 2);
    let mut sb = chat_body;
    sb["stream"] = json!(true);
    let (streamed, _, _) = check_stream(&stream("/v1/chat/completions", sb), true);
    let want: Vec<&str> = cs
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, want);

    // best_of: the best one of three, not streamable
    let v = completion(
        json!({"prompt": PROMPT, "n": 1, "best_of": 3, "max_tokens": 4,
                              "temperature": 1.0, "seed": 3, "ignore_eos": true}),
    );
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let r = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "x"}], "n": 1, "best_of": 2,
               "stream": true}),
    );
    assert_error(&r, 400, Some("best_of"));
}

#[test]
fn logprobs() {
    let v = completion(
        json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": true, "logprobs": 3}),
    );
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4);
    assert_eq!(lp["text_offset"][0], 0);
    let joined: String = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(joined, v["choices"][0]["text"].as_str().unwrap());
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!((3..=4).contains(&top.len()));
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        // Greedy: the chosen token is the most likely one.
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((best - chosen).abs() < 1e-4);
    }

    let v = chat(
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2}),
    );
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    for t in content {
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(t["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(
            t["bytes"].as_array().unwrap().len(),
            t["token"].as_str().unwrap().len()
        );
    }
    let v = chat(json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}));
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[test]
fn invalid_requests() {
    let r = request(
        server(),
        "POST",
        "/v1/completions",
        &[("Authorization", &format!("Bearer {KEY}"))],
        Some(b"{not json"),
    );
    assert_error(&r, 400, None);
    let cases = [
        (json!({"prompt": PROMPT, "temperature": -1}), "temperature"),
        (
            json!({"prompt": PROMPT, "temperature": "hot"}),
            "temperature",
        ),
        (json!({"prompt": PROMPT, "top_p": 0}), "top_p"),
        (json!({"prompt": PROMPT, "n": 17}), "n"),
        (json!({"prompt": PROMPT, "n": 2, "best_of": 1}), "best_of"),
        (
            json!({"prompt": PROMPT, "n": 1, "best_of": 2, "stream": true}),
            "best_of",
        ),
        (json!({"prompt": PROMPT, "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": PROMPT, "max_tokens": -5}), "max_tokens"),
        (
            json!({"prompt": PROMPT, "max_tokens": 100_000_000}),
            "max_tokens",
        ),
        (json!({"prompt": PROMPT, "logprobs": 50}), "logprobs"),
        (json!({"prompt": PROMPT, "stop": [""]}), "stop"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": [1, "a"]}), "prompt"),
        (json!({"prompt": [99_999_999]}), "prompt"),
        (json!({"prompt": ""}), "prompt"),
    ];
    for (body, param) in cases {
        let r = post("/v1/completions", body.clone());
        let v = assert_error(&r, 400, Some(param));
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
    }
    let r = post("/v1/completions", json!({"max_tokens": 3}));
    assert_error(&r, 400, None);
    let chat_cases = [
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            "messages",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
            "messages",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100_000_000}),
            "max_tokens",
        ),
    ];
    for (body, param) in chat_cases {
        let r = post("/v1/chat/completions", body);
        assert_error(&r, 400, Some(param));
    }
    // Unknown model: 404.
    let r = post("/v1/completions", json!({"model": "gpt-5", "prompt": "x"}));
    let v = assert_error(&r, 404, Some("model"));
    assert_eq!(v["error"]["code"], "model_not_found");
    // A body over the limit: 413, still in OpenAI's shape.
    let big = "a".repeat(2 << 20);
    let r = post("/v1/completions", json!({"prompt": big}));
    assert_error(&r, 413, None);
    // The server still answers after all that.
    completion(json!({"prompt": PROMPT, "max_tokens": 2}));
}

#[test]
fn tokenize_detokenize() {
    let t = post("/tokenize", json!({"prompt": "Hello world"})).json();
    let ids = t["tokens"].clone();
    assert_eq!(t["count"], ids.as_array().unwrap().len());
    assert!(t["max_model_len"].as_u64().unwrap() > 0);
    let d = post("/detokenize", json!({"tokens": ids})).json();
    assert_eq!(d["prompt"], "Hello world");
    let t = post(
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "Hi"}]}),
    )
    .json();
    assert!(t["count"].as_u64().unwrap() > 3);
    assert_error(
        &post("/detokenize", json!({"tokens": [999_999_999u32]})),
        400,
        Some("tokens"),
    );
}

/// A streaming client that goes away halfway and a non-streaming one that goes away before the
/// answer: both requests are aborted and all their KV blocks freed. (Its own server, so that no
/// other test's requests count.)
#[test]
fn disconnects_abort_requests() {
    let h = start(model_path(SMOL_GGUF), 64, ServerArgs::default());
    let addr = h.addr();
    let aborts = |m: &str| {
        metric(
            m,
            "pagoda:request_success_total",
            "finished_reason=\"abort\"",
        )
    };
    let mut s = Sse::open(
        addr,
        "/v1/completions",
        &[],
        &json!({"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": true, "stream": true}),
    );
    assert_eq!(s.status, 200);
    for _ in 0..3 {
        s.next_data().expect("a chunk");
    }
    drop(s);
    let m = wait_idle(addr, Duration::from_secs(60));
    assert_eq!(aborts(&m), 1.0, "{m}");

    // Send a request and leave without reading the answer.
    let body =
        serde_json::to_vec(&json!({"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": true}))
            .unwrap();
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    conn.write_all(&body).unwrap();
    let t0 = Instant::now();
    while metric(
        &get(addr, "/metrics", None).text(),
        "pagoda:num_requests_running",
        "",
    ) == 0.0
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the request never ran"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(conn);
    let m = wait_idle(addr, Duration::from_secs(60));
    assert_eq!(aborts(&m), 2.0, "{m}");
    assert_eq!(metric(&m, "pagoda:kv_cache_usage_perc", ""), 0.0);
    h.shutdown().unwrap();
}

/// A client that stops reading its stream holds up no one: its tokens queue on its own channel.
#[test]
fn slow_reader_does_not_stall_others() {
    let addr = server();
    let mut slow = Sse::open(
        addr,
        "/v1/completions",
        &[("Authorization", &format!("Bearer {KEY}"))],
        &json!({"prompt": PROMPT, "max_tokens": 300, "ignore_eos": true, "stream": true}),
    );
    slow.next_data().expect("a first chunk");
    let t0 = Instant::now();
    for _ in 0..2 {
        completion(json!({"prompt": "Hello", "max_tokens": 4, "ignore_eos": true}));
    }
    assert!(t0.elapsed() < Duration::from_secs(60));
    drop(slow);
}

/// The greedy reply to a chat request is what `pagoda generate --chat-template` gives for the
/// same message.
#[test]
fn chat_equals_generate() {
    let question = "What is the capital of France?";
    let v = chat(
        json!({"messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0}),
    );
    let served = v["choices"][0]["message"]["content"].as_str().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args([
            "generate",
            "--chat-template",
            "--max-tokens",
            "24",
            "--kv-cache-memory",
            "64MiB",
            "--dtype",
            "f32",
            "--model",
        ])
        .arg(model_path(SMOL_GGUF))
        .arg(question)
        .output()
        .expect("run pagoda generate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8(out.stdout).unwrap();
    assert_eq!(generated.strip_suffix('\n').unwrap(), served);
}

/// A full waiting queue answers 503.
#[test]
fn queue_full_is_503() {
    let h = start(
        model_path(SMOL_GGUF),
        32,
        ServerArgs {
            max_waiting: 0,
            ..ServerArgs::default()
        },
    );
    let r = post_json(
        h.addr(),
        "/v1/completions",
        None,
        &json!({"prompt": "x", "max_tokens": 1}),
    );
    let v = assert_error(&r, 503, None);
    assert_eq!(v["error"]["type"], "server_error");
    h.shutdown().unwrap();
}

/// Shutdown lets a running stream finish, then the port is closed.
#[test]
fn graceful_shutdown_finishes_running_requests() {
    let h = start(model_path(SMOL_GGUF), 32, ServerArgs::default());
    let addr = h.addr();
    let mut s = Sse::open(
        addr,
        "/v1/completions",
        &[],
        &json!({"prompt": PROMPT, "max_tokens": 24, "ignore_eos": true, "stream": true, "temperature": 0}),
    );
    s.next_data().expect("first chunk");
    let t = std::thread::spawn(move || h.shutdown());
    let mut rest = Vec::new();
    while let Some(d) = s.next_data() {
        rest.push(d);
    }
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"));
    let n_chunks = rest.len();
    assert!(n_chunks >= 2, "{rest:?}");
    t.join().unwrap().unwrap();
    assert!(
        std::net::TcpStream::connect(addr).is_err() || {
            // The port may be reused by then; a connection, if any, must not be served by us.
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            let mut buf = [0u8; 1];
            c.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            c.read(&mut buf).map(|n| n == 0).unwrap_or(true)
        }
    );
}

/// Fields the server does not implement are refused by name (never a 200 that ignored them);
/// their inert values (`null`, `false`, `"none"`) pass.
#[test]
fn unsupported_fields_are_refused_by_name() {
    let user = json!([{"role": "user", "content": "Hi"}]);
    for (field, value) in [
        ("use_beam_search", json!(true)),
        ("truncate_prompt_tokens", json!(8)),
    ] {
        let mut body = json!({"prompt": PROMPT, "max_tokens": 2});
        body[field] = value.clone();
        assert_error(&post("/v1/completions", body), 400, Some(field));
        let mut body = json!({"messages": user, "max_tokens": 2});
        body[field] = value;
        assert_error(&post("/v1/chat/completions", body), 400, Some(field));
    }
    for (field, value) in [
        ("functions", json!([{"name": "f", "parameters": {}}])),
        ("function_call", json!("auto")),
        ("tool_choice", json!("required")),
        ("tool_choice", json!("auto")),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "f"}}),
        ),
        ("stream_options", json!({"include_usage": true})),
    ] {
        let mut body = json!({"messages": user, "max_tokens": 2});
        body[field] = value;
        assert_error(&post("/v1/chat/completions", body), 400, Some(field));
    }
    let r = post(
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 2, "stream_options": {"include_usage": true}}),
    );
    assert_error(&r, 400, Some("stream_options"));
    // Tools belong to chat; audio output is not generated.
    for (field, value) in [
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        ("tool_choice", json!("auto")),
        ("functions", json!([{"name": "f"}])),
    ] {
        let mut body = json!({"prompt": PROMPT, "max_tokens": 2});
        body[field] = value;
        assert_error(&post("/v1/completions", body), 400, Some(field));
    }
    let r = post(
        "/v1/chat/completions",
        json!({"messages": user, "max_tokens": 2, "modalities": ["text", "audio"]}),
    );
    assert_error(&r, 400, Some("modalities"));
    // A whitespace option needs a JSON constraint to apply to.
    let r = post(
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 2, "guided_whitespace_pattern": "[ ]?"}),
    );
    assert_error(&r, 400, Some("guided_whitespace_pattern"));
    // Unknown fields pass (clients send newer fields), named in a header.
    let r = post(
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 2, "temprature": 0, "user": "u1"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("pagoda-ignored-fields"), Some("temprature, user"));
    let r = post(
        "/v1/chat/completions",
        json!({"messages": user, "max_tokens": 2}),
    );
    assert_eq!(r.header("pagoda-ignored-fields"), None);
    // Inert values ask for nothing.
    chat(json!({
        "messages": user, "max_tokens": 2, "echo": false, "tool_choice": "none",
        "guided_json": null, "functions": [], "continue_final_message": false
    }));
    // A text part without its text says so.
    let r = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    );
    let v = assert_error(&r, 400, Some("messages"));
    assert!(
        v["error"]["message"].as_str().unwrap().contains("without"),
        "{v}"
    );
}

/// The routes that do work need the key; unknown `/v1` routes say 401 before 404; a wrong
/// method gets a body; embeddings are a 400.
/// Anthropic's Messages API on the wire: the key as `x-api-key`, the reply's blocks and usage
/// (the chat route's text for the same conversation), events named by their type, the stop
/// sequence told, count_tokens, errors in Anthropic's shape. (The official SDK runs against it
/// in tests/python/test_anthropic_client.py.)
#[test]
fn anthropic_messages_on_the_wire() {
    let addr = server();
    let messages = json!([{"role": "user", "content": "Name three colours."}]);
    let body = json!({"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": messages});
    let send = |path: &str, key: Option<&str>, body: &Value| {
        let mut h = vec![("anthropic-version", "2023-06-01")];
        h.extend(key.map(|k| ("x-api-key", k)));
        request(
            addr,
            "POST",
            path,
            &h,
            Some(&serde_json::to_vec(body).unwrap()),
        )
    };
    let r = send("/v1/messages", Some(KEY), &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let m = r.json();
    assert_eq!(
        (&m["type"], &m["role"]),
        (&json!("message"), &json!("assistant"))
    );
    assert_eq!(m["content"][0]["type"], "text");
    let text = m["content"][0]["text"].as_str().unwrap().to_string();
    let c = chat(json!({"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": messages}));
    assert_eq!(
        text,
        c["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(m["usage"]["input_tokens"], c["usage"]["prompt_tokens"]);
    assert_eq!(m["usage"]["output_tokens"], c["usage"]["completion_tokens"]);
    let finish = c["choices"][0]["finish_reason"].as_str().unwrap();
    let reason = if finish == "length" {
        "max_tokens"
    } else {
        "end_turn"
    };
    assert_eq!(m["stop_reason"], reason);

    // The stream: `event: TYPE` then `data: {"type": TYPE, ...}`, in Anthropic's order.
    let mut b = body.clone();
    b["stream"] = json!(true);
    let r = send("/v1/messages", Some(KEY), &b);
    assert_eq!(r.status, 200);
    let raw = r.text();
    let events: Vec<(String, Value)> = raw
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap();
            let name = name.strip_prefix("event: ").unwrap().to_string();
            (
                name,
                serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap(),
            )
        })
        .collect();
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str(), "{raw}");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names[..3],
        ["message_start", "ping", "content_block_start"],
        "{raw}"
    );
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(
        names[3..names.len() - 3]
            .iter()
            .all(|&n| n == "content_block_delta")
    );
    let streamed: String = events
        .iter()
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], reason);
    assert_eq!(delta["usage"]["output_tokens"], m["usage"]["output_tokens"]);
    assert_eq!(
        events[0].1["message"]["usage"]["input_tokens"],
        m["usage"]["input_tokens"]
    );

    // A stop sequence is told.
    let stop: String = text.chars().skip(4).take(3).collect();
    let mut b = body.clone();
    b["stop_sequences"] = json!([stop]);
    let s = send("/v1/messages", Some(KEY), &b).json();
    assert_eq!(s["content"][0]["text"], &text[..text.find(&stop).unwrap()]);
    assert_eq!(
        (&s["stop_reason"], &s["stop_sequence"]),
        (&json!("stop_sequence"), &json!(stop))
    );

    let n = send(
        "/v1/messages/count_tokens",
        Some(KEY),
        &json!({"model": MODEL, "messages": messages}),
    );
    assert_eq!(n.json()["input_tokens"], m["usage"]["input_tokens"]);

    // Errors in Anthropic's shape.
    let anthropic_error = |r: HttpResponse, status: u16, kind: &str| {
        assert_eq!(r.status, status, "{}", r.text());
        let v = r.json();
        assert_eq!(
            (&v["type"], &v["error"]["type"]),
            (&json!("error"), &json!(kind)),
            "{v}"
        );
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    };
    anthropic_error(
        send("/v1/messages", None, &body),
        401,
        "authentication_error",
    );
    anthropic_error(
        send("/v1/messages", Some("wrong"), &body),
        401,
        "authentication_error",
    );
    let no_max = json!({"model": MODEL, "messages": messages});
    anthropic_error(
        send("/v1/messages", Some(KEY), &no_max),
        400,
        "invalid_request_error",
    );
    let mut b = body.clone();
    b["model"] = json!("nope");
    anthropic_error(send("/v1/messages", Some(KEY), &b), 404, "not_found_error");
    let mut b = body.clone();
    b["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    anthropic_error(
        send("/v1/messages", Some(KEY), &b),
        400,
        "invalid_request_error",
    );
    let mut b = body.clone();
    b["tool_choice"] = json!({"type": "any"});
    anthropic_error(
        send("/v1/messages", Some(KEY), &b),
        400,
        "invalid_request_error",
    );
    // The OpenAI routes take the key as x-api-key too.
    assert_eq!(
        request(addr, "GET", "/v1/models", &[("x-api-key", KEY)], None).status,
        200
    );
}

#[test]
fn routes_keys_and_methods() {
    let addr = server();
    for (path, body) in [
        ("/tokenize", json!({"prompt": "x"})),
        ("/detokenize", json!({"tokens": [1]})),
        ("/v1/embeddings", json!({"input": "x"})),
    ] {
        assert_error(&post_json(addr, path, None, &body), 401, None);
    }
    assert_error(&get(addr, "/v1/nope", None), 401, None);
    assert_error(&get(addr, "/v1/nope", Some(KEY)), 404, None);
    assert_error(&get(addr, "/v1/completions", Some(KEY)), 405, None);
    assert_error(&get(addr, "/tokenize", Some(KEY)), 405, None);
    let r = post("/v1/embeddings", json!({"input": "x", "model": MODEL}));
    assert_error(&r, 400, Some("model"));
}

/// A text longer than any prompt the context holds is refused before it is tokenized: a
/// megabyte of words is hundreds of thousands of tokens.
#[test]
fn overlong_text_is_refused_before_tokenizing() {
    let text = "a ".repeat(400_000);
    let t0 = Instant::now();
    let r = post("/tokenize", json!({ "prompt": text }));
    let v = assert_error(&r, 400, Some("prompt"));
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("bytes long"),
        "{v}"
    );
    let r = post(
        "/v1/completions",
        json!({ "prompt": text, "max_tokens": 1 }),
    );
    assert_error(&r, 400, Some("prompt"));
    let r = post(
        "/v1/chat/completions",
        json!({ "messages": [{"role": "user", "content": text}] }),
    );
    assert_error(&r, 400, Some("messages"));
    // NOTE: not a timing assertion: printed to show the refusals cost no tokenizing.
    println!("three refusals in {:?}", t0.elapsed());
    // More prompts than may ever wait: the request is wrong, not the server busy.
    let many = vec![json!("x"); 1025];
    let r = post(
        "/v1/completions",
        json!({ "prompt": many, "max_tokens": 1 }),
    );
    assert_error(&r, 400, Some("prompt"));
}

/// `continue_final_message`: the prompt ends with the assistant's unfinished message, not with
/// an end of turn.
#[test]
fn continue_final_message() {
    let messages = json!([
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]);
    let t = post(
        "/tokenize",
        json!({"messages": messages, "continue_final_message": true, "add_generation_prompt": false}),
    )
    .json();
    let d = post("/detokenize", json!({"tokens": t["tokens"]})).json();
    let prompt = d["prompt"].as_str().unwrap();
    assert!(
        prompt.ends_with("<|im_start|>assistant\nThe capital of France is"),
        "{prompt:?}"
    );
    let v = chat(json!({
        "messages": messages, "continue_final_message": true, "add_generation_prompt": false,
        "max_tokens": 4, "temperature": 0
    }));
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text:?}");
    // vLLM's chat echo: the reply starts with the message it continues, streamed or not.
    let body = json!({
        "messages": messages, "continue_final_message": true, "add_generation_prompt": false,
        "max_tokens": 4, "temperature": 0, "echo": true
    });
    let v = chat(body.clone());
    let echoed = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(echoed, format!("The capital of France is{text}"));
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (texts, _, _) = check_stream(&stream("/v1/chat/completions", streamed), true);
    assert_eq!(texts[0], echoed);
    // Both at once, or a last message that is not the assistant's: 400.
    for body in [
        json!({"messages": messages, "continue_final_message": true, "add_generation_prompt": true}),
        json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
    ] {
        assert_error(
            &post("/v1/chat/completions", body),
            400,
            Some("continue_final_message"),
        );
    }
}

/// Connection limits: a client that sends nothing, or sends its headers a byte at a time, is
/// closed; connections over the cap wait instead of being served with no descriptors left;
/// shutdown does not wait for idle keep-alive connections.
#[test]
fn connection_timeouts_and_cap() {
    let h = start(
        model_path(SMOL_GGUF),
        32,
        ServerArgs {
            header_read_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(1),
            max_connections: 3,
            shutdown_grace: Duration::from_secs(60),
            ..ServerArgs::default()
        },
    );
    let addr = h.addr();
    let closed_within = |s: &mut std::net::TcpStream, limit: Duration| {
        s.set_read_timeout(Some(limit)).unwrap();
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    };
    // Silent: closed after the idle timeout.
    let mut silent = std::net::TcpStream::connect(addr).unwrap();
    let t0 = Instant::now();
    assert!(closed_within(&mut silent, Duration::from_secs(10)));
    println!("silent connection closed after {:?}", t0.elapsed());
    // Slow headers: bytes keep coming, but the headers never end within the timeout.
    let mut slow = std::net::TcpStream::connect(addr).unwrap();
    let head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let t0 = Instant::now();
    let mut closed = false;
    for b in head.iter() {
        if slow.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed || closed_within(&mut slow, Duration::from_secs(10)));
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    // The cap: three silent connections fill it; a request waits until one times out.
    let _held: Vec<_> = (0..3)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(get(addr, "/health", None).status, 200);
    h.shutdown().unwrap();
    // Shutdown with an idle keep-alive connection open returns without waiting for it (its
    // idle timeout and the grace period are a minute here).
    let h = start(
        model_path(SMOL_GGUF),
        32,
        ServerArgs {
            idle_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(60),
            ..ServerArgs::default()
        },
    );
    let mut keep = std::net::TcpStream::connect(h.addr()).unwrap();
    keep.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 512];
    let n = keep.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let t0 = Instant::now();
    h.shutdown().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

/// Replays malformed and hostile requests (bodies, values, raw HTTP), then checks that the
/// server answers a normal request with the same greedy text as before and that every KV block
/// came back. (Its own server, so that no other test's requests count.)
#[test]
fn hostile_requests_leave_the_server_as_it_was() {
    let h = start(model_path(SMOL_GGUF), 32, ServerArgs::default());
    let addr = h.addr();
    let greedy = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0});
    let before =
        post_json(addr, "/v1/completions", None, &greedy).json()["choices"][0]["text"].clone();
    let nested = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let bodies: Vec<Vec<u8>> = vec![
        b"\xff\xfe{\"prompt\": \"x\"}".to_vec(),
        b"{\"prompt\": \"\xc3\x28\"}".to_vec(),
        nested.into_bytes(),
        b"".to_vec(),
        b"null".to_vec(),
        b"[1, 2, 3]".to_vec(),
        b"{\"prompt\": \"x\", \"max_tokens\": 1e30}".to_vec(),
        b"{\"prompt\": \"x\", \"temperature\": 1e999}".to_vec(),
        b"{\"prompt\": \"x\", \"n\": 100000000000000000000}".to_vec(),
        b"{\"prompt\": \"x\", \"seed\": -1}".to_vec(),
        b"{\"prompt\": \"x\", \"top_k\": 1099511627776}".to_vec(),
        b"{\"prompt\": [[4294967296]]}".to_vec(),
        b"{\"prompt\": \"x\", \"stream\": \"yes\"}".to_vec(),
        b"{\"prompt\": \"x\", \"logit_bias\": {\"abc\": \"def\"}}".to_vec(),
        b"{\"prompt\": \"x\", \"stop\": {\"a\": 1}}".to_vec(),
        b"{\"prompt\": \"\\u0000\\ud800\", \"max_tokens\": 1}".to_vec(),
    ];
    for body in &bodies {
        for path in ["/v1/completions", "/v1/chat/completions", "/tokenize"] {
            let r = request(addr, "POST", path, &[], Some(body));
            assert!(
                (400..500).contains(&r.status) || r.status == 200,
                "{path} {}: {} {}",
                String::from_utf8_lossy(body),
                r.status,
                r.text()
            );
        }
    }
    let chats = [
        json!({"messages": [{"role": null, "content": "x"}]}),
        json!({"messages": [{"role": "user", "content": 5}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        json!({"messages": "hello"}),
        json!({"messages": [{"role": "user", "content": "x"}], "stop": vec!["a"; 5000]}),
        json!({"messages": [{"role": "user", "content": "x"}], "stop": ["a".repeat(10_000)]}),
    ];
    for body in chats {
        let r = post_json(addr, "/v1/chat/completions", None, &body);
        assert!((400..500).contains(&r.status), "{body}: {}", r.status);
    }
    // Raw HTTP that is not HTTP, and a request cut off in its body: an error or a closed
    // connection, never a hang.
    for raw in [
        b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n".as_slice(),
        b"GET / HTTP/9.9\r\n\r\n",
        b"\x00\x01\x02\x03garbage\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ] {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(raw).unwrap();
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let r = s.read_to_end(&mut out);
        assert!(
            r.is_ok() || out.is_empty(),
            "{}: {r:?}",
            String::from_utf8_lossy(raw)
        );
        assert!(
            out.is_empty() || out.starts_with(b"HTTP/1.1 4"),
            "{}",
            String::from_utf8_lossy(&out)
        );
    }
    let after =
        post_json(addr, "/v1/completions", None, &greedy).json()["choices"][0]["text"].clone();
    assert_eq!(before, after);
    wait_idle(addr, Duration::from_secs(30));
    assert_eq!(get(addr, "/health", None).status, 200);
    h.shutdown().unwrap();
}

/// `logit_bias`, `min_tokens` and `bad_words` change greedy output as they say.
#[test]
fn logit_bias_min_tokens_bad_words() {
    let the = post(
        "/tokenize",
        json!({"prompt": " the", "add_special_tokens": false}),
    )
    .json();
    let the = the["tokens"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .as_u64()
        .unwrap();
    let v = completion(json!({
        "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
        "logit_bias": {the.to_string(): 100}
    }));
    assert_eq!(v["choices"][0]["text"], " the the the");
    // bad_words: the greedy answer is Paris; banned, it is something else.
    let greedy = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0});
    let plain = completion(greedy.clone());
    assert!(
        plain["choices"][0]["text"]
            .as_str()
            .unwrap()
            .contains("Paris")
    );
    let mut body = greedy.clone();
    body["bad_words"] = json!(["Paris"]);
    let v = completion(body);
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(!text.contains("Paris"), "{text:?}");
    // min_tokens: a short greedy answer goes on past its end of turn.
    let short = json!({
        "messages": [{"role": "user", "content": "Answer with one word: is the sky blue?"}],
        "max_tokens": 40, "temperature": 0
    });
    let v = chat(short.clone());
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
    let mut body = short;
    body["min_tokens"] = json!(n + 5);
    let v = chat(body);
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() >= n + 5,
        "{v}"
    );
    for bias in [
        json!({"abc": 1}),
        json!({"5": 200}),
        json!({"5": "x"}),
        json!({"99999999": 1}),
    ] {
        let r = post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 1, "logit_bias": bias}),
        );
        assert_error(&r, 400, Some("logit_bias"));
    }
    let r = post(
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3}),
    );
    assert_error(&r, 400, Some("min_tokens"));
    let r = post(
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 2, "bad_words": [" "]}),
    );
    assert_error(&r, 400, Some("bad_words"));
}

/// Structured output on both routes, from each of the fields that can ask for it; a
/// constraint that does not compile is a 400 naming the field it came in.
#[test]
fn structured_output_fields() {
    let schema = json!({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": false
    });
    let user = json!([{"role": "user", "content": "Name a city in France as JSON."}]);
    let check_city = |text: &str| {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        let o = v.as_object().unwrap();
        assert!(o.len() == 1 && o["city"].is_string(), "{v}");
    };
    for (field, value) in [
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": true}}),
        ),
        ("guided_json", schema.clone()),
        ("guided_json", Value::from(schema.to_string())),
        ("structured_outputs", json!({"json": schema})),
    ] {
        let mut body = json!({"messages": user, "max_tokens": 40, "temperature": 0});
        body[field] = value.clone();
        let v = chat(body);
        check_city(v["choices"][0]["message"]["content"].as_str().unwrap());
        let mut body =
            json!({"prompt": "A city in France, as JSON:", "max_tokens": 40, "temperature": 0});
        body[field] = value;
        let v = completion(body);
        check_city(v["choices"][0]["text"].as_str().unwrap());
    }
    let v = chat(json!({
        "messages": user, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_object"}
    }));
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(text).unwrap().is_object(),
        "{text:?}"
    );
    for (field, value, want) in [
        ("guided_choice", json!(["yes", "no"]), vec!["yes", "no"]),
        ("guided_regex", json!("(yes|no)"), vec!["yes", "no"]),
        (
            "structured_outputs",
            json!({"grammar": "start: \"yes\" | \"no\""}),
            vec!["yes", "no"],
        ),
        // GBNF, as vLLM's and llama.cpp's users write it
        (
            "guided_grammar",
            json!("root ::= answer\nanswer ::= \"yes\" | \"no\" # either"),
            vec!["yes", "no"],
        ),
        (
            "grammar",
            json!("root ::= [yn] \"es\"?"),
            vec!["yes", "y", "n", "nes"],
        ),
    ] {
        let mut body =
            json!({"prompt": "Is Paris in France? Answer:", "max_tokens": 5, "temperature": 0});
        body[field] = value;
        let v = completion(body);
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert!(want.contains(&text), "{field}: {text:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    // Streamed, the pieces join to the same JSON.
    let events = stream(
        "/v1/chat/completions",
        json!({"messages": user, "max_tokens": 40, "temperature": 0, "stream": true, "guided_json": schema}),
    );
    let (texts, _, _) = check_stream(&events, true);
    check_city(&texts[0]);
    // Errors name the field the constraint came in.
    for (field, value) in [
        ("guided_regex", json!("(unclosed")),
        ("guided_grammar", json!("start: nowhere")),
        ("guided_grammar", json!("root ::= nowhere")),
        ("grammar", json!("root ::= \"unclosed")),
        ("guided_json", json!({"type": "no-such-type"})),
        ("guided_json", json!("{not json")),
        ("guided_choice", json!([])),
        ("guided_choice", json!("yes")),
        ("response_format", json!({"type": "xml"})),
        ("response_format", json!({"type": "json_schema"})),
        ("structured_outputs", json!({"yaml": "x"})),
        ("guided_decoding_backend", json!("xgrammar")),
    ] {
        let mut body = json!({"prompt": PROMPT, "max_tokens": 2});
        body[field] = value;
        assert_error(&post("/v1/completions", body), 400, Some(field));
    }
    let r = post(
        "/v1/completions",
        json!({"prompt": PROMPT, "guided_regex": "a", "guided_choice": ["a"]}),
    );
    assert_error(&r, 400, None);
}

/// Prompt log-probabilities: `echo` with `logprobs` (OpenAI's legacy form) and vLLM's
/// `prompt_logprobs`, checked against the decode path: a greedy continuation sent back as part
/// of the prompt is scored as it was generated.
#[test]
fn echo_logprobs_and_prompt_logprobs() {
    let t = post("/tokenize", json!({"prompt": PROMPT})).json();
    let prompt: Vec<u64> = t["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    let g = completion(json!({
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": true
    }));
    let glp = &g["choices"][0]["logprobs"];
    let gen_lps: Vec<f64> = glp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let gen_ids = post(
        "/tokenize",
        json!({"prompt": g["choices"][0]["text"], "add_special_tokens": false}),
    )
    .json()["tokens"]
        .clone();
    let mut full = prompt.clone();
    full.extend(
        gen_ids
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap()),
    );
    let v = completion(json!({
        "prompt": full, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": true
    }));
    let lp = &v["choices"][0]["logprobs"];
    let toks = lp["tokens"].as_array().unwrap();
    assert_eq!(toks.len(), full.len() + 1, "{lp}");
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    assert_eq!(lp["text_offset"][0], 0);
    // The echoed continuation is scored as it was generated (when it tokenizes back the same).
    if full.len() - prompt.len() == gen_lps.len() {
        for (j, want) in gen_lps.iter().enumerate() {
            let got = lp["token_logprobs"][prompt.len() + j].as_f64().unwrap();
            assert!((got - want).abs() < 1e-3, "{j}: {got} against {want}");
        }
    }
    // vLLM's prompt_logprobs, on both routes.
    let v = completion(json!({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1}));
    let pl = v["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(pl.len(), prompt.len());
    assert!(pl[0].is_null());
    let second = prompt[1].to_string();
    let e = &pl[1][&second];
    assert!(
        e["logprob"].as_f64().unwrap() <= 0.0 && e["rank"].as_u64().unwrap() >= 1,
        "{e}"
    );
    assert!(e["decoded_token"].is_string());
    let v = chat(json!({
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0
    }));
    assert!(v["prompt_logprobs"].as_array().unwrap().len() > 3, "{v}");
    // Not streamed.
    let r = post(
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1, "stream": true}),
    );
    assert_error(&r, 400, Some("prompt_logprobs"));
    let r = post(
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 21}),
    );
    assert_error(&r, 400, Some("prompt_logprobs"));
}

/// The ids of `text` alone (no BOS), from `/tokenize`.
fn ids_of(text: &str) -> Vec<u64> {
    let v = post(
        "/tokenize",
        json!({"prompt": text, "add_special_tokens": false}),
    )
    .json();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// vLLM's `return_token_ids` and `return_tokens_as_token_ids`, streamed and not, on both routes.
#[test]
fn token_ids_are_returned_when_asked() {
    let body = json!({"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": true,
                      "return_token_ids": true, "logprobs": 2, "return_tokens_as_token_ids": true});
    let v = completion(body.clone());
    let c = &v["choices"][0];
    let prompt = post("/tokenize", json!({"prompt": PROMPT})).json();
    assert_eq!(u64s(&c["prompt_token_ids"]), u64s(&prompt["tokens"]));
    let ids = u64s(&c["token_ids"]);
    assert_eq!(ids.len(), 5);
    let text = post("/detokenize", json!({"tokens": ids})).json();
    assert_eq!(text["prompt"], c["text"]);
    let names: Vec<String> = ids.iter().map(|i| format!("token_id:{i}")).collect();
    assert_eq!(c["logprobs"]["tokens"], json!(names));
    for top in c["logprobs"]["top_logprobs"].as_array().unwrap() {
        assert!(
            top.as_object()
                .unwrap()
                .keys()
                .all(|k| k.starts_with("token_id:")),
            "{top}"
        );
    }
    // Without the options: neither field, names by text.
    let plain = completion(json!({"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                  "ignore_eos": true, "logprobs": 2}));
    let p = &plain["choices"][0];
    assert!(
        p.get("token_ids").is_none() && p.get("prompt_token_ids").is_none(),
        "{p}"
    );
    assert!(
        !p["logprobs"]["tokens"][0]
            .as_str()
            .unwrap()
            .starts_with("token_id:")
    );

    // Streamed: the prompt's ids once, in the first chunk; the chunks' ids add up.
    let mut body = body;
    body["stream"] = json!(true);
    let (mut streamed, mut prompts) = (Vec::new(), Vec::new());
    for e in stream("/v1/completions", body)
        .iter()
        .filter(|e| *e != "[DONE]")
    {
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        streamed.extend(u64s(&c["token_ids"]));
        if !c["prompt_token_ids"].is_null() {
            prompts.push(u64s(&c["prompt_token_ids"]));
        }
    }
    assert_eq!(streamed, ids);
    assert_eq!(prompts, [u64s(&prompt["tokens"])]);

    // Chat: the rendered prompt's ids at the top, the output's in the choice.
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                      "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let v = chat(body.clone());
    let rendered = post(
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "Hi"}]}),
    )
    .json();
    assert_eq!(u64s(&v["prompt_token_ids"]), u64s(&rendered["tokens"]));
    let ids = u64s(&v["choices"][0]["token_ids"]);
    assert_eq!(ids.len(), 4);
    let mut body = body;
    body["stream"] = json!(true);
    let (mut streamed, mut prompts) = (Vec::new(), 0);
    for e in stream("/v1/chat/completions", body)
        .iter()
        .filter(|e| *e != "[DONE]")
    {
        let v: Value = serde_json::from_str(e).unwrap();
        if !v["prompt_token_ids"].is_null() {
            assert_eq!(u64s(&v["prompt_token_ids"]), u64s(&rendered["tokens"]));
            prompts += 1;
        }
        for c in v["choices"].as_array().unwrap() {
            streamed.extend(u64s(&c["token_ids"]));
        }
    }
    assert_eq!((streamed, prompts), (ids, 1));
}

/// A completion cut inside a character ends in U+FFFD, and the log-prob offsets point into
/// the text: forced with `logit_bias` onto the first token of an emoji that takes several.
#[test]
fn an_output_cut_inside_a_character_shows_a_replacement() {
    let wave = ids_of("👋");
    assert!(wave.len() >= 2, "{wave:?}");
    let body = |max_tokens: usize| {
        json!({"prompt": PROMPT, "max_tokens": max_tokens, "logprobs": 0, "temperature": 0,
               "logit_bias": {wave[0].to_string(): 100}})
    };
    let v = completion(body(1));
    let c = &v["choices"][0];
    assert_eq!(c["text"], "\u{FFFD}", "{c}");
    assert_eq!(c["logprobs"]["text_offset"], json!([0]));
    assert!(
        c["logprobs"]["tokens"][0]
            .as_str()
            .unwrap()
            .starts_with("bytes:")
    );
    // Twice: the first piece is cut short by the second, each shows as one U+FFFD.
    let v = completion(body(2));
    let c = &v["choices"][0];
    assert_eq!(c["text"], "\u{FFFD}\u{FFFD}", "{c}");
    assert_eq!(c["logprobs"]["text_offset"], json!([0, 1]));
    // Streamed, the same text.
    let mut b = body(2);
    b["stream"] = json!(true);
    let text: String = stream("/v1/completions", b)
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"].as_str().unwrap_or("").to_string()
        })
        .collect();
    assert_eq!(text, "\u{FFFD}\u{FFFD}");
}

/// Fill-in-the-middle needs the model's FIM tokens, which SmolLM2 does not have.
#[test]
fn fill_in_the_middle_without_fim_tokens_is_refused() {
    let r = post(
        "/v1/completions",
        json!({"prompt": "def f(", "suffix": "\n", "max_tokens": 4}),
    );
    let e = assert_error(&r, 400, Some("suffix"));
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("fill-in-the-middle")
    );
    let r = post(
        "/infill",
        json!({"input_prefix": "def f(", "input_suffix": "\n", "n_predict": 4}),
    );
    assert_error(&r, 400, Some("model"));
    // An empty suffix asks for nothing.
    let v = completion(json!({"prompt": PROMPT, "suffix": "", "max_tokens": 1}));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}
