//! `/v1/completions`: one or more prompts (text or token ids), `n`/`best_of` choices each,
//! `echo`, legacy log-probs; one JSON response or a stream.

use super::error::ApiError;
use super::params::{
    KNOWN_COMPLETIONS, KNOWN_OPENAI, PromptIn, UNSUPPORTED, check_accepting, check_generates,
    check_model, check_stream_best_of, check_stream_options, check_stream_prompt_logprobs,
    check_text_len, from_json, ignored_fields, name_structured_field, parse_prompts, read_json,
    refuse_completion_tools, refuse_unsupported, sampling_params, structured_output, with_ignored,
};
use super::response::{
    TextOffsets, blocking, collect, completion_logprobs, echo_logprobs_of, finish_str,
    prompt_logprobs_json, stop_reason_json, submit, unix_now,
};
use super::state::{AppState, St};
use super::streaming::{self, CompletionStream};
use super::types::*;
use super::worker::SubRequest;
use crate::engine::Prompt;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Instant;

pub(super) async fn completions(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    match completions_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn completions_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body = read_json(&st, body)?;
    let req: CompletionRequest = from_json(&body)?;
    let sampling: SamplingFields = from_json(&body)?;
    let token_ids: TokenIdFields = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    let lora = st.lora_of(&model);
    check_accepting(&st)?;
    check_generates(&st)?;
    refuse_unsupported(&body, UNSUPPORTED)?;
    refuse_completion_tools(&body)?;
    let ignored = ignored_fields(&st, &body, &[KNOWN_OPENAI, KNOWN_COMPLETIONS]);
    let structured = structured_output(&body)?;
    let field = structured.as_ref().map(|(_, f)| *f);
    let echo = req.echo.unwrap_or(false);
    let fim = match req.suffix.clone().filter(|s| !s.is_empty()) {
        None => None,
        Some(suffix) => {
            let f = st.fim.ok_or_else(|| {
                ApiError::invalid(
                    "suffix: this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>), so it cannot write between a prefix and a suffix",
                    Some("suffix"),
                )
            })?;
            if echo {
                return Err(ApiError::invalid(
                    "echo cannot be combined with suffix",
                    Some("echo"),
                ));
            }
            Some((f, suffix))
        }
    };
    let echo_logprobs = echo && req.logprobs.is_some();
    let mut params = sampling_params(
        &sampling,
        req.max_tokens,
        req.logprobs,
        &st.sampling_defaults,
    )?;
    params.structured = structured.map(|(c, _)| c);
    // NOTE: echo with logprobs scores the prompt too (OpenAI's legacy completions), as many
    // top tokens per prompt position as per generated one.
    params.prompt_logprobs = match (sampling.prompt_logprobs, echo_logprobs) {
        (Some(k), _) => Some(k),
        (None, true) => req.logprobs,
        (None, false) => None,
    };
    params
        .validate()
        .map_err(|e| name_structured_field(ApiError::invalid(e.message, Some(e.param)), field))?;
    let stream = req.stream.unwrap_or(false);
    check_stream_options(stream, &req.stream_options)?;
    check_stream_best_of(&params, stream)?;
    check_stream_prompt_logprobs(&params, stream)?;
    let params_prompt_logprobs = params.prompt_logprobs.is_some();
    let samples = params.n;
    let prompts = parse_prompts(&req.prompt)?;
    // NOTE: a request with more prompts than may ever wait could only be refused as "busy",
    // which clients retry: it is the request that is wrong.
    if prompts.len() > st.max_waiting.max(1) {
        return Err(ApiError::invalid(
            format!(
                "{} prompts in one request: more than the {} requests that may wait at once (--max-waiting); split the request",
                prompts.len(),
                st.max_waiting
            ),
            Some("prompt"),
        ));
    }
    for p in &prompts {
        match p {
            PromptIn::Text(t) => check_text_len(
                &st,
                t.len() + fim.as_ref().map_or(0, |(_, s)| s.len()),
                "prompt",
            )?,
            PromptIn::Tokens(_) if fim.is_some() => {
                return Err(ApiError::invalid(
                    "suffix needs the prompt as text (the prefix), not token ids",
                    Some("suffix"),
                ));
            }
            PromptIn::Tokens(ids) if ids.len() >= st.max_model_len => {
                return Err(ApiError::invalid(
                    format!(
                        "the prompt has {} tokens: the model's context is {} tokens, and at least one must be left to generate",
                        ids.len(),
                        st.max_model_len
                    ),
                    Some("prompt"),
                ));
            }
            PromptIn::Tokens(_) => {}
        }
    }
    let tok = st.tokenizer.clone();
    // (token ids, prompt text for echo)
    let prompts: Vec<(Vec<u32>, String)> = blocking(&st, move || {
        prompts
            .into_iter()
            .map(|p| match p {
                PromptIn::Text(t) if t.is_empty() && fim.is_none() => {
                    Err(ApiError::invalid("the prompt is empty", Some("prompt")))
                }
                PromptIn::Text(t) => match &fim {
                    Some((f, suffix)) => f.prompt(&tok, &t, "", suffix, None),
                    None => tok.encode(&t),
                }
                .map(|ids| (ids, t))
                .map_err(|e| ApiError::invalid(format!("{e:#}"), Some("prompt"))),
                PromptIn::Tokens(ids) => {
                    let text = if echo {
                        tok.decode(&ids, false).unwrap_or_default()
                    } else {
                        String::new()
                    };
                    Ok((ids, text))
                }
            })
            .collect()
    })
    .await?;
    // NOTE: choice i * n + j is prompt i's completion j, as OpenAI numbers them.
    let n = prompts.len() * samples;
    let requests = prompts
        .iter()
        .map(|(ids, _)| SubRequest {
            prompt: Prompt::Tokens(ids.clone()),
            params: params.clone(),
            pooling: None,
            lora: lora.clone(),
        })
        .collect();
    let id = st.new_id("cmpl");
    let (mut rx, mut guard) = submit(
        &st,
        requests,
        &id,
        arrival,
        "prompt",
        req.max_tokens.is_some(),
    )
    .await
    .map_err(|e| name_structured_field(e, field))?;
    let created = unix_now();
    let prompt_ids: Vec<Vec<u32>> = if params_prompt_logprobs || token_ids.ids() {
        prompts
            .iter()
            .flat_map(|(ids, _)| std::iter::repeat_n(ids.clone(), samples))
            .collect()
    } else {
        Vec::new()
    };
    let echo_texts: Vec<String> = prompts
        .into_iter()
        .flat_map(|(_, t)| std::iter::repeat_n(if echo { t } else { String::new() }, samples))
        .collect();

    if stream {
        let include_usage = req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let fmt = CompletionStream::new(
            id,
            created,
            model,
            st.tokenizer.clone(),
            echo_texts,
            req.logprobs.is_some(),
        )
        .with_token_ids(token_ids, prompt_ids);
        return Ok(with_ignored(
            streaming::response(rx, guard, n, samples, include_usage, fmt),
            &ignored,
        ));
    }

    let results = collect(&mut rx, n).await?;
    guard.disarm();
    let mut usage = Usage::default();
    let choices = results
        .into_iter()
        .zip(echo_texts)
        .enumerate()
        .map(|(index, (c, echo_text))| {
            // NOTE: a prompt counts once however many completions it has.
            let prompt_tokens = if index % samples == 0 {
                c.prompt_tokens
            } else {
                0
            };
            usage = Usage::new(
                usage.prompt_tokens + prompt_tokens,
                usage.completion_tokens + c.output_tokens,
            );
            let scored = c.prompt_logprobs.as_deref().unwrap_or_default();
            let logprobs = req.logprobs.is_some().then(|| {
                let mut offsets = TextOffsets::new(echo_text.chars().count());
                let names = token_ids.names();
                let tail = completion_logprobs(&st.tokenizer, &c.logprobs, &mut offsets, names);
                match prompt_ids.get(index) {
                    Some(ids) if echo_logprobs => {
                        let mut head = echo_logprobs_of(&st.tokenizer, ids, scored, names);
                        head.append(tail);
                        head
                    }
                    _ => tail,
                }
            });
            CompletionChoice {
                index,
                text: echo_text + &c.text,
                logprobs,
                finish_reason: finish_str(c.finish),
                stop_reason: stop_reason_json(c.stop_reason.as_ref()),
                prompt_logprobs: sampling
                    .prompt_logprobs
                    .map(|_| prompt_logprobs_json(&st.tokenizer, scored)),
                prompt_token_ids: prompt_ids.get(index).filter(|_| token_ids.ids()).cloned(),
                token_ids: token_ids.ids().then_some(c.token_ids),
            }
        })
        .collect();
    let response = Json(CompletionResponse {
        id,
        object: "text_completion",
        created,
        model,
        choices,
        usage: UsageField::Some(usage),
    })
    .into_response();
    Ok(with_ignored(response, &ignored))
}
