//! Server-Sent Events in OpenAI's format: one `data: {json}\n\n` per chunk, the role in the first
//! chat delta, `finish_reason` in each choice's last chunk, a usage chunk with no choices when
//! `stream_options.include_usage` asks for it, then `data: [DONE]`.

use super::error::ApiError;
use super::routes::{AbortGuard, TextOffsets, chat_logprobs, completion_logprobs};
use super::types::*;
use super::worker::{Event, EventKind};
use crate::engine::StepOutput;
use crate::models::tokenizer::Tokenizer;
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::Response;
use serde::Serialize;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc as tmpsc;

/// Turns engine outputs into the chunks of one kind of stream.
pub trait ChunkFormat: Send + 'static {
    /// Chunks sent before any token (the chat role; echoed prompts).
    fn start(&mut self, usage_null: bool) -> Vec<String>;
    /// The chunk for one output of sub-request `index`, if it carries anything.
    fn output(&mut self, index: usize, out: &StepOutput, usage_null: bool) -> Option<String>;
    /// The last chunk, with the usage of all sub-requests and no choices.
    fn usage(&mut self, usage: Usage) -> String;
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "{}".into())
}

fn usage_field(null: bool) -> UsageField {
    if null {
        UsageField::Null
    } else {
        UsageField::Absent
    }
}

pub struct CompletionStream {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    echo: Vec<String>,
    /// Where the next token's text starts, per choice (the log-probs' text offsets).
    offsets: Vec<TextOffsets>,
    logprobs: bool,
}

impl CompletionStream {
    pub fn new(
        id: String,
        created: u64,
        model: String,
        tokenizer: Arc<Tokenizer>,
        echo: Vec<String>,
        logprobs: bool,
    ) -> Self {
        let offsets = echo
            .iter()
            .map(|e| TextOffsets::new(e.chars().count()))
            .collect();
        CompletionStream {
            id,
            created,
            model,
            tokenizer,
            echo,
            offsets,
            logprobs,
        }
    }

    fn chunk(&self, choice: CompletionChoice, usage_null: bool) -> String {
        json(&CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![choice],
            usage: usage_field(usage_null),
        })
    }
}

impl ChunkFormat for CompletionStream {
    fn start(&mut self, usage_null: bool) -> Vec<String> {
        let echo = std::mem::take(&mut self.echo);
        echo.into_iter()
            .enumerate()
            .filter(|(_, t)| !t.is_empty())
            .map(|(index, text)| {
                self.chunk(
                    CompletionChoice {
                        index,
                        text,
                        logprobs: None,
                        finish_reason: None,
                    },
                    usage_null,
                )
            })
            .collect()
    }

    fn output(&mut self, index: usize, out: &StepOutput, usage_null: bool) -> Option<String> {
        let has_lp = self.logprobs && !out.new_logprobs.is_empty();
        if out.new_text.is_empty() && !has_lp && out.finish_reason.is_none() {
            return None;
        }
        let logprobs = match self.offsets.get_mut(index) {
            Some(offsets) if self.logprobs => Some(completion_logprobs(
                &self.tokenizer,
                &out.new_logprobs,
                offsets,
            )),
            _ => None,
        };
        Some(self.chunk(
            CompletionChoice {
                index,
                text: out.new_text.clone(),
                logprobs,
                finish_reason: out.finish_reason.map(|f| f.as_str()),
            },
            usage_null,
        ))
    }

    fn usage(&mut self, usage: Usage) -> String {
        json(&CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: Vec::new(),
            usage: UsageField::Some(usage),
        })
    }
}

pub struct ChatStream {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    logprobs: bool,
    /// Choices (`n`): each gets its role delta first.
    choices: usize,
}

impl ChatStream {
    pub fn new(
        id: String,
        created: u64,
        model: String,
        tokenizer: Arc<Tokenizer>,
        logprobs: bool,
        choices: usize,
    ) -> Self {
        ChatStream {
            id,
            created,
            model,
            tokenizer,
            logprobs,
            choices,
        }
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: UsageField) -> String {
        json(&ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
    }
}

impl ChunkFormat for ChatStream {
    fn start(&mut self, usage_null: bool) -> Vec<String> {
        (0..self.choices)
            .map(|index| {
                self.chunk(
                    vec![ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(String::new()),
                        },
                        logprobs: None,
                        finish_reason: None,
                    }],
                    usage_field(usage_null),
                )
            })
            .collect()
    }

    fn output(&mut self, index: usize, out: &StepOutput, usage_null: bool) -> Option<String> {
        let has_lp = self.logprobs && !out.new_logprobs.is_empty();
        if out.new_text.is_empty() && !has_lp && out.finish_reason.is_none() {
            return None;
        }
        let content = (!out.new_text.is_empty() || has_lp).then(|| out.new_text.clone());
        Some(self.chunk(
            vec![ChatChunkChoice {
                index,
                delta: ChatDelta {
                    role: None,
                    content,
                },
                logprobs: has_lp.then(|| chat_logprobs(&self.tokenizer, &out.new_logprobs)),
                finish_reason: out.finish_reason.map(|f| f.as_str()),
            }],
            usage_field(usage_null),
        ))
    }

    fn usage(&mut self, usage: Usage) -> String {
        self.chunk(Vec::new(), UsageField::Some(usage))
    }
}

struct StreamState<F> {
    rx: tmpsc::UnboundedReceiver<Event>,
    guard: AbortGuard,
    fmt: F,
    pending: VecDeque<Bytes>,
    /// Per sub-request: (prompt tokens, output tokens, finished).
    progress: Vec<(usize, usize, bool)>,
    /// Completions per prompt: choice `i` belongs to prompt `i / samples`.
    samples: usize,
    left: usize,
    include_usage: bool,
    done: bool,
}

fn sse(data: &str) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

impl<F: ChunkFormat> StreamState<F> {
    fn on_event(&mut self, ev: Event) {
        match ev.kind {
            EventKind::Output(out) => {
                let Some(p) = self.progress.get_mut(ev.index) else {
                    return;
                };
                p.0 = out.num_prompt_tokens;
                p.1 = out.num_output_tokens;
                if out.finish_reason.is_some() && !p.2 {
                    p.2 = true;
                    self.left -= 1;
                }
                if let Some(c) = self.fmt.output(ev.index, &out, self.include_usage) {
                    self.pending.push_back(sse(&c));
                }
                if self.left == 0 {
                    self.end();
                }
            }
            EventKind::Error(m) => {
                self.pending
                    .push_back(sse(&ApiError::internal(m).body_json()));
                self.pending.push_back(sse("[DONE]"));
                self.done = true;
            }
        }
    }

    fn end(&mut self) {
        if self.include_usage {
            // NOTE: a prompt counts once however many completions it has.
            let (p, c) = self
                .progress
                .iter()
                .enumerate()
                .fold((0, 0), |(p, c), (i, x)| {
                    let prompt = if i % self.samples == 0 { x.0 } else { 0 };
                    (p + prompt, c + x.1)
                });
            let u = self.fmt.usage(Usage::new(p, c));
            self.pending.push_back(sse(&u));
        }
        self.pending.push_back(sse("[DONE]"));
        self.guard.disarm();
        self.done = true;
    }
}

/// The streaming response for `n` choices (`samples` per prompt) whose events arrive on `rx`.
/// Dropping the body (the client went away) drops `guard`, which aborts the requests still
/// running.
pub fn response<F: ChunkFormat>(
    rx: tmpsc::UnboundedReceiver<Event>,
    guard: AbortGuard,
    n: usize,
    samples: usize,
    include_usage: bool,
    mut fmt: F,
) -> Response {
    let pending = fmt.start(include_usage).iter().map(|c| sse(c)).collect();
    let state = StreamState {
        rx,
        guard,
        fmt,
        pending,
        progress: vec![(0, 0, false); n],
        samples: samples.max(1),
        left: n,
        include_usage,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(b) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(b), s));
            }
            if s.done {
                return None;
            }
            match s.rx.recv().await {
                Some(ev) => s.on_event(ev),
                None => {
                    s.pending.push_back(sse(
                        &ApiError::internal("the engine thread is gone").body_json()
                    ));
                    s.pending.push_back(sse("[DONE]"));
                    s.done = true;
                }
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}
