//! Server-Sent Events in OpenAI's format: one `data: {json}\n\n` per chunk, the role in the first
//! chat delta, `finish_reason` in each choice's last chunk, a usage chunk with no choices when
//! `stream_options.include_usage` asks for it, then `data: [DONE]`.

use super::error::ApiError;
use super::response::{
    AbortGuard, TextOffsets, call_id, chat_logprobs, completion_logprobs, stop_reason_json,
};
use super::tools::{self, ToolMode};
use super::types::*;
use super::worker::{Event, EventKind};
use crate::engine::StepOutput;
use crate::sched::FinishReason;
use crate::tokenizer::Tokenizer;
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
    /// The chunks for one output of sub-request `index` (none when it carries nothing).
    fn output(&mut self, index: usize, out: &StepOutput, usage_null: bool) -> Vec<String>;
    /// The last chunk, with the usage of all sub-requests and no choices (OpenAI's
    /// `include_usage`); none where the usage rides on other events (Anthropic's, the
    /// Responses API's, llama.cpp's).
    fn usage(&mut self, _usage: Usage) -> Option<String> {
        None
    }
    /// One chunk as a Server-Sent Event: OpenAI's name no event.
    fn frame(&self, chunk: &str) -> Bytes {
        sse(chunk)
    }
    /// What follows the last chunk: OpenAI's `data: [DONE]`.
    fn done(&self) -> Option<Bytes> {
        Some(sse("[DONE]"))
    }
    /// A failure midway, as the stream's last event.
    fn error(&self, e: &ApiError) -> Bytes {
        sse(&e.body_json())
    }
}

/// A delta carrying tool calls only.
fn tool_delta(calls: Vec<ToolCallDelta>) -> ChatDelta {
    ChatDelta {
        tool_calls: calls,
        ..Default::default()
    }
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
    token_ids: TokenIdFields,
    /// Per choice, the prompt's ids until its first chunk carries them (`return_token_ids`).
    prompt_ids: Vec<Option<Vec<u32>>>,
}

impl CompletionStream {
    /// vLLM's token-id options; `prompt_ids` per choice.
    pub fn with_token_ids(mut self, token_ids: TokenIdFields, prompt_ids: Vec<Vec<u32>>) -> Self {
        self.token_ids = token_ids;
        if token_ids.ids() {
            self.prompt_ids = prompt_ids.into_iter().map(Some).collect();
        }
        self
    }

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
            token_ids: TokenIdFields::default(),
            prompt_ids: Vec::new(),
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
                let prompt_token_ids = self.prompt_ids.get_mut(index).and_then(Option::take);
                self.chunk(
                    CompletionChoice {
                        index,
                        text,
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                        prompt_logprobs: None,
                        prompt_token_ids,
                        token_ids: self.token_ids.ids().then(Vec::new),
                    },
                    usage_null,
                )
            })
            .collect()
    }

    fn output(&mut self, index: usize, out: &StepOutput, usage_null: bool) -> Vec<String> {
        let has_lp = self.logprobs && !out.new_logprobs.is_empty();
        let ids = self.token_ids.ids();
        if out.new_text.is_empty() && !has_lp && !ids && out.finish_reason.is_none() {
            return Vec::new();
        }
        let logprobs = match self.offsets.get_mut(index) {
            Some(offsets) if self.logprobs => Some(completion_logprobs(
                &self.tokenizer,
                &out.new_logprobs,
                offsets,
                self.token_ids.names(),
            )),
            _ => None,
        };
        let prompt_token_ids = self.prompt_ids.get_mut(index).and_then(Option::take);
        vec![self.chunk(
            CompletionChoice {
                index,
                text: out.new_text.clone(),
                logprobs,
                finish_reason: out.finish_reason.map(|f| f.as_str()),
                stop_reason: stop_reason_json(out.stop_reason.as_ref()),
                prompt_logprobs: None,
                prompt_token_ids,
                token_ids: ids.then(|| out.new_token_ids.clone()),
            },
            usage_null,
        )]
    }

    fn usage(&mut self, usage: Usage) -> Option<String> {
        Some(json(&CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: Vec::new(),
            usage: UsageField::Some(usage),
        }))
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
    /// How the output is read for tool calls, and each choice's text so far (held back until
    /// the end, where the calls are parsed, except for a named call, whose arguments stream).
    tools: Option<ToolMode>,
    held: Vec<String>,
    /// vLLM's chat `echo`: the last message's text, sent first.
    echo: String,
    token_ids: TokenIdFields,
    /// The prompt's ids, for the first chunk (`return_token_ids`).
    prompt_ids: Option<Vec<u32>>,
    /// Per choice, the ids of the text held for tool calls.
    held_ids: Vec<Vec<u32>>,
}

impl ChatStream {
    /// vLLM's token-id options and the prompt's ids (given with `return_token_ids`).
    pub fn with_token_ids(
        mut self,
        token_ids: TokenIdFields,
        prompt_ids: Option<Vec<u32>>,
    ) -> Self {
        self.token_ids = token_ids;
        self.prompt_ids = prompt_ids;
        self
    }

    /// Sends `text` (the echoed last message) at the start of each choice's content.
    pub fn with_echo(mut self, text: String) -> Self {
        self.echo = text;
        self
    }

    pub fn new(
        id: String,
        created: u64,
        model: String,
        tokenizer: Arc<Tokenizer>,
        logprobs: bool,
        choices: usize,
        tools: Option<ToolMode>,
    ) -> Self {
        ChatStream {
            id,
            created,
            model,
            tokenizer,
            logprobs,
            choices,
            tools,
            held: vec![String::new(); choices],
            echo: String::new(),
            token_ids: TokenIdFields::default(),
            prompt_ids: None,
            held_ids: vec![Vec::new(); choices],
        }
    }

    /// One choice's chunk; it carries the token ids not sent yet (`return_token_ids`).
    fn one(
        &mut self,
        index: usize,
        delta: ChatDelta,
        logprobs: Option<ChatLogprobs>,
        finish: Option<&'static str>,
        usage_null: bool,
    ) -> String {
        let ids = self.token_ids.ids().then(|| {
            self.held_ids
                .get_mut(index)
                .map(std::mem::take)
                .unwrap_or_default()
        });
        self.chunk(
            vec![ChatChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason: finish,
                token_ids: ids,
            }],
            usage_field(usage_null),
        )
    }

    /// An output chunk of a request with tools: a named call streams its arguments (the first
    /// chunk names the call); otherwise the text is held until the end, then sent as calls,
    /// or as content when it holds none.
    fn tool_output(
        &mut self,
        mode: &ToolMode,
        index: usize,
        out: &StepOutput,
        usage_null: bool,
    ) -> Vec<String> {
        let Some(held) = self.held.get_mut(index) else {
            return Vec::new();
        };
        let first = held.is_empty();
        held.push_str(&out.new_text);
        let done = out.finish_reason.is_some();
        let finish = |calls: bool| match out.finish_reason {
            Some(FinishReason::Stop) if calls => Some("tool_calls"),
            f => f.map(|f| f.as_str()),
        };
        if let ToolMode::Named(name) = mode {
            let mut chunks = Vec::new();
            if first && (!out.new_text.is_empty() || done) {
                let call = ToolCallDelta {
                    index: 0,
                    id: Some(call_id(&self.id, index, 0)),
                    kind: Some("function"),
                    function: FunctionDelta {
                        name: Some(name.clone()),
                        arguments: String::new(),
                    },
                };
                chunks.push(self.one(index, tool_delta(vec![call]), None, None, usage_null));
            }
            if !out.new_text.is_empty() || done {
                let piece = ToolCallDelta {
                    index: 0,
                    id: None,
                    kind: None,
                    function: FunctionDelta {
                        name: None,
                        arguments: out.new_text.clone(),
                    },
                };
                chunks.push(self.one(
                    index,
                    tool_delta(vec![piece]),
                    None,
                    finish(true),
                    usage_null,
                ));
            }
            return chunks;
        }
        if !done {
            return Vec::new();
        }
        let text = std::mem::take(held);
        let (content, calls) = tools::extract(mode, &text);
        let mut chunks = Vec::new();
        if let Some(c) = content.filter(|c| !c.is_empty()) {
            let delta = ChatDelta {
                content: Some(c),
                ..Default::default()
            };
            chunks.push(self.one(index, delta, None, None, usage_null));
        }
        let has_calls = !calls.is_empty();
        let deltas: Vec<ToolCallDelta> = calls
            .into_iter()
            .enumerate()
            .map(|(k, c)| ToolCallDelta {
                index: k,
                id: Some(call_id(&self.id, index, k)),
                kind: Some("function"),
                function: FunctionDelta {
                    name: Some(c.name),
                    arguments: c.arguments,
                },
            })
            .collect();
        let last = if deltas.is_empty() {
            ChatDelta::default()
        } else {
            tool_delta(deltas)
        };
        chunks.push(self.one(index, last, None, finish(has_calls), usage_null));
        chunks
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: UsageField) -> String {
        self.chunk_with_prompt(choices, usage, None)
    }

    fn chunk_with_prompt(
        &self,
        choices: Vec<ChatChunkChoice>,
        usage: UsageField,
        prompt_token_ids: Option<Vec<u32>>,
    ) -> String {
        json(&ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            prompt_token_ids,
        })
    }
}

impl ChunkFormat for ChatStream {
    fn start(&mut self, usage_null: bool) -> Vec<String> {
        let ids = self.token_ids.ids();
        (0..self.choices)
            .map(|index| {
                let prompt_token_ids = self.prompt_ids.take();
                self.chunk_with_prompt(
                    vec![ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(self.echo.clone()),
                            tool_calls: Vec::new(),
                        },
                        logprobs: None,
                        finish_reason: None,
                        token_ids: ids.then(Vec::new),
                    }],
                    usage_field(usage_null),
                    prompt_token_ids,
                )
            })
            .collect()
    }

    fn output(&mut self, index: usize, out: &StepOutput, usage_null: bool) -> Vec<String> {
        let ids = self.token_ids.ids();
        if let Some(held) = self.held_ids.get_mut(index).filter(|_| ids) {
            held.extend_from_slice(&out.new_token_ids);
        }
        if let Some(mode) = self.tools.clone() {
            return self.tool_output(&mode, index, out, usage_null);
        }
        let has_lp = self.logprobs && !out.new_logprobs.is_empty();
        let has_ids = ids && !out.new_token_ids.is_empty();
        if out.new_text.is_empty() && !has_lp && !has_ids && out.finish_reason.is_none() {
            return Vec::new();
        }
        let content = (!out.new_text.is_empty() || has_lp).then(|| out.new_text.clone());
        let delta = ChatDelta {
            content,
            ..Default::default()
        };
        let logprobs = has_lp
            .then(|| chat_logprobs(&self.tokenizer, &out.new_logprobs, self.token_ids.names()));
        let finish = out.finish_reason.map(|f| f.as_str());
        vec![self.one(index, delta, logprobs, finish, usage_null)]
    }

    fn usage(&mut self, usage: Usage) -> Option<String> {
        Some(self.chunk(Vec::new(), UsageField::Some(usage)))
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

pub(super) fn sse(data: &str) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// A JSON chunk as an event named by its `type` (`event: TYPE`), as Anthropic's and the
/// Responses API's clients dispatch on it.
pub(super) fn named_sse(chunk: &str) -> Bytes {
    #[derive(serde::Deserialize)]
    struct Kind<'a> {
        #[serde(rename = "type", borrow)]
        kind: &'a str,
    }
    match serde_json::from_str::<Kind>(chunk) {
        Ok(k) => Bytes::from(format!("event: {}\ndata: {chunk}\n\n", k.kind)),
        Err(_) => sse(chunk),
    }
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
                for c in self.fmt.output(ev.index, &out, self.include_usage) {
                    self.pending.push_back(self.fmt.frame(&c));
                }
                if self.left == 0 {
                    self.end();
                }
            }
            EventKind::Error(m) => self.fail(ApiError::internal(m)),
        }
    }

    fn fail(&mut self, e: ApiError) {
        self.pending.push_back(self.fmt.error(&e));
        self.pending.extend(self.fmt.done());
        self.done = true;
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
            if let Some(u) = self.fmt.usage(Usage::new(p, c)) {
                self.pending.push_back(self.fmt.frame(&u));
            }
        }
        self.pending.extend(self.fmt.done());
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
    let pending = fmt
        .start(include_usage)
        .iter()
        .map(|c| fmt.frame(c))
        .collect();
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
                None => s.fail(ApiError::internal("the engine thread is gone")),
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
