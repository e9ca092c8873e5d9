//! Anthropic's Messages API: `/v1/messages` and `/v1/messages/count_tokens`, as coding agents
//! and Anthropic's SDKs send them. A translation over the chat route: the conversation
//! (content blocks, `tool_use` and `tool_result`) becomes the chat template's messages, the
//! tools and `tool_choice` become the chat route's tool modes (a forced call enforced with
//! structured output), and the reply comes back as content blocks with Anthropic's stop
//! reasons, usage, named stream events and error shape.

use super::chat::{ChatRender, encode_chat};
use super::error::ApiError;
use super::params::{
    check_accepting, check_generates, check_model, check_text_len, from_json, ignored_fields,
    read_json, refuse_unsupported, sampling_params, with_ignored,
};
use super::response::{Collected, collect_one, submit};
use super::state::{AppState, St};
use super::streaming::{self, ChunkFormat, named_sse};
use super::tools::{self, ParsedCall, Tool, ToolMode};
use super::types::{SamplingFields, StopField};
use super::worker::SubRequest;
use crate::engine::{Prompt, StepOutput, StopReason};
use crate::sampling::StructuredOutput;
use crate::sched::FinishReason;
use crate::tokenizer::ChatMessage;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Instant;

/// The fields of a Messages request (`max_tokens` is required on `/v1/messages` only).
#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: Option<String>,
    messages: Vec<MessageIn>,
    system: Option<Value>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    output_config: Option<OutputConfig>,
}

/// `output_config`: `format` is structured output (`{"type": "json_schema", "schema"}`);
/// `effort` steers how long a reasoning model thinks, which a model without thinking does not.
#[derive(Debug, Deserialize)]
struct OutputConfig {
    format: Option<Value>,
    effort: Option<String>,
}

#[derive(Debug, Deserialize)]
struct MessageIn {
    role: String,
    content: Value,
}

/// The fields this route reads or refuses (the others are listed as ignored).
const KNOWN: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "tools",
    "tool_choice",
    "output_config",
    "thinking",
    "metadata",
    "service_tier",
    "speed",
    "inference_geo",
    "cache_control",
    "mcp_servers",
    "container",
];

/// Anthropic's fields that Pagoda does not serve: refused by name. (Accepted: `metadata`,
/// `service_tier`, `speed`, `inference_geo`, which only tag or route the request on Anthropic's
/// side, and `cache_control`, since prompt prefixes are cached here anyway.)
const UNSUPPORTED: &[&str] = &["mcp_servers", "container"];

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, with the
/// error type its SDKs map to their exception classes.
pub(super) fn error_json(e: &ApiError) -> Value {
    let kind = match e.status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

pub(super) fn error_response(e: ApiError) -> Response {
    (e.status, Json(error_json(&e))).into_response()
}

pub(super) async fn messages(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    match messages_inner(st, body).await {
        Ok(r) => r,
        Err(e) => error_response(e),
    }
}

pub(super) async fn count_tokens(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let body = read_json(&st, body)?;
        let req: MessagesRequest = from_json(&body)?;
        check_model(&st, &req.model)?;
        let conv = Conversation::of(&st, &req)?;
        let ids = encode_chat(&st, conv.messages, conv.render, conv.raw_tools).await?;
        Ok::<_, ApiError>(Json(json!({ "input_tokens": ids.len() })))
    };
    match run.await {
        Ok(r) => r.into_response(),
        Err(e) => error_response(e),
    }
}

/// A request's conversation and tools in the chat route's terms.
struct Conversation {
    messages: Vec<ChatMessage>,
    render: ChatRender,
    tools: Vec<Tool>,
    /// The tools as chat templates read them (OpenAI's function form).
    raw_tools: Option<Vec<Value>>,
}

impl Conversation {
    fn of(st: &AppState, req: &MessagesRequest) -> Result<Self, ApiError> {
        let mut messages = Vec::new();
        if let Some(system) = &req.system {
            let text = block_text(system, "system")?;
            if !text.is_empty() {
                messages.push(ChatMessage::new("system", text));
            }
        }
        if req.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages: at least one message is required",
                Some("messages"),
            ));
        }
        for (i, m) in req.messages.iter().enumerate() {
            append_message(&mut messages, i, m)?;
        }
        // NOTE: a final assistant message is a prefill: the reply continues it (Anthropic's
        // rule), which is the chat route's `continue_final_message`.
        let prefill = req.messages.last().is_some_and(|m| m.role == "assistant");
        let render = ChatRender::new(&messages, None, Some(prefill))?;
        check_text_len(
            st,
            messages.iter().map(|m| m.content.len()).sum(),
            "messages",
        )?;
        let raw: Vec<Value> = req
            .tools
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, t)| openai_tool(i, t))
            .collect::<Result<_, _>>()?;
        let tools = tools::parse_tools(&raw)?;
        Ok(Conversation {
            messages,
            render,
            tools,
            raw_tools: (!raw.is_empty()).then_some(raw),
        })
    }
}

/// The text of a string or of a list of text blocks (`system`, a `tool_result`'s content).
fn block_text(v: &Value, field: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for (j, b) in blocks.iter().enumerate() {
                match (kind_of(b), b.get("text").and_then(Value::as_str)) {
                    ("text", Some(t)) => parts.push(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            format!(
                                "{field}[{j}]: only text blocks are supported here, got '{}'",
                                crate::untrusted::text(kind)
                            ),
                            Some(field.split('.').next().unwrap_or(field)),
                        ));
                    }
                }
            }
            Ok(parts.join("\n"))
        }
        _ => Err(ApiError::invalid(
            format!("{field} must be a string or a list of text blocks"),
            Some(field.split('.').next().unwrap_or(field)),
        )),
    }
}

fn kind_of(block: &Value) -> &str {
    block.get("type").and_then(Value::as_str).unwrap_or("")
}

/// Message `i` appended as chat messages: a user message's `tool_result` blocks become `tool`
/// messages (before its text, as Anthropic orders them), an assistant's `tool_use` blocks its
/// calls.
fn append_message(out: &mut Vec<ChatMessage>, i: usize, m: &MessageIn) -> Result<(), ApiError> {
    let bad = |msg: String| ApiError::invalid(msg, Some("messages"));
    let role = match m.role.as_str() {
        r @ ("user" | "assistant") => r,
        other => {
            return Err(bad(format!(
                "messages[{i}].role must be \"user\" or \"assistant\", got \"{}\" (the system prompt is the top-level `system` field)",
                crate::untrusted::text(other)
            )));
        }
    };
    let blocks = match &m.content {
        Value::String(s) => {
            out.push(ChatMessage::new(role, s.clone()));
            return Ok(());
        }
        Value::Array(b) => b,
        _ => {
            return Err(bad(format!(
                "messages[{i}].content must be a string or a list of content blocks"
            )));
        }
    };
    let mut text: Vec<&str> = Vec::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("messages[{i}].content[{j}]");
        match (role, kind_of(b)) {
            (_, "text") => text.push(
                b.get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("{at} is a text block without a string 'text'")))?,
            ),
            ("assistant", "tool_use") => {
                let field = |k: &str| {
                    b.get(k)
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad(format!("{at}: a tool_use block needs a string '{k}'")))
                };
                calls.push(json!({
                    "id": field("id")?,
                    "type": "function",
                    "function": {
                        "name": field("name")?,
                        "arguments": b.get("input").cloned().unwrap_or_else(|| json!({})),
                    },
                }));
            }
            ("user", "tool_result") => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("{at}: a tool_result needs a 'tool_use_id'")))?;
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => block_text(c, &format!("{at}.content"))?,
                };
                // NOTE: templates have no field for a failed call: the model reads it in the
                // text, as Anthropic's own models do.
                let content = if b.get("is_error") == Some(&Value::Bool(true)) {
                    format!("Error: {content}")
                } else {
                    content
                };
                let mut msg = ChatMessage::new("tool", content);
                msg.tool_call_id = Some(id.to_string());
                out.push(msg);
            }
            // NOTE: earlier turns' thinking is not shown to the model again (Anthropic drops
            // it from the context too); this model does not think in blocks.
            ("assistant", "thinking" | "redacted_thinking") => {}
            (_, kind @ ("image" | "document")) => {
                return Err(ApiError::unsupported(
                    format!(
                        "{at}: {kind} blocks are not supported: this server runs a text-only model"
                    ),
                    "messages",
                ));
            }
            (_, kind) => {
                return Err(ApiError::unsupported(
                    format!(
                        "{at}: '{}' blocks are not supported in a {role} message",
                        crate::untrusted::text(kind)
                    ),
                    "messages",
                ));
            }
        }
    }
    if !text.is_empty() || !calls.is_empty() {
        let mut msg = ChatMessage::new(role, text.join("\n"));
        msg.tool_calls = (!calls.is_empty()).then_some(calls);
        out.push(msg);
    }
    Ok(())
}

/// An Anthropic tool (`name`, `description`, `input_schema`) as an OpenAI function tool;
/// Anthropic's server tools (web search, code execution, ...) are refused by name.
fn openai_tool(i: usize, t: &Value) -> Result<Value, ApiError> {
    let bad = |m: String| ApiError::invalid(format!("tools[{i}]: {m}"), Some("tools"));
    match t.get("type").and_then(Value::as_str) {
        None | Some("custom") => {}
        Some(kind) => {
            return Err(ApiError::unsupported(
                format!(
                    "tools[{i}]: the server tool '{}' is not available: only client tools (name, description, input_schema) are",
                    crate::untrusted::text(kind)
                ),
                "tools",
            ));
        }
    }
    let name = t
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("a tool needs a string 'name'".into()))?;
    let schema = t
        .get("input_schema")
        .ok_or_else(|| bad("a tool needs an 'input_schema'".into()))?;
    let mut f = json!({"name": name, "parameters": schema});
    if let Some(d) = t.get("description") {
        f["description"] = d.clone();
    }
    Ok(json!({"type": "function", "function": f}))
}

/// Anthropic's `tool_choice` as the chat route's: `auto`, `any` (a call is required), `tool`
/// (that one), `none`; and whether several calls may come (`disable_parallel_tool_use`).
fn openai_tool_choice(choice: Option<&Value>) -> Result<(Option<Value>, bool), ApiError> {
    let Some(c) = choice.filter(|c| !c.is_null()) else {
        return Ok((None, true));
    };
    let bad = |m: &str| ApiError::invalid(format!("tool_choice: {m}"), Some("tool_choice"));
    let parallel = match c.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(_) => return Err(bad("disable_parallel_tool_use must be a boolean")),
    };
    let openai = match c.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = c
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("a \"tool\" choice needs the tool's 'name'"))?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => return Err(bad("type must be \"auto\", \"any\", \"tool\" or \"none\"")),
    };
    Ok((Some(openai), parallel))
}

/// The JSON schema the reply must follow, from `output_config.format`.
fn output_format(config: Option<&OutputConfig>) -> Result<Option<Value>, ApiError> {
    let Some(c) = config else {
        return Ok(None);
    };
    if let Some(effort) = &c.effort {
        // NOTE: accepted so that agents which always send it work; said in the log, since it
        // changes nothing here.
        tracing::warn!(
            "output_config.effort \"{}\" has no effect: the model does not reason in thinking blocks",
            crate::untrusted::text(effort)
        );
    }
    match &c.format {
        None | Some(Value::Null) => Ok(None),
        Some(f) if f.get("type").and_then(Value::as_str) == Some("json_schema") => f
            .get("schema")
            .filter(|s| s.is_object())
            .cloned()
            .map(Some)
            .ok_or_else(|| {
                ApiError::invalid(
                    "output_config.format.schema must be a JSON schema object",
                    Some("output_config"),
                )
            }),
        Some(_) => Err(ApiError::invalid(
            "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
            Some("output_config"),
        )),
    }
}

async fn messages_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body = read_json(&st, body)?;
    let req: MessagesRequest = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    let lora = st.lora_of(&model);
    check_accepting(&st)?;
    check_generates(&st)?;
    refuse_unsupported(&body, UNSUPPORTED)?;
    let ignored = ignored_fields(&st, &body, &[KNOWN]);
    if let Some(t) = body.get("thinking")
        && !t.is_null()
        && t.get("type").and_then(Value::as_str) != Some("disabled")
    {
        return Err(ApiError::unsupported(
            "extended thinking is not supported by this server: send thinking {\"type\": \"disabled\"} or leave it out",
            "thinking",
        ));
    }
    let max_tokens = req
        .max_tokens
        .ok_or_else(|| ApiError::invalid("max_tokens: Field required", Some("max_tokens")))?;
    let conv = Conversation::of(&st, &req)?;
    let (choice, parallel) = openai_tool_choice(req.tool_choice.as_ref())?;
    let mode = tools::tool_mode(&conv.tools, choice.as_ref(), st.tool_call_parser)?;
    let fields = SamplingFields {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.clone().map(StopField::Many),
        ..Default::default()
    };
    let mut params = sampling_params(&fields, Some(max_tokens), None, &st.sampling_defaults)
        .map_err(|e| e.renamed("stop", "stop_sequences"))?;
    params.structured = mode
        .as_ref()
        .and_then(|m| tools::constraint(m, &conv.tools, parallel));
    if let Some(schema) = output_format(req.output_config.as_ref())? {
        if params.structured.is_some() {
            return Err(ApiError::invalid(
                "output_config.format cannot be combined with a tool_choice that forces a call",
                Some("output_config"),
            ));
        }
        params.structured = Some(StructuredOutput::Json(schema));
    }
    if matches!(mode, Some(ToolMode::Auto(_))) {
        params.skip_special_tokens = false;
    }
    params.validate().map_err(|e| {
        let field = if req.output_config.is_some() {
            "output_config"
        } else {
            "tool_choice"
        };
        ApiError::invalid(e.message, Some(field))
    })?;
    let ids = encode_chat(&st, conv.messages, conv.render, conv.raw_tools).await?;
    let prompt_tokens = ids.len();
    let id = st.new_id("msg").replace('-', "_");
    let (mut rx, mut guard) = submit(
        &st,
        vec![SubRequest {
            prompt: Prompt::Tokens(ids),
            params,
            pooling: None,
            lora,
        }],
        &id,
        arrival,
        "messages",
        true,
    )
    .await?;
    if req.stream.unwrap_or(false) {
        let fmt = MessageStream {
            id,
            model,
            mode,
            prompt_tokens,
            blocks: 0,
            open: None,
            held: String::new(),
        };
        return Ok(with_ignored(
            streaming::response(rx, guard, 1, 1, false, fmt),
            &ignored,
        ));
    }
    let c = collect_one(&mut rx, &mut guard).await?;
    let response = Json(message_json(&id, &model, mode.as_ref(), &c)).into_response();
    Ok(with_ignored(response, &ignored))
}

/// The reply's content blocks: the text, then the calls (a call whose arguments are not a
/// JSON object, cut off by `max_tokens`, stays text).
fn content_blocks(id: &str, mode: Option<&ToolMode>, text: &str) -> (Vec<Value>, bool) {
    let (content, calls) = match mode {
        Some(m) => tools::extract(m, text),
        None => (Some(text.to_string()), Vec::new()),
    };
    let mut blocks = Vec::new();
    let mut texts: Vec<String> = content.into_iter().collect();
    let mut uses = Vec::new();
    for (k, ParsedCall { name, arguments }) in calls.into_iter().enumerate() {
        match serde_json::from_str::<Value>(&arguments) {
            Ok(input @ Value::Object(_)) => uses.push(
                json!({"type": "tool_use", "id": tool_use_id(id, k), "name": name, "input": input}),
            ),
            _ => texts.push(arguments),
        }
    }
    let text = texts.concat();
    if !text.is_empty() {
        blocks.push(json!({"type": "text", "text": text}));
    }
    let called = !uses.is_empty();
    blocks.extend(uses);
    (blocks, called)
}

fn tool_use_id(message_id: &str, k: usize) -> String {
    let tail = message_id.rsplit('_').next().unwrap_or(message_id);
    format!("toolu_{tail}{k:02x}")
}

/// `stop_reason` and `stop_sequence` of a finished reply.
fn stop_reason(
    finish: Option<FinishReason>,
    stop: Option<&StopReason>,
    called: bool,
) -> (&'static str, Option<String>) {
    match (finish, stop) {
        (Some(FinishReason::Length), _) => ("max_tokens", None),
        (_, Some(StopReason::Text(s))) => ("stop_sequence", Some(s.clone())),
        _ if called => ("tool_use", None),
        _ => ("end_turn", None),
    }
}

fn message_json(id: &str, model: &str, mode: Option<&ToolMode>, c: &Collected) -> Value {
    let (content, called) = content_blocks(id, mode, &c.text);
    let (reason, sequence) = stop_reason(c.finish, c.stop_reason.as_ref(), called);
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": c.prompt_tokens, "output_tokens": c.output_tokens},
    })
}

/// Anthropic's stream: `message_start`, `ping`, then per content block `content_block_start`,
/// its `content_block_delta`s (`text_delta`, `input_json_delta`) and `content_block_stop`, then
/// `message_delta` (stop reason, usage) and `message_stop`. Each event is named by its `type`.
struct MessageStream {
    id: String,
    model: String,
    mode: Option<ToolMode>,
    prompt_tokens: usize,
    /// Content blocks started so far.
    blocks: usize,
    /// The block being streamed, if any: `"text"`, or `"tool_use"` (a named call's arguments).
    open: Option<&'static str>,
    /// With tools (but a named call), the text is held until the end, where the calls are
    /// parsed out of it.
    held: String,
}

impl MessageStream {
    fn start_block(&mut self, block: Value, out: &mut Vec<String>) {
        out.push(
            json!({"type": "content_block_start", "index": self.blocks, "content_block": block})
                .to_string(),
        );
        self.blocks += 1;
    }

    fn delta(&self, delta: Value) -> String {
        json!({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}).to_string()
    }

    fn stop_block(&self) -> String {
        json!({"type": "content_block_stop", "index": self.blocks - 1}).to_string()
    }

    /// A whole block at once: its start, one delta, its stop.
    fn whole_block(&mut self, block: &Value, out: &mut Vec<String>) {
        match block["type"].as_str() {
            Some("tool_use") => {
                let mut head = block.clone();
                head["input"] = json!({});
                self.start_block(head, out);
                let partial = block["input"].to_string();
                out.push(self.delta(json!({"type": "input_json_delta", "partial_json": partial})));
            }
            _ => {
                self.start_block(json!({"type": "text", "text": ""}), out);
                out.push(self.delta(json!({"type": "text_delta", "text": block["text"]})));
            }
        }
        out.push(self.stop_block());
    }
}

impl ChunkFormat for MessageStream {
    fn start(&mut self, _usage_null: bool) -> Vec<String> {
        let message = json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        });
        vec![
            json!({"type": "message_start", "message": message}).to_string(),
            json!({"type": "ping"}).to_string(),
        ]
    }

    fn output(&mut self, _index: usize, out: &StepOutput, _usage_null: bool) -> Vec<String> {
        let mut chunks = Vec::new();
        let mut called = false;
        match self.mode.clone() {
            Some(ToolMode::Named(name)) => {
                if self.open.is_none() && (!out.new_text.is_empty() || out.finished()) {
                    let block = json!({"type": "tool_use", "id": tool_use_id(&self.id, 0), "name": name, "input": {}});
                    self.start_block(block, &mut chunks);
                    self.open = Some("tool_use");
                }
                if !out.new_text.is_empty() {
                    let d = json!({"type": "input_json_delta", "partial_json": out.new_text});
                    chunks.push(self.delta(d));
                }
                called = true;
            }
            Some(mode) => {
                self.held.push_str(&out.new_text);
                if out.finished() {
                    let (blocks, c) = content_blocks(&self.id, Some(&mode), &self.held);
                    for b in &blocks {
                        self.whole_block(b, &mut chunks);
                    }
                    called = c;
                }
            }
            None => {
                if !out.new_text.is_empty() {
                    if self.open.is_none() {
                        self.start_block(json!({"type": "text", "text": ""}), &mut chunks);
                        self.open = Some("text");
                    }
                    let d = json!({"type": "text_delta", "text": out.new_text});
                    chunks.push(self.delta(d));
                }
            }
        }
        if out.finished() {
            if self.open.take().is_some() {
                chunks.push(self.stop_block());
            }
            let (reason, sequence) =
                stop_reason(out.finish_reason, out.stop_reason.as_ref(), called);
            chunks.push(
                json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": out.num_output_tokens},
                })
                .to_string(),
            );
            chunks.push(json!({"type": "message_stop"}).to_string());
        }
        chunks
    }

    fn frame(&self, chunk: &str) -> Bytes {
        named_sse(chunk)
    }

    fn done(&self) -> Option<Bytes> {
        None
    }

    fn error(&self, e: &ApiError) -> Bytes {
        self.frame(&error_json(e).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(messages: Value) -> Result<Vec<ChatMessage>, ApiError> {
        let ms: Vec<MessageIn> = serde_json::from_value(messages).unwrap();
        let mut out = Vec::new();
        for (i, m) in ms.iter().enumerate() {
            append_message(&mut out, i, m)?;
        }
        Ok(out)
    }

    #[test]
    fn blocks_become_chat_messages() {
        let out = conv(json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "x"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": true},
                {"type": "text", "text": "thanks"},
            ]},
        ]))
        .unwrap();
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool", "tool", "user"]);
        assert_eq!(out[0].content, "a\nb");
        assert_eq!(out[1].content, "Let me look.");
        let calls = out[1].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"]["city"], "Paris");
        assert_eq!(calls[0]["id"], "toolu_1");
        assert_eq!(out[2].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(out[2].content, "sunny");
        assert_eq!(out[3].content, "Error: boom");
        assert_eq!(out[4].content, "thanks");
        for bad in [
            json!([{"role": "system", "content": "x"}]),
            json!([{"role": "user", "content": 5}]),
            json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            json!([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]),
            json!([{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]),
            json!([{"role": "user", "content": [{"type": "tool_result"}]}]),
            json!([{"role": "user", "content": [{"type": "text"}]}]),
        ] {
            assert!(conv(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn tools_and_choices_translate() {
        let t = openai_tool(
            0,
            &json!({"name": "f", "description": "d", "input_schema": {"type": "object"}}),
        )
        .unwrap();
        assert_eq!(
            t,
            json!({"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}})
        );
        assert!(
            openai_tool(
                0,
                &json!({"type": "web_search_20250305", "name": "web_search"})
            )
            .is_err()
        );
        assert!(openai_tool(0, &json!({"name": "f"})).is_err());
        let choice = |v: Value| openai_tool_choice(Some(&v));
        assert_eq!(
            choice(json!({"type": "any"})).unwrap(),
            (Some(json!("required")), true)
        );
        assert_eq!(
            choice(json!({"type": "tool", "name": "f", "disable_parallel_tool_use": true}))
                .unwrap(),
            (
                Some(json!({"type": "function", "function": {"name": "f"}})),
                false
            )
        );
        assert_eq!(openai_tool_choice(None).unwrap(), (None, true));
        assert!(choice(json!({"type": "tool"})).is_err());
        assert!(choice(json!({"type": "required"})).is_err());
    }

    #[test]
    fn replies_and_stop_reasons() {
        let (blocks, called) = content_blocks("msg_ab", None, "hi");
        assert_eq!(blocks, [json!({"type": "text", "text": "hi"})]);
        assert!(!called);
        assert!(content_blocks("msg_ab", None, "").0.is_empty());
        let named = ToolMode::Named("f".into());
        let (blocks, called) = content_blocks("msg_ab", Some(&named), r#"{"a": 1}"#);
        assert!(called);
        assert_eq!(blocks[0]["type"], "tool_use");
        assert_eq!(blocks[0]["id"], "toolu_ab00");
        assert_eq!(blocks[0]["input"], json!({"a": 1}));
        // Arguments cut off by max_tokens are not a call.
        let (blocks, called) = content_blocks("msg_ab", Some(&named), r#"{"a": "#);
        assert!(!called);
        assert_eq!(blocks, [json!({"type": "text", "text": "{\"a\":"})]);
        let stop = StopReason::Text("END".into());
        assert_eq!(
            stop_reason(Some(FinishReason::Stop), Some(&stop), false),
            ("stop_sequence", Some("END".into()))
        );
        assert_eq!(
            stop_reason(Some(FinishReason::Length), None, true),
            ("max_tokens", None)
        );
        assert_eq!(
            stop_reason(Some(FinishReason::Stop), None, true),
            ("tool_use", None)
        );
        assert_eq!(
            stop_reason(Some(FinishReason::Stop), None, false),
            ("end_turn", None)
        );
    }

    #[test]
    fn errors_in_anthropics_shape() {
        let e = error_json(&ApiError::invalid("bad", Some("x")));
        assert_eq!(
            e,
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}})
        );
        assert_eq!(
            error_json(&ApiError::unauthorized())["error"]["type"],
            "authentication_error"
        );
        assert_eq!(
            error_json(&ApiError::overloaded("x"))["error"]["type"],
            "overloaded_error"
        );
        assert_eq!(
            error_json(&ApiError::internal("x"))["error"]["type"],
            "api_error"
        );
    }

    #[test]
    fn stream_events_are_named() {
        let s = MessageStream {
            id: "msg_1".into(),
            model: "m".into(),
            mode: None,
            prompt_tokens: 3,
            blocks: 0,
            open: None,
            held: String::new(),
        };
        let f = s.frame(r#"{"type":"ping"}"#);
        assert_eq!(&f[..], b"event: ping\ndata: {\"type\":\"ping\"}\n\n");
        assert!(s.done().is_none());
    }
}
