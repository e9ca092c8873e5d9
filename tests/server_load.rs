//! Load: 128 concurrent streaming clients (completions and chat) with varied prompts and lengths on
//! the real SmolLM2 model. Every stream must be complete and well formed, and its text must equal
//! the same request's non-streamed greedy text; clients that disconnect halfway must be aborted;
//! afterwards every KV block is free and the server still answers.
//!
//! Sized for a 2-core CI machine: short outputs, moderate prompts, every wait bounded.

mod common;
mod server_util;

use common::{SMOL_GGUF, model_path};
use pagoda::server::ServerArgs;
use serde_json::{Value, json};
use server_util::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const CLIENTS: usize = 128;
/// Every this-many-th client disconnects after a few chunks.
const DISCONNECT_EVERY: usize = 8;

const TOPICS: &[&str] = &[
    "the history of the printing press",
    "how bees make honey",
    "why the sky is blue",
    "the rules of chess",
    "volcanoes and plate tectonics",
    "the water cycle",
    "how a bicycle stays upright",
    "the life of a star",
    "baking sourdough bread",
    "the invention of the telephone",
    "how vaccines work",
    "the migration of birds",
    "ancient Rome's aqueducts",
    "the structure of DNA",
    "how rainbows form",
    "the rules of football",
];

/// Client `i`'s request: a prompt of varied length and a varied `max_tokens`.
fn request_body(i: usize, stream: bool) -> (String, Value) {
    let topic = TOPICS[i % TOPICS.len()];
    let extra = "Use simple words. ".repeat(i % 4);
    let text = format!("Write a short paragraph about {topic}. {extra}Paragraph {i}:");
    let disconnects = stream && i % DISCONNECT_EVERY == DISCONNECT_EVERY - 1;
    // A disconnecting client asks for many tokens, so that it is still running when it leaves.
    let max_tokens = if disconnects { 400 } else { 4 + i % 9 };
    let chat = i % 2 == 1;
    let mut body = if chat {
        json!({"messages": [{"role": "user", "content": text}]})
    } else {
        json!({"prompt": text})
    };
    body["max_tokens"] = json!(max_tokens);
    body["temperature"] = json!(0);
    if disconnects {
        body["ignore_eos"] = json!(true);
    }
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    (path.to_string(), body)
}

enum Outcome {
    Complete {
        text: String,
        finish: String,
        usage: Value,
    },
    Disconnected,
}

fn stream_client(addr: SocketAddr, i: usize) -> Outcome {
    let (path, body) = request_body(i, true);
    let chat = path.contains("chat");
    let mut s = Sse::open(addr, &path, &[], &body);
    assert_eq!(s.status, 200, "client {i}");
    if i % DISCONNECT_EVERY == DISCONNECT_EVERY - 1 {
        for _ in 0..3 {
            s.next_data().expect("a chunk before leaving");
        }
        return Outcome::Disconnected;
    }
    let events = s.all();
    let (texts, finish, usage) = check_stream(&events, chat);
    assert_eq!(texts.len(), 1, "client {i}");
    Outcome::Complete {
        text: texts[0].clone(),
        finish: finish[0].clone(),
        usage: usage.expect("usage chunk"),
    }
}

fn non_stream_text(addr: SocketAddr, i: usize) -> (String, String, Value) {
    let (path, body) = request_body(i, false);
    let r = post_json(addr, &path, None, &body);
    assert_eq!(r.status, 200, "client {i}: {}", r.text());
    let v = r.json();
    let c = &v["choices"][0];
    let text = if path.contains("chat") {
        c["message"]["content"].as_str().unwrap().to_string()
    } else {
        c["text"].as_str().unwrap().to_string()
    };
    (
        text,
        c["finish_reason"].as_str().unwrap().to_string(),
        v["usage"].clone(),
    )
}

#[test]
fn concurrent_streams_match_non_streamed_and_free_all_blocks() {
    let server = start(
        model_path(SMOL_GGUF),
        512,
        ServerArgs {
            max_waiting: 2 * CLIENTS,
            ..ServerArgs::default()
        },
    );
    let addr = server.addr();
    let t0 = Instant::now();

    let streams: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|i| s.spawn(move || stream_client(addr, i)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    });
    let t_streams = t0.elapsed();
    let n_disconnected = streams
        .iter()
        .filter(|o| matches!(o, Outcome::Disconnected))
        .count();
    assert_eq!(n_disconnected, CLIENTS / DISCONNECT_EVERY);

    // The disconnected clients' requests are aborted and every block comes back.
    let m = wait_idle(addr, Duration::from_secs(60));
    let aborted = metric(
        &m,
        "pagoda:request_success_total",
        "finished_reason=\"abort\"",
    );
    assert_eq!(aborted as usize, n_disconnected, "{m}");

    // The same requests, not streamed, all at once: the same greedy text.
    let t1 = Instant::now();
    let reference: Vec<Option<(String, String, Value)>> = std::thread::scope(|s| {
        let handles: Vec<_> = streams
            .iter()
            .enumerate()
            .map(|(i, o)| {
                let complete = matches!(o, Outcome::Complete { .. });
                s.spawn(move || complete.then(|| non_stream_text(addr, i)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    });
    for (i, (o, r)) in streams.iter().zip(&reference).enumerate() {
        if let (
            Outcome::Complete {
                text,
                finish,
                usage,
            },
            Some((rt, rf, ru)),
        ) = (o, r)
        {
            assert_eq!(text, rt, "client {i}: streamed text differs");
            assert_eq!(finish, rf, "client {i}");
            assert_eq!(usage, ru, "client {i}");
        }
    }
    let m = wait_idle(addr, Duration::from_secs(60));
    assert_eq!(metric(&m, "pagoda:kv_cache_usage_perc", ""), 0.0);
    let finished_ok = metric(
        &m,
        "pagoda:request_success_total",
        "finished_reason=\"stop\"",
    ) + metric(
        &m,
        "pagoda:request_success_total",
        "finished_reason=\"length\"",
    );
    assert_eq!(finished_ok as usize, 2 * (CLIENTS - n_disconnected));

    // Still answering.
    let (text, _, _) = non_stream_text(addr, 0);
    assert!(!text.is_empty());
    eprintln!(
        "{CLIENTS} streams in {:.1} s, {} non-streamed in {:.1} s",
        t_streams.as_secs_f64(),
        CLIENTS - n_disconnected,
        t1.elapsed().as_secs_f64()
    );
    server.shutdown().unwrap();
}
