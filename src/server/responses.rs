//! OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, as the
//! `openai` SDK's `client.responses` and the agent frameworks built on it send them. A
//! translation over the chat route, as `anthropic.rs` is: the input items (messages, function
//! calls and their outputs) become the chat template's messages, `instructions` the system
//! message, function tools and `tool_choice` the chat route's tool modes, `text.format`
//! structured output; the reply comes back as output items (`message` with `output_text`,
//! `function_call`), with the Responses stream events. Responses are kept in memory (`store`,
//! bounded by `store.rs`) so that `previous_response_id` can continue a conversation.

use super::chat::{ChatRender, encode_chat};
use super::error::ApiError;
use super::params::{
    check_accepting, check_generates, check_model, check_text_len, from_json, ignored_fields,
    read_json, refuse_unsupported, sampling_params, with_ignored,
};
use super::response::{collect_one, submit, unix_now};
use super::state::{AppState, St};
use super::streaming::{self, ChunkFormat, named_sse};
use super::tools::{self, ToolMode};
use super::types::{SamplingFields, Usage};
use super::worker::SubRequest;
use crate::engine::{Prompt, StepOutput};
use crate::sampling::StructuredOutput;
use crate::sched::FinishReason;
use crate::tokenizer::ChatMessage;
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: Option<String>,
    input: Option<Value>,
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    text: Option<TextConfig>,
    stream: Option<bool>,
    store: Option<bool>,
    previous_response_id: Option<String>,
    metadata: Option<Value>,
    reasoning: Option<Value>,
    truncation: Option<String>,
}

#[derive(Debug, Deserialize)]
struct TextConfig {
    format: Option<Value>,
}

/// The fields this route reads or refuses (the others are listed as ignored).
const KNOWN: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "stream",
    "store",
    "previous_response_id",
    "metadata",
    "reasoning",
    "truncation",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
];

/// OpenAI's fields that this server does not serve: refused by name. (Accepted: `user`,
/// `safety_identifier`, `service_tier`, which only tag or route the request on OpenAI's side,
/// and `prompt_cache_key`, since prompt prefixes are cached here anyway.)
const UNSUPPORTED: &[&str] = &[
    "background",
    "conversation",
    "include",
    "max_tool_calls",
    "prompt",
    "top_logprobs",
    "stream_options",
];

pub(super) async fn create(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    match create_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn retrieve(State(st): St, Path(id): Path<String>) -> Response {
    let found = st
        .responses
        .lock()
        .ok()
        .and_then(|mut s| s.get(&id).map(|r| r.response.clone()));
    match found {
        Some(r) => Json(r).into_response(),
        None => not_found(&id).into_response(),
    }
}

pub(super) async fn delete(State(st): St, Path(id): Path<String>) -> Response {
    let removed = st.responses.lock().is_ok_and(|mut s| s.remove(&id));
    if removed {
        Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        not_found(&id).into_response()
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError {
        status: axum::http::StatusCode::NOT_FOUND,
        message: format!(
            "no response with id '{}' is stored here (responses are kept for {} s, at most {} of them, and only with store: true)",
            crate::untrusted::text(id),
            super::store::MAX_AGE.as_secs(),
            super::store::MAX_COUNT
        ),
        kind: "invalid_request_error",
        param: None,
        code: None,
    }
}

/// The conversation so far: a previous response's, then `input`.
fn conversation(
    st: &AppState,
    req: &ResponsesRequest,
) -> Result<(Vec<ChatMessage>, Option<String>), ApiError> {
    let mut messages = match &req.previous_response_id {
        None => Vec::new(),
        Some(prev) => st
            .responses
            .lock()
            .ok()
            .and_then(|mut s| s.get(prev).map(|r| r.messages.clone()))
            .ok_or_else(|| {
                let mut e = not_found(prev);
                e.param = Some("previous_response_id".into());
                e
            })?,
    };
    match &req.input {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("input: Field required", Some("input")));
        }
        Some(Value::String(s)) => messages.push(ChatMessage::new("user", s.clone())),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                append_item(&mut messages, i, item)?;
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "input must be a string or a list of items",
                Some("input"),
            ));
        }
    }
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "input: at least one item is required",
            Some("input"),
        ));
    }
    Ok((messages, req.instructions.clone().filter(|s| !s.is_empty())))
}

/// The text of a message's content: a string or a list of text parts.
fn content_text(content: &Value, at: &str) -> Result<String, ApiError> {
    let parts = match content {
        Value::String(s) => return Ok(s.clone()),
        Value::Array(p) => p,
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.content must be a string or a list of content parts"),
                Some("input"),
            ));
        }
    };
    let mut text: Vec<&str> = Vec::new();
    for (j, p) in parts.iter().enumerate() {
        match p.get("type").and_then(Value::as_str).unwrap_or("") {
            "input_text" | "output_text" | "text" => {
                text.push(p.get("text").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(
                        format!("{at}.content[{j}] is a text part without a string 'text'"),
                        Some("input"),
                    )
                })?)
            }
            "refusal" => text.push(p.get("refusal").and_then(Value::as_str).unwrap_or("")),
            kind => {
                return Err(ApiError::unsupported(
                    format!(
                        "{at}.content[{j}]: '{}' parts are not supported: this server runs a text-only model",
                        crate::untrusted::text(kind)
                    ),
                    "input",
                ));
            }
        }
    }
    Ok(text.join("\n"))
}

/// Appends input item `i`: a message, a function call (joined to the assistant message before
/// it, as the chat template reads calls), or a call's output.
fn append_item(out: &mut Vec<ChatMessage>, i: usize, item: &Value) -> Result<(), ApiError> {
    let at = format!("input[{i}]");
    let bad = |m: String| ApiError::invalid(format!("{at}: {m}"), Some("input"));
    let field = |k: &str| {
        item.get(k)
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("a {} item needs a string '{k}'", kind_of(item))))
    };
    match kind_of(item) {
        "message" => {
            let role = match item.get("role").and_then(Value::as_str) {
                Some("developer" | "system") => "system",
                Some(r @ ("user" | "assistant")) => r,
                other => {
                    return Err(bad(format!(
                        "role must be \"user\", \"assistant\", \"system\" or \"developer\", got {}",
                        other.map_or("nothing".into(), |r| format!(
                            "\"{}\"",
                            crate::untrusted::text(r)
                        ))
                    )));
                }
            };
            let content = item.get("content").unwrap_or(&Value::Null);
            out.push(ChatMessage::new(role, content_text(content, &at)?));
        }
        "function_call" => {
            let args = field("arguments")?;
            let arguments: Value = serde_json::from_str(args)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| bad("'arguments' must be a JSON object, as a string".into()))?;
            let call = json!({
                "id": field("call_id")?,
                "type": "function",
                "function": {"name": field("name")?, "arguments": arguments},
            });
            match out.last_mut() {
                Some(m) if m.role == "assistant" => m.tool_calls.get_or_insert_default().push(call),
                _ => {
                    let mut m = ChatMessage::new("assistant", "");
                    m.tool_calls = Some(vec![call]);
                    out.push(m);
                }
            }
        }
        "function_call_output" => {
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(v @ Value::Array(_)) => content_text(v, &at)?,
                _ => return Err(bad("'output' must be a string".into())),
            };
            let mut m = ChatMessage::new("tool", output);
            m.tool_call_id = Some(field("call_id")?.to_string());
            out.push(m);
        }
        "reasoning" => {
            return Err(ApiError::unsupported(
                format!(
                    "{at}: reasoning items are not supported: the model does not reason in items"
                ),
                "input",
            ));
        }
        kind => {
            return Err(ApiError::unsupported(
                format!(
                    "{at}: '{}' items are not supported (messages, function_call and function_call_output are)",
                    crate::untrusted::text(kind)
                ),
                "input",
            ));
        }
    }
    Ok(())
}

/// An item's type: a bare `{role, content}` is a message.
fn kind_of(item: &Value) -> &str {
    match item.get("type").and_then(Value::as_str) {
        Some(t) => t,
        None if item.get("role").is_some() => "message",
        None => "",
    }
}

/// A Responses function tool (`name`, `description`, `parameters` at the top) as the chat
/// route's; built-in tools (web search, file search, computer use, ...) are refused by name.
fn chat_tool(i: usize, t: &Value) -> Result<Value, ApiError> {
    match t.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(kind) => {
            return Err(ApiError::unsupported(
                format!(
                    "tools[{i}]: the built-in tool '{}' is not available: only function tools are",
                    crate::untrusted::text(kind)
                ),
                "tools",
            ));
        }
        None => {
            return Err(ApiError::invalid(
                format!("tools[{i}]: a tool needs a 'type' (\"function\")"),
                Some("tools"),
            ));
        }
    }
    let name = t.get("name").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            format!("tools[{i}]: a function tool needs a string 'name'"),
            Some("tools"),
        )
    })?;
    let mut f = json!({"name": name});
    for k in ["description", "parameters"] {
        if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
            f[k] = v.clone();
        }
    }
    Ok(json!({"type": "function", "function": f}))
}

/// `tool_choice` as the chat route's: `auto`, `none`, `required`, or `{"type": "function",
/// "name"}`.
fn chat_tool_choice(choice: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(c @ Value::String(_)) => Ok(Some(c.clone())),
        Some(c) if c.get("type").and_then(Value::as_str) == Some("function") => {
            let name = c.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(
                    "tool_choice: a function choice needs the function's 'name'",
                    Some("tool_choice"),
                )
            })?;
            Ok(Some(
                json!({"type": "function", "function": {"name": name}}),
            ))
        }
        Some(c) => Err(ApiError::unsupported(
            format!(
                "tool_choice: {} is not supported: \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"name\"}} are",
                crate::untrusted::json(c)
            ),
            "tool_choice",
        )),
    }
}

/// `text.format`: structured output (`json_schema`, `json_object`) or plain text.
fn text_format(text: Option<&TextConfig>) -> Result<Option<StructuredOutput>, ApiError> {
    let Some(f) = text
        .and_then(|t| t.format.as_ref())
        .filter(|f| !f.is_null())
    else {
        return Ok(None);
    };
    let bad = |m: &str| ApiError::invalid(format!("text.format: {m}"), Some("text"));
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(StructuredOutput::JsonObject)),
        Some("json_schema") => f
            .get("schema")
            .filter(|s| s.is_object())
            .map(|s| Some(StructuredOutput::Json(s.clone())))
            .ok_or_else(|| bad("a json_schema format needs a 'schema' object")),
        _ => Err(bad(
            "type must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// What a response echoes of its request, and where it is kept.
struct Meta {
    id: String,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
    temperature: f32,
    top_p: f32,
    tools: Vec<Value>,
    tool_choice: Value,
    parallel_tool_calls: bool,
    text: Value,
    previous_response_id: Option<String>,
    store: bool,
    metadata: Value,
    /// The conversation, without the instructions, to which the output is added when stored.
    messages: Vec<ChatMessage>,
    prompt_tokens: usize,
}

impl Meta {
    fn json(&self, status: &str, output: Vec<Value>, usage: Option<Usage>) -> Value {
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": null, "summary": null},
            "store": self.store,
            "temperature": self.temperature,
            "text": self.text,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage.map(|u| json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens,
            })),
            "user": null,
            "metadata": self.metadata,
        })
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.tail())
    }

    fn call_ids(&self, k: usize) -> (String, String) {
        (
            format!("fc_{}{k:02x}", self.tail()),
            format!("call_{}{k:02x}", self.tail()),
        )
    }

    fn tail(&self) -> &str {
        self.id.rsplit('_').next().unwrap_or(&self.id)
    }

    /// The output items of `text`: the message (if it has text), then the calls.
    fn items(&self, mode: Option<&ToolMode>, text: &str) -> (Vec<Value>, ChatMessage) {
        let (content, calls) = match mode {
            Some(m) => tools::extract(m, text),
            None => (Some(text.to_string()), Vec::new()),
        };
        let content = content.unwrap_or_default();
        let mut items = Vec::new();
        if !content.is_empty() || calls.is_empty() {
            items.push(self.message_item(&content, "completed"));
        }
        let mut assistant = ChatMessage::new("assistant", content);
        let mut history = Vec::new();
        for (k, c) in calls.into_iter().enumerate() {
            let (id, call_id) = self.call_ids(k);
            if let Ok(args @ Value::Object(_)) = serde_json::from_str::<Value>(&c.arguments) {
                history.push(json!({"id": call_id, "type": "function",
                                    "function": {"name": c.name, "arguments": args}}));
            }
            items.push(
                json!({"type": "function_call", "id": id, "call_id": call_id,
                              "name": c.name, "arguments": c.arguments, "status": "completed"}),
            );
        }
        assistant.tool_calls = (!history.is_empty()).then_some(history);
        (items, assistant)
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
        };
        json!({"type": "message", "id": self.message_id(), "status": status,
               "role": "assistant", "content": content})
    }

    /// The finished response; kept when `store` asks for it.
    fn finish(
        &self,
        st: &AppState,
        mode: Option<&ToolMode>,
        text: &str,
        finish: Option<FinishReason>,
        output_tokens: usize,
    ) -> Value {
        let (items, assistant) = self.items(mode, text);
        let status = if finish == Some(FinishReason::Length) {
            "incomplete"
        } else {
            "completed"
        };
        let body = self.json(
            status,
            items,
            Some(Usage::new(self.prompt_tokens, output_tokens)),
        );
        if self.store
            && let Ok(mut s) = st.responses.lock()
        {
            let mut messages = self.messages.clone();
            messages.push(assistant);
            s.put(self.id.clone(), body.clone(), messages);
        }
        body
    }
}

async fn create_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body = read_json(&st, body)?;
    let req: ResponsesRequest = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    let lora = st.lora_of(&model);
    check_accepting(&st)?;
    check_generates(&st)?;
    refuse_unsupported(&body, UNSUPPORTED)?;
    let ignored = ignored_fields(&st, &body, &[KNOWN, UNSUPPORTED]);
    if req.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return Err(ApiError::unsupported(
            "truncation: only \"disabled\" is supported (a conversation longer than the context is a 400)",
            "truncation",
        ));
    }
    if let Some(r) = req.reasoning.as_ref().filter(|r| !r.is_null()) {
        // NOTE: accepted so that agents which always send it work; said in the log, since it
        // changes nothing here.
        tracing::warn!(
            "reasoning {} has no effect: the model does not reason in items",
            crate::untrusted::json(r)
        );
    }
    let (history, instructions) = conversation(&st, &req)?;
    let raw_tools: Vec<Value> = req
        .tools
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, t)| chat_tool(i, t))
        .collect::<Result<_, _>>()?;
    let tool_list = tools::parse_tools(&raw_tools)?;
    let choice = chat_tool_choice(req.tool_choice.as_ref())?;
    let mode = tools::tool_mode(&tool_list, choice.as_ref(), st.tool_call_parser)?;
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let fields = SamplingFields {
        temperature: req.temperature,
        top_p: req.top_p,
        ..Default::default()
    };
    let mut params = sampling_params(&fields, req.max_output_tokens, None, &st.sampling_defaults)
        .map_err(|e| e.renamed("max_tokens", "max_output_tokens"))?;
    params.structured = mode
        .as_ref()
        .and_then(|m| tools::constraint(m, &tool_list, parallel));
    if let Some(format) = text_format(req.text.as_ref())? {
        if params.structured.is_some() {
            return Err(ApiError::invalid(
                "text.format cannot be combined with a tool_choice that forces a call",
                Some("text"),
            ));
        }
        params.structured = Some(format);
    }
    if matches!(mode, Some(ToolMode::Auto(_))) {
        params.skip_special_tokens = false;
    }
    params.validate().map_err(|e| {
        let field = if req.text.is_some() {
            "text"
        } else {
            "tool_choice"
        };
        ApiError::invalid(e.message, Some(field))
    })?;
    let mut messages = Vec::with_capacity(history.len() + 1);
    if let Some(i) = &instructions {
        messages.push(ChatMessage::new("system", i.clone()));
    }
    messages.extend(history.iter().cloned());
    check_text_len(&st, messages.iter().map(|m| m.content.len()).sum(), "input")?;
    let render = ChatRender::new(&messages, None, None)?;
    let rendered_tools = (!raw_tools.is_empty()).then_some(raw_tools);
    let ids = encode_chat(&st, messages, render, rendered_tools)
        .await
        .map_err(|mut e| {
            e.param = Some("input".into());
            e
        })?;
    let meta = Meta {
        id: st.new_id("resp").replace('-', "_"),
        created_at: unix_now(),
        model,
        instructions,
        max_output_tokens: req.max_output_tokens,
        temperature: params.temperature,
        top_p: params.top_p,
        tools: req.tools.clone().unwrap_or_default(),
        tool_choice: req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        parallel_tool_calls: parallel,
        text: req
            .text
            .as_ref()
            .and_then(|t| t.format.clone())
            .map_or_else(
                || json!({"format": {"type": "text"}}),
                |f| json!({"format": f}),
            ),
        previous_response_id: req.previous_response_id.clone(),
        store: req.store.unwrap_or(true),
        metadata: req.metadata.clone().unwrap_or_else(|| json!({})),
        messages: history,
        prompt_tokens: ids.len(),
    };
    let (mut rx, mut guard) = submit(
        &st,
        vec![SubRequest {
            prompt: Prompt::Tokens(ids),
            params,
            pooling: None,
            lora,
        }],
        &meta.id,
        arrival,
        "input",
        req.max_output_tokens.is_some(),
    )
    .await
    .map_err(|e| e.renamed("max_tokens", "max_output_tokens"))?;
    if req.stream.unwrap_or(false) {
        let fmt = ResponseStream {
            st: st.clone(),
            meta,
            mode,
            seq: 0,
            text: String::new(),
            open: false,
        };
        return Ok(with_ignored(
            streaming::response(rx, guard, 1, 1, false, fmt),
            &ignored,
        ));
    }
    let c = collect_one(&mut rx, &mut guard).await?;
    let body = meta.finish(&st, mode.as_ref(), &c.text, c.finish, c.output_tokens);
    Ok(with_ignored(Json(body).into_response(), &ignored))
}

/// The Responses stream: `response.created`, `response.in_progress`, then per output item
/// `response.output_item.added`, its deltas (`response.output_text.delta` after
/// `response.content_part.added`; `response.function_call_arguments.delta`) and its `.done`
/// events, then `response.completed` (or `response.incomplete`) with the whole response. Every
/// event is named by its `type` and numbered by `sequence_number`.
struct ResponseStream {
    st: Arc<AppState>,
    meta: Meta,
    mode: Option<ToolMode>,
    seq: u64,
    /// The output so far.
    text: String,
    /// Whether the streamed item (the message, or a named call) has been added.
    open: bool,
}

impl ResponseStream {
    fn event(&mut self, kind: &str, mut body: Value) -> String {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        body.to_string()
    }

    /// The events of items given whole (held tool output): added, their deltas, done.
    fn whole_items(&mut self, items: &[Value], out: &mut Vec<String>) {
        for (i, item) in items.iter().enumerate() {
            match item["type"].as_str() {
                Some("function_call") => {
                    let mut head = item.clone();
                    head["arguments"] = json!("");
                    head["status"] = json!("in_progress");
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": i, "item": head}),
                    ));
                    out.push(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": item["id"], "output_index": i, "delta": item["arguments"]}),
                    ));
                    out.push(self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": item["id"], "output_index": i, "arguments": item["arguments"]}),
                    ));
                }
                _ => {
                    let text = item["content"][0]["text"]
                        .as_str()
                        .unwrap_or("")
                        .to_string();
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": i, "item": self.meta.message_item("", "in_progress")}),
                    ));
                    self.text_events(i, &text, true, out);
                    self.text_done(i, &text, out);
                }
            }
            out.push(self.event(
                "response.output_item.done",
                json!({"output_index": i, "item": item}),
            ));
        }
    }

    /// `content_part.added` (first) and one text delta.
    fn text_events(&mut self, index: usize, delta: &str, first: bool, out: &mut Vec<String>) {
        let item_id = self.meta.message_id();
        if first {
            out.push(self.event(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": index, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}}),
            ));
        }
        if !delta.is_empty() {
            out.push(self.event(
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": index, "content_index": 0,
                       "delta": delta, "logprobs": []}),
            ));
        }
    }

    fn text_done(&mut self, index: usize, text: &str, out: &mut Vec<String>) {
        let item_id = self.meta.message_id();
        out.push(self.event(
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": index, "content_index": 0,
                   "text": text, "logprobs": []}),
        ));
        out.push(self.event(
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": index, "content_index": 0,
                   "part": {"type": "output_text", "text": text, "annotations": []}}),
        ));
    }
}

impl ChunkFormat for ResponseStream {
    fn start(&mut self, _usage_null: bool) -> Vec<String> {
        let r = self.meta.json("in_progress", Vec::new(), None);
        vec![
            self.event("response.created", json!({"response": r.clone()})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn output(&mut self, _index: usize, out: &StepOutput, _usage_null: bool) -> Vec<String> {
        let mut chunks = Vec::new();
        self.text.push_str(&out.new_text);
        match self.mode.clone() {
            // A named call: its arguments stream as they come.
            Some(ToolMode::Named(name)) => {
                let (id, call_id) = self.meta.call_ids(0);
                if !self.open && (!out.new_text.is_empty() || out.finished()) {
                    let item = json!({"type": "function_call", "id": id, "call_id": call_id,
                                      "name": name, "arguments": "", "status": "in_progress"});
                    chunks.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": 0, "item": item}),
                    ));
                    self.open = true;
                }
                if !out.new_text.is_empty() {
                    chunks.push(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": 0, "delta": out.new_text}),
                    ));
                }
                if out.finished() {
                    let args = self.text.clone();
                    chunks.push(self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": id, "output_index": 0, "arguments": args}),
                    ));
                    let item = json!({"type": "function_call", "id": id, "call_id": call_id,
                                      "name": name, "arguments": args, "status": "completed"});
                    chunks.push(self.event(
                        "response.output_item.done",
                        json!({"output_index": 0, "item": item}),
                    ));
                }
            }
            // Other tool modes: held until the end, where the calls are parsed out.
            Some(mode) => {
                if out.finished() {
                    let (items, _) = self.meta.items(Some(&mode), &self.text);
                    self.whole_items(&items, &mut chunks);
                }
            }
            None => {
                if !self.open {
                    let item = self.meta.message_item("", "in_progress");
                    chunks.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": 0, "item": item}),
                    ));
                    self.text_events(0, &out.new_text, true, &mut chunks);
                    self.open = true;
                } else {
                    self.text_events(0, &out.new_text, false, &mut chunks);
                }
                if out.finished() {
                    let text = self.text.clone();
                    self.text_done(0, &text, &mut chunks);
                    let item = self.meta.message_item(&text, "completed");
                    chunks.push(self.event(
                        "response.output_item.done",
                        json!({"output_index": 0, "item": item}),
                    ));
                }
            }
        }
        if out.finished() {
            let r = self.meta.finish(
                &self.st,
                self.mode.as_ref(),
                &self.text,
                out.finish_reason,
                out.num_output_tokens,
            );
            let kind = if r["status"] == "incomplete" {
                "response.incomplete"
            } else {
                "response.completed"
            };
            chunks.push(self.event(kind, json!({"response": r})));
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
        let body = json!({"type": "error", "code": e.code, "message": e.message, "param": e.param, "sequence_number": self.seq});
        self.frame(&body.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(input: Value) -> Result<Vec<ChatMessage>, ApiError> {
        let mut out = Vec::new();
        for (i, item) in input.as_array().unwrap().iter().enumerate() {
            append_item(&mut out, i, item)?;
        }
        Ok(out)
    }

    #[test]
    fn items_become_chat_messages() {
        let out = conv(json!([
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
        ]))
        .unwrap();
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "tool"]);
        assert_eq!(out[1].content, "a\nb");
        let calls = out[2].tool_calls.as_ref().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Paris"}));
        assert_eq!(out[3].tool_call_id.as_deref(), Some("call_1"));
        // A call with no assistant message before it gets one.
        let out = conv(json!([
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ]))
        .unwrap();
        assert_eq!(
            (out[1].role.as_str(), out[1].content.as_str()),
            ("assistant", "")
        );
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        for (input, param) in [
            (
                json!([{"type": "reasoning", "id": "rs_1", "summary": []}]),
                "input",
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                "input",
            ),
            (json!([{"type": "web_search_call", "id": "ws"}]), "input"),
            (json!([{"role": "tool", "content": "x"}]), "input"),
            (
                json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]),
                "input",
            ),
        ] {
            let e = conv(input.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{input}");
        }
        assert!(chat_tool(0, &json!({"type": "web_search"})).is_err());
        assert!(chat_tool(0, &json!({"type": "function"})).is_err());
        assert_eq!(
            chat_tool(0, &json!({"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true})).unwrap(),
            json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})
        );
        assert!(chat_tool_choice(Some(&json!({"type": "web_search_preview"}))).is_err());
        assert_eq!(
            chat_tool_choice(Some(&json!({"type": "function", "name": "f"}))).unwrap(),
            Some(json!({"type": "function", "function": {"name": "f"}}))
        );
        let fmt = |f: Value| text_format(Some(&TextConfig { format: Some(f) }));
        assert_eq!(fmt(json!({"type": "text"})).unwrap(), None);
        assert_eq!(
            fmt(json!({"type": "json_object"})).unwrap(),
            Some(StructuredOutput::JsonObject)
        );
        assert!(fmt(json!({"type": "json_schema", "name": "x"})).is_err());
        assert!(fmt(json!({"type": "grammar"})).is_err());
    }
}
