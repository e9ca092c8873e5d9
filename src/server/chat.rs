//! `/v1/chat/completions`: the conversation checked and rendered through the model's chat
//! template, tools and tool calls, `continue_final_message`; one JSON response or a stream.

use super::error::ApiError;
use super::params::{
    KNOWN_CHAT, KNOWN_OPENAI, UNSUPPORTED, UNSUPPORTED_CHAT, check_accepting, check_generates,
    check_modalities, check_model, check_stream_best_of, check_stream_options,
    check_stream_prompt_logprobs, check_text_len, from_json, ignored_fields, name_structured_field,
    read_json, refuse_unsupported, sampling_params, structured_output, with_ignored,
};
use super::response::{
    blocking, call_id, chat_logprobs, collect, finish_str, prompt_logprobs_json, stop_reason_json,
    submit, unix_now,
};
use super::state::{AppState, St};
use super::streaming::{self, ChatStream};
use super::types::*;
use super::worker::SubRequest;
use crate::engine::Prompt;
use crate::sched::FinishReason;
use crate::tokenizer::{ChatMessage, Tokenizer};
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::sync::Arc;
use std::time::Instant;

/// The conversation as the chat template sees it.
pub(super) fn chat_messages(messages: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let out: Vec<ChatMessage> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                "tool" => "tool",
                other => {
                    return Err(ApiError::unsupported(
                        format!(
                            "messages[{i}].role '{}' is not supported: use system, user, assistant or tool",
                            crate::untrusted::text(other)
                        ),
                        "messages",
                    ));
                }
            };
            let content = match &m.content {
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => {
                                if !text.is_empty() {
                                    text.push('\n');
                                }
                                text.push_str(t);
                            }
                            ("text", None) => {
                                return Err(ApiError::invalid(
                                    format!(
                                        "messages[{i}].content[{j}] is a text part without a string 'text'"
                                    ),
                                    Some("messages"),
                                ));
                            }
                            (kind, _) => {
                                return Err(ApiError::unsupported(
                                    format!(
                                        "messages[{i}].content[{j}]: only text parts are supported, got '{kind}'"
                                    ),
                                    "messages",
                                ));
                            }
                        }
                    }
                    text
                }
                None if role == "assistant" && m.tool_calls.is_some() => String::new(),
                None if role == "assistant" => String::new(),
                None => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].content is missing"),
                        Some("messages"),
                    ));
                }
            };
            let mut msg = ChatMessage::new(role, content);
            if let Some(calls) = &m.tool_calls {
                if role != "assistant" {
                    return Err(ApiError::invalid(
                        format!("messages[{i}]: only assistant messages have tool_calls"),
                        Some("messages"),
                    ));
                }
                msg.tool_calls = Some(super::tools::history_calls(calls).map_err(|e| {
                    ApiError::invalid(format!("messages[{i}].{e}"), Some("messages"))
                })?);
            }
            if role == "tool" {
                msg.tool_call_id = m.tool_call_id.clone();
            }
            Ok(msg)
        })
        .collect::<Result<_, _>>()?;
    check_tool_answers(&out)?;
    Ok(out)
}

/// OpenAI's rule: a `tool` message answers a call of the assistant message before it (other
/// answers may come between), named by its `tool_call_id` when it gives one.
fn check_tool_answers(messages: &[ChatMessage]) -> Result<(), ApiError> {
    let mut calls: Option<Vec<&str>> = None;
    for (i, m) in messages.iter().enumerate() {
        match m.role.as_str() {
            "tool" => {
                let Some(ids) = &calls else {
                    return Err(ApiError::invalid(
                        format!(
                            "messages[{i}]: a 'tool' message must answer the tool_calls of an assistant message before it"
                        ),
                        Some("messages"),
                    ));
                };
                if let Some(id) = &m.tool_call_id
                    && !ids.is_empty()
                    && !ids.contains(&id.as_str())
                {
                    return Err(ApiError::invalid(
                        format!(
                            "messages[{i}]: tool_call_id '{}' names no call of the assistant message before it",
                            crate::untrusted::text(id)
                        ),
                        Some("messages"),
                    ));
                }
            }
            "assistant" => {
                calls = m.tool_calls.as_ref().map(|c| {
                    c.iter()
                        .filter_map(|c| c.get("id").and_then(Value::as_str))
                        .collect()
                });
            }
            _ => calls = None,
        }
    }
    Ok(())
}

/// A request's conversation, how to render it, and its length checked before rendering.
pub(super) fn chat_input(
    st: &AppState,
    messages: &[ChatMessageIn],
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
) -> Result<(Vec<ChatMessage>, ChatRender), ApiError> {
    let messages = chat_messages(messages)?;
    let render = ChatRender::new(&messages, add_generation_prompt, continue_final_message)?;
    check_text_len(
        st,
        messages.iter().map(|m| m.content.len()).sum(),
        "messages",
    )?;
    Ok((messages, render))
}

/// How a conversation is rendered: with the assistant's turn opened after it
/// (`add_generation_prompt`, the default), or with its final assistant message left open for
/// the model to continue (vLLM's `continue_final_message`).
#[derive(Debug, Clone, Copy)]
pub(super) struct ChatRender {
    add_generation_prompt: bool,
    continue_final_message: bool,
}

impl ChatRender {
    pub(super) fn new(
        messages: &[ChatMessage],
        add_generation_prompt: Option<bool>,
        continue_final_message: Option<bool>,
    ) -> Result<Self, ApiError> {
        let cont = continue_final_message.unwrap_or(false);
        if cont && add_generation_prompt == Some(true) {
            return Err(ApiError::invalid(
                "continue_final_message and add_generation_prompt cannot both be true",
                Some("continue_final_message"),
            ));
        }
        if cont && messages.last().is_none_or(|m| m.role != "assistant") {
            return Err(ApiError::invalid(
                "continue_final_message needs the last message to be the assistant's",
                Some("continue_final_message"),
            ));
        }
        Ok(ChatRender {
            add_generation_prompt: !cont && add_generation_prompt.unwrap_or(true),
            continue_final_message: cont,
        })
    }

    /// The prompt text. NOTE: to continue the final message, the template renders the whole
    /// conversation and the text is cut right after that message's content (what
    /// transformers' `continue_final_message` does), dropping the end-of-turn the template
    /// put after it.
    pub(super) fn apply(
        &self,
        tok: &Tokenizer,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
    ) -> Result<String, ApiError> {
        let mut text = tok
            .apply_chat_template_with_tools(messages, self.add_generation_prompt, tools)
            .map_err(|e| ApiError::invalid(format!("{e:#}"), Some("messages")))?;
        if self.continue_final_message {
            let last = messages.last().map_or("", |m| m.content.trim_end());
            match text.rfind(last) {
                Some(at) if !last.is_empty() => text.truncate(at + last.len()),
                _ => {
                    return Err(ApiError::invalid(
                        "continue_final_message: the chat template does not render the final message's content as given",
                        Some("continue_final_message"),
                    ));
                }
            }
        }
        Ok(text)
    }
}

/// The prompt's token ids: the conversation rendered with the chat template (and the tools),
/// refused when it renders to more text than the model's context can hold.
pub(super) async fn encode_chat(
    st: &AppState,
    messages: Vec<ChatMessage>,
    render: ChatRender,
    tools: Option<Vec<Value>>,
) -> Result<Vec<u32>, ApiError> {
    let tok = st.tokenizer.clone();
    let max_bytes = st.max_prompt_bytes;
    let max_len = st.max_model_len;
    blocking(st, move || {
        let text = render.apply(&tok, &messages, tools.as_deref())?;
        if text.len() > max_bytes {
            return Err(ApiError::invalid(
                format!(
                    "the conversation renders to {} bytes: more tokens than the model's context of {max_len} tokens can hold",
                    text.len()
                ),
                Some("messages"),
            ));
        }
        tok.encode(&text)
            .map_err(|e| ApiError::invalid(format!("{e:#}"), Some("messages")))
    })
    .await
}

pub(super) async fn chat_completions(
    State(st): St,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match chat_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn chat_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body = read_json(&st, body)?;
    let req: ChatRequest = from_json(&body)?;
    let sampling: SamplingFields = from_json(&body)?;
    let token_ids: TokenIdFields = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    let lora = st.lora_of(&model);
    check_accepting(&st)?;
    check_generates(&st)?;
    refuse_unsupported(&body, UNSUPPORTED)?;
    refuse_unsupported(&body, UNSUPPORTED_CHAT)?;
    check_modalities(&body)?;
    let ignored = ignored_fields(&st, &body, &[KNOWN_OPENAI, KNOWN_CHAT]);
    let raw_tools: Vec<Value> = req.tools.clone().unwrap_or_default();
    let tools = super::tools::parse_tools(&raw_tools)?;
    let mode = super::tools::tool_mode(&tools, req.tool_choice.as_ref(), st.tool_call_parser)?;
    let mut structured = structured_output(&body)?;
    // NOTE: a required or named tool choice is enforced as structured output (the JSON of
    // the call), so it cannot be combined with another constraint.
    if let Some(c) = mode
        .as_ref()
        .and_then(|m| super::tools::constraint(m, &tools, req.parallel_tool_calls.unwrap_or(true)))
    {
        if let Some((_, f)) = structured {
            return Err(ApiError::invalid(
                format!("{f} cannot be combined with a required or named tool_choice"),
                Some(f),
            ));
        }
        structured = Some((c, "tool_choice"));
    }
    let field = structured.as_ref().map(|(_, f)| *f);
    let want_logprobs = req.logprobs.unwrap_or(false);
    if req.top_logprobs.is_some() && !want_logprobs {
        return Err(ApiError::invalid(
            "top_logprobs requires logprobs to be true",
            Some("top_logprobs"),
        ));
    }
    let logprobs = want_logprobs.then(|| req.top_logprobs.unwrap_or(0));
    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    let mut params = sampling_params(&sampling, max_tokens, logprobs, &st.sampling_defaults)
        .map_err(|e| e.renamed("logprobs", "top_logprobs"))?;
    params.structured = structured.map(|(c, _)| c);
    params.prompt_logprobs = sampling.prompt_logprobs;
    params
        .validate()
        .map_err(|e| name_structured_field(ApiError::invalid(e.message, Some(e.param)), field))?;
    // NOTE: models mark their calls with special tokens (Qwen's <tool_call>), which the
    // parser must see (vLLM's Hermes parser turns skip_special_tokens off too).
    if matches!(mode, Some(super::tools::ToolMode::Auto(_))) {
        params.skip_special_tokens = false;
    }
    let stream = req.stream.unwrap_or(false);
    check_stream_options(stream, &req.stream_options)?;
    check_stream_best_of(&params, stream)?;
    check_stream_prompt_logprobs(&params, stream)?;
    let samples = params.n;
    let (messages, render) = chat_input(
        &st,
        &req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
    )?;
    // NOTE: vLLM's chat `echo`: the reply starts with the last message when it is the
    // assistant's (the message being continued).
    let echo = match messages.last() {
        Some(m) if req.echo == Some(true) && m.role == "assistant" => m.content.clone(),
        _ => String::new(),
    };
    if req.echo == Some(true) && mode.is_some() {
        return Err(ApiError::invalid(
            "echo cannot be combined with tool calls",
            Some("echo"),
        ));
    }
    let rendered_tools = (!raw_tools.is_empty()).then_some(raw_tools);
    let ids = encode_chat(&st, messages, render, rendered_tools).await?;
    let prompt_token_ids = token_ids.ids().then(|| ids.clone());
    let id = st.new_id("chatcmpl");
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
        max_tokens.is_some(),
    )
    .await
    .map_err(|e| name_structured_field(e, field))?;
    let created = unix_now();

    if stream {
        let include_usage = req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let fmt = ChatStream::new(
            id,
            created,
            model,
            st.tokenizer.clone(),
            want_logprobs,
            samples,
            mode,
        )
        .with_echo(echo)
        .with_token_ids(token_ids, prompt_token_ids);
        return Ok(with_ignored(
            streaming::response(rx, guard, samples, samples, include_usage, fmt),
            &ignored,
        ));
    }

    let results = collect(&mut rx, samples).await?;
    guard.disarm();
    let usage = Usage::new(
        results.first().map_or(0, |c| c.prompt_tokens),
        results.iter().map(|c| c.output_tokens).sum(),
    );
    let prompt_logprobs = sampling.prompt_logprobs.map(|_| {
        let scored = results.first().and_then(|c| c.prompt_logprobs.as_deref());
        prompt_logprobs_json(&st.tokenizer, scored.unwrap_or_default())
    });
    let choices = results
        .into_iter()
        .enumerate()
        .map(|(index, c)| {
            let (content, calls) = match &mode {
                Some(m) => super::tools::extract(m, &c.text),
                None => (Some(format!("{echo}{}", c.text)), Vec::new()),
            };
            let finish = match c.finish {
                Some(FinishReason::Stop) if !calls.is_empty() => Some("tool_calls"),
                f => finish_str(f),
            };
            ChatChoice {
                index,
                logprobs: want_logprobs
                    .then(|| chat_logprobs(&st.tokenizer, &c.logprobs, token_ids.names())),
                message: ChatMessageOut {
                    role: "assistant",
                    content,
                    tool_calls: calls
                        .into_iter()
                        .enumerate()
                        .map(|(k, call)| ToolCallOut {
                            id: call_id(&id, index, k),
                            kind: "function",
                            function: FunctionCallOut {
                                name: call.name,
                                arguments: call.arguments,
                            },
                        })
                        .collect(),
                },
                finish_reason: finish,
                stop_reason: stop_reason_json(c.stop_reason.as_ref()),
                token_ids: token_ids.ids().then_some(c.token_ids),
            }
        })
        .collect();
    let response = Json(ChatResponse {
        id,
        object: "chat.completion",
        created,
        model,
        choices,
        usage,
        prompt_logprobs,
        prompt_token_ids,
    })
    .into_response();
    Ok(with_ignored(response, &ignored))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_with_parts_and_bad_roles() {
        let m: Vec<ChatMessageIn> = serde_json::from_value(serde_json::json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null},
        ]))
        .unwrap();
        let out = chat_messages(&m).unwrap();
        assert_eq!(out[1].content, "a\nb");
        assert_eq!(out[2].content, "");
        let m: Vec<ChatMessageIn> = serde_json::from_value(serde_json::json!([
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "x"},
        ]))
        .unwrap();
        let out = chat_messages(&m).unwrap();
        assert_eq!(out[1].tool_call_id.as_deref(), Some("call_1"));
        let calls = out[0].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"]["a"], 1);
        for bad in [
            serde_json::json!([{"role": "robot", "content": "x"}]),
            serde_json::json!([{"role": "user", "content": "x", "tool_calls": []}]),
            serde_json::json!([{"role": "assistant", "tool_calls": [{"id": "x"}]}]),
            // A tool message answers a call before it, by its id.
            serde_json::json!([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]),
            serde_json::json!([
                {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "b", "content": "y"},
            ]),
        ] {
            let m: Vec<ChatMessageIn> = serde_json::from_value(bad.clone()).unwrap();
            assert!(chat_messages(&m).is_err(), "{bad}");
        }
        let m: Vec<ChatMessageIn> = serde_json::from_value(serde_json::json!([
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]))
        .unwrap();
        assert!(chat_messages(&m).is_err());
        assert!(chat_messages(&[]).is_err());
    }
}
