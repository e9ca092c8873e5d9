//! A request body into the engine's terms: JSON read under the size limit, the model name and
//! the server's state checked, OpenAI's and vLLM's sampling fields into [`SamplingParams`], the
//! structured-output constraint, the prompts of a completions request, and the fields Pagoda
//! refuses by name rather than ignore.

use super::error::ApiError;
use super::state::AppState;
use super::types::*;
use crate::sampling::structured::LAYOUT_KEY;
use crate::sampling::{SamplingDefaults, SamplingParams, StructuredOutput};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::sync::atomic::Ordering;

/// Reads a JSON body (413 over the size limit, 400 when it is not JSON).
pub(super) fn read_json(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(st.max_body_bytes)
        } else {
            ApiError::invalid(format!("cannot read the request body: {e}"), None)
        }
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))
}

/// A request struct from a JSON value; a value of the wrong type names its field in `param`.
pub(super) fn from_json<T: DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    if !v.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object", None));
    }
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::invalid(format!("invalid request: {inner}"), None)
        } else {
            let field = path.split(['.', '[']).next().unwrap_or(&path).to_string();
            ApiError::invalid(format!("invalid value for '{path}': {inner}"), Some(&field))
        }
    })
}

pub(super) fn parse_body<T: DeserializeOwned>(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    from_json(&read_json(st, body)?)
}

/// The served name a request's `model` names: the base model's (the first where it has none)
/// or a LoRA adapter's ([`AppState::lora_of`]).
pub(super) fn check_model(st: &AppState, model: &Option<String>) -> Result<String, ApiError> {
    match model {
        Some(m) if !st.model_names.iter().any(|n| n == m) && st.lora_of(m).is_none() => {
            Err(ApiError::model_not_found(m))
        }
        Some(m) => Ok(m.clone()),
        None => Ok(st.model_names[0].clone()),
    }
}

pub(super) fn check_accepting(st: &AppState) -> Result<(), ApiError> {
    if st.draining.load(Ordering::Relaxed) {
        return Err(ApiError::overloaded("the server is shutting down"));
    }
    if st.dead.load(Ordering::Relaxed) {
        return Err(ApiError::internal(
            "the engine has failed; restart the server",
        ));
    }
    Ok(())
}

/// Generating routes on a model served for embeddings or scores are refused, naming why.
pub(super) fn check_generates(st: &AppState) -> Result<(), ApiError> {
    match &st.pooler {
        None => Ok(()),
        Some(p) => Err(ApiError::invalid(
            format!(
                "this model is served for {} (--task {}): it does not generate; its routes are {}",
                if p.task == crate::models::pooling::Task::Embed {
                    "embeddings"
                } else {
                    "scores"
                },
                p.task.name(),
                if p.task == crate::models::pooling::Task::Embed {
                    "/v1/embeddings, /v1/score and /v1/rerank"
                } else {
                    "/v1/score and /v1/rerank"
                }
            ),
            Some("model"),
        )),
    }
}

/// The engine's sampling parameters from the request's fields.
pub(super) fn sampling_params(
    f: &SamplingFields,
    max_tokens: Option<usize>,
    logprobs: Option<usize>,
    model: &SamplingDefaults,
) -> Result<SamplingParams, ApiError> {
    let mut logit_bias = std::collections::BTreeMap::new();
    for (k, v) in f.logit_bias.iter().flatten() {
        let bad = |what: &str| {
            ApiError::invalid(
                format!(
                    "logit_bias: {what} (keys are token ids, values numbers in [-100, 100]), got \"{}\": {}",
                    crate::untrusted::text(k),
                    crate::untrusted::json(v)
                ),
                Some("logit_bias"),
            )
        };
        let id: u32 = k
            .trim()
            .parse()
            .map_err(|_| bad("a key is not a token id"))?;
        let b = v.as_f64().ok_or_else(|| bad("a value is not a number"))?;
        logit_bias.insert(id, b as f32);
    }
    let d = SamplingParams::default();
    let explicit = SamplingDefaults {
        temperature: f.temperature,
        top_p: f.top_p,
        top_k: f.top_k,
        min_p: f.min_p,
        repetition_penalty: f.repetition_penalty,
    };
    let p = SamplingParams {
        n: f.n.unwrap_or(1),
        best_of: f.best_of,
        max_tokens,
        presence_penalty: f.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: f.frequency_penalty.unwrap_or(d.frequency_penalty),
        seed: f.seed,
        stop: f.stop.clone().map(StopField::into_vec).unwrap_or_default(),
        stop_token_ids: f.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        logprobs,
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        logit_bias,
        min_tokens: f.min_tokens.unwrap_or(0),
        bad_words: f.bad_words.clone().unwrap_or_default(),
        ..d
    };
    // NOTE: what the request leaves out comes from the model's generation_config, then from
    // OpenAI's defaults.
    let p = model.fill(&explicit, p);
    p.validate()
        .map_err(|e| ApiError::invalid(e.message, Some(e.param)))?;
    Ok(p)
}

/// Fields of OpenAI's or vLLM's API that Pagoda does not implement yet: refused by name (400)
/// rather than accepted and ignored. A field set to its inert value (`null`, `false`, empty)
/// asks for nothing and passes.
pub(super) const UNSUPPORTED: &[&str] = &[
    "allowed_token_ids",
    "truncate_prompt_tokens",
    "use_beam_search",
];

/// The fields both OpenAI routes read (besides their own).
pub(super) const KNOWN_OPENAI: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "n",
    "best_of",
    "logit_bias",
    "min_tokens",
    "bad_words",
    "prompt_logprobs",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "grammar",
    "json_schema",
    "structured_outputs",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "allowed_token_ids",
    "truncate_prompt_tokens",
    "use_beam_search",
    "return_token_ids",
    "return_tokens_as_token_ids",
];

/// The fields only chat completions read (or refuse by name).
pub(super) const KNOWN_CHAT: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
    "echo",
    "functions",
    "function_call",
    "documents",
    "modalities",
];

/// The fields only completions read (or refuse by name).
pub(super) const KNOWN_COMPLETIONS: &[&str] = &[
    "prompt",
    "logprobs",
    "echo",
    "suffix",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
];

/// The body's top-level fields that no route reads: accepted, as vLLM accepts them (clients
/// send fields of newer API versions), but logged once per name and listed in the response's
/// `pagoda-ignored-fields` header, so that a typo is seen to have done nothing.
pub(super) fn ignored_fields(st: &AppState, body: &Value, known: &[&[&str]]) -> Vec<String> {
    let ignored: Vec<String> = body
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys())
        .filter(|k| !known.iter().any(|list| list.contains(&k.as_str())))
        .map(|k| crate::untrusted::text(k).to_string())
        .collect();
    if !ignored.is_empty()
        && let Ok(mut warned) = st.warned_fields.lock()
    {
        for k in &ignored {
            if warned.len() < 1024 && warned.insert(k.clone()) {
                tracing::warn!("request field '{k}' is not used by this server and is ignored");
            }
        }
    }
    ignored
}

/// `response` with the `pagoda-ignored-fields` header when fields were ignored.
pub(super) fn with_ignored(mut response: Response, ignored: &[String]) -> Response {
    if let Ok(v) = HeaderValue::from_str(&ignored.join(", "))
        && !ignored.is_empty()
    {
        response.headers_mut().insert("pagoda-ignored-fields", v);
    }
    response
}

/// Fields OpenAI's completions route does not have: tools belong to chat completions.
pub(super) fn refuse_completion_tools(body: &Value) -> Result<(), ApiError> {
    refuse_unsupported(body, &["tools", "functions", "tool_choice", "function_call"]).map_err(
        |mut e| {
            e.message = format!(
                "'{}' is not a field of /v1/completions: tool calling is served on /v1/chat/completions",
                e.param.as_deref().unwrap_or_default()
            );
            e
        },
    )
}

/// Output modalities other than text (OpenAI's audio output) are refused by name.
pub(super) fn check_modalities(body: &Value) -> Result<(), ApiError> {
    match body.get("modalities") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(m)) if m.iter().all(|x| x == "text") => Ok(()),
        Some(_) => Err(ApiError::unsupported(
            "modalities: this server generates text only ([\"text\"])",
            "modalities",
        )),
    }
}

/// The fields only chat completions refuse (on top of [`UNSUPPORTED`]).
pub(super) const UNSUPPORTED_CHAT: &[&str] = &["functions", "function_call", "documents"];

pub(super) fn refuse_unsupported(body: &Value, fields: &[&str]) -> Result<(), ApiError> {
    let inert = |v: &Value| match v {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Bool(true) | Value::Number(_) => false,
    };
    for &f in fields {
        if body.get(f).is_some_and(|v| !inert(v)) {
            return Err(ApiError::unsupported(
                format!("'{f}' is not supported by this server yet"),
                f,
            ));
        }
    }
    Ok(())
}

/// The request's structured-output constraint, and the field that gave it (errors name it):
/// OpenAI's `response_format`, vLLM's `structured_outputs` or its older `guided_*` fields,
/// llama.cpp's `grammar` (GBNF) and `json_schema`. At most one may be given.
pub(super) fn structured_output(
    body: &Value,
) -> Result<Option<(StructuredOutput, &'static str)>, ApiError> {
    let bad = |field: &str, what: &str| ApiError::invalid(format!("{field}: {what}"), Some(field));
    // One constraint of a kind (json, regex, choice, grammar), as `field` gave it.
    let of_kind =
        |field: &'static str, kind: &str, v: &Value| -> Result<StructuredOutput, ApiError> {
            let string = || {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad(field, &format!("{kind} must be a string")))
            };
            match kind {
                // NOTE: vLLM takes a schema given as a JSON string too.
                "json" => match v {
                    Value::String(s) => serde_json::from_str(s)
                        .map(StructuredOutput::Json)
                        .map_err(|e| bad(field, &format!("the schema is not valid JSON: {e}"))),
                    v => Ok(StructuredOutput::Json(v.clone())),
                },
                "regex" => string().map(StructuredOutput::Regex),
                "grammar" => string().map(StructuredOutput::Grammar),
                "choice" => serde_json::from_value(v.clone())
                    .map(StructuredOutput::Choice)
                    .map_err(|_| bad(field, "choice must be a list of strings")),
                "json_object" => match v.as_bool() {
                    Some(true) => Ok(StructuredOutput::JsonObject),
                    _ => Err(bad(field, "json_object must be true")),
                },
                other => Err(bad(
                    field,
                    &format!(
                        "'{}' is not supported (json, regex, choice, grammar, json_object)",
                        crate::untrusted::text(other)
                    ),
                )),
            }
        };
    let mut found: Vec<(StructuredOutput, &'static str)> = Vec::new();
    let given = |k: &str| body.get(k).filter(|v| !v.is_null());
    if let Some(rf) = given("response_format") {
        const F: &str = "response_format";
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((StructuredOutput::JsonObject, F)),
            Some("json_schema") => {
                let s = rf
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .ok_or_else(|| bad(F, "json_schema.schema is missing"))?;
                found.push((of_kind(F, "json", s)?, F));
            }
            _ => {
                return Err(bad(
                    F,
                    "type must be \"text\", \"json_object\" or \"json_schema\"",
                ));
            }
        }
    }
    for (field, kind) in [
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
        // llama.cpp's fields
        ("grammar", "grammar"),
        ("json_schema", "json"),
    ] {
        if let Some(v) = given(field) {
            found.push((of_kind(field, kind, v)?, field));
        }
    }
    // How JSON may be laid out (llguidance's options; see `with_layout`), with the field that
    // asked.
    let mut layout: Option<(Value, &'static str)> = None;
    if let Some(p) = given("guided_whitespace_pattern") {
        let p = p
            .as_str()
            .ok_or_else(|| bad("guided_whitespace_pattern", "must be a string"))?;
        layout = Some((
            json!({"whitespace_pattern": p}),
            "guided_whitespace_pattern",
        ));
    }
    if let Some(so) = given("structured_outputs") {
        const F: &str = "structured_outputs";
        let o = so.as_object().ok_or_else(|| bad(F, "must be an object"))?;
        for (k, v) in o.iter().filter(|(_, v)| !v.is_null()) {
            match k.as_str() {
                // NOTE: vLLM's options; here JSON has no free whitespace unless asked.
                "disable_any_whitespace" => match v.as_bool() {
                    Some(true) => {}
                    Some(false) => layout = Some((json!({"whitespace_flexible": true}), F)),
                    None => return Err(bad(F, "disable_any_whitespace must be a boolean")),
                },
                "whitespace_pattern" => {
                    let p = v
                        .as_str()
                        .ok_or_else(|| bad(F, "whitespace_pattern must be a string"))?;
                    layout = Some((json!({"whitespace_pattern": p}), F));
                }
                _ if *v == Value::Bool(false) => {}
                _ => found.push((of_kind(F, k, v)?, F)),
            }
        }
    }
    // NOTE: the backend is llguidance whatever is asked; a request that names another one
    // (xgrammar, outlines) is told so rather than silently served by this one.
    if let Some(b) = given("guided_decoding_backend") {
        let name = b.as_str().unwrap_or_default();
        if !matches!(name, "auto" | "guidance" | "llguidance") {
            return Err(bad(
                "guided_decoding_backend",
                "only \"guidance\" (llguidance) is available",
            ));
        }
    }
    if found.len() > 1 {
        let fields: Vec<&str> = found.iter().map(|(_, f)| *f).collect();
        return Err(ApiError::invalid(
            format!(
                "give one structured output constraint, not several ({})",
                fields.join(", ")
            ),
            Some(fields[1]),
        ));
    }
    let Some((layout, field)) = layout else {
        return Ok(found.pop());
    };
    match found.pop() {
        Some((StructuredOutput::JsonObject, f)) => Ok(Some((
            StructuredOutput::Json(json!({"type": "object", LAYOUT_KEY: layout})),
            f,
        ))),
        Some((StructuredOutput::Json(mut schema), f)) if schema.is_object() => {
            schema[LAYOUT_KEY] = layout;
            Ok(Some((StructuredOutput::Json(schema), f)))
        }
        _ => Err(bad(
            field,
            "whitespace options apply to a JSON constraint (json, json_object, response_format), and there is none",
        )),
    }
}

/// Names the request's own field in an error about its structured-output constraint.
pub(super) fn name_structured_field(mut e: ApiError, field: Option<&str>) -> ApiError {
    if let Some(f) = field
        && e.param.as_deref() == Some("structured_outputs")
    {
        e.param = Some(f.to_string());
    }
    e
}

/// `stream_options` only means something on a stream (vLLM and OpenAI refuse it otherwise).
pub(super) fn check_stream_options(
    stream: bool,
    options: &Option<StreamOptions>,
) -> Result<(), ApiError> {
    if options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options can only be given when stream is true",
            Some("stream_options"),
        ));
    }
    Ok(())
}

/// Prompt log-probabilities come with the first output; they are not streamed (as in vLLM).
pub(super) fn check_stream_prompt_logprobs(
    p: &SamplingParams,
    stream: bool,
) -> Result<(), ApiError> {
    if stream && p.prompt_logprobs.is_some() {
        return Err(ApiError::unsupported(
            "prompt log-probabilities (prompt_logprobs, or echo with logprobs) are not available when streaming",
            "prompt_logprobs",
        ));
    }
    Ok(())
}

/// `best_of > n` returns the best completions once all have ended: nothing to stream before.
pub(super) fn check_stream_best_of(p: &SamplingParams, stream: bool) -> Result<(), ApiError> {
    if stream && p.best_of() > p.n {
        return Err(ApiError::invalid(
            format!(
                "best_of ({}) > n ({}) cannot be streamed: the best completions are known only when all have ended",
                p.best_of(),
                p.n
            ),
            Some("best_of"),
        ));
    }
    Ok(())
}

/// Refuses a text too long to be a prompt before tokenizing it: it has more tokens than the
/// model's context holds, and tokenizing it would cost memory and CPU in proportion.
pub(super) fn check_text_len(st: &AppState, len: usize, param: &str) -> Result<(), ApiError> {
    if len > st.max_prompt_bytes {
        return Err(ApiError::invalid(
            format!(
                "the text is {len} bytes long: more tokens than the model's context of {} tokens \
                 can hold (no token here stands for more than {} bytes)",
                st.max_model_len,
                st.max_prompt_bytes / st.max_model_len.max(1)
            ),
            Some(param),
        ));
    }
    Ok(())
}

/// A prompt of a completions request, before tokenizing.
pub(super) enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
}

pub(super) fn token_list(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|x| x.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

pub(super) fn parse_prompts(v: &Value) -> Result<Vec<PromptIn>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
            Some("prompt"),
        )
    };
    match v {
        Value::String(s) => Ok(vec![PromptIn::Text(s.clone())]),
        Value::Array(items) if items.is_empty() => Err(ApiError::invalid(
            "prompt must not be an empty list",
            Some("prompt"),
        )),
        Value::Array(items) => {
            if items.iter().all(Value::is_string) {
                Ok(items
                    .iter()
                    .filter_map(|s| s.as_str().map(|s| PromptIn::Text(s.to_string())))
                    .collect())
            } else if items.iter().all(Value::is_number) {
                Ok(vec![PromptIn::Tokens(token_list(items).ok_or_else(bad)?)])
            } else if items.iter().all(Value::is_array) {
                items
                    .iter()
                    .map(|x| {
                        let list = x.as_array().map(Vec::as_slice).unwrap_or_default();
                        token_list(list).map(PromptIn::Tokens).ok_or_else(bad)
                    })
                    .collect()
            } else {
                Err(bad())
            }
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_defaults_fill_what_a_request_leaves_out() {
        let model = SamplingDefaults {
            temperature: Some(0.6),
            top_k: Some(20),
            ..Default::default()
        };
        let p = sampling_params(&SamplingFields::default(), Some(8), None, &model).unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p), (0.6, 20, 1.0));
        let f = SamplingFields {
            temperature: Some(0.0),
            ..Default::default()
        };
        let p = sampling_params(&f, Some(8), None, &model).unwrap();
        assert_eq!((p.temperature, p.top_k), (0.0, 20));
        // a model without defaults: OpenAI's
        let p =
            sampling_params(&SamplingFields::default(), None, None, &Default::default()).unwrap();
        assert_eq!(
            p,
            SamplingParams {
                max_tokens: None,
                ..SamplingParams::default()
            }
        );
    }

    #[test]
    fn json_layout_options() {
        let so = |body: Value| structured_output(&body);
        // Free whitespace asked back, on a JSON object.
        let (c, f) = so(json!({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": false}}))
            .unwrap()
            .unwrap();
        assert_eq!(f, "response_format");
        assert_eq!(
            c,
            StructuredOutput::Json(
                json!({"type": "object", "x-guidance": {"whitespace_flexible": true}})
            )
        );
        // A pattern, on a schema.
        let (c, _) =
            so(json!({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]?"}))
                .unwrap()
                .unwrap();
        assert_eq!(
            c,
            StructuredOutput::Json(
                json!({"type": "object", "x-guidance": {"whitespace_pattern": "[ ]?"}})
            )
        );
        // The default asks for nothing more; options without JSON are refused.
        let (c, _) = so(json!({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": true}}))
            .unwrap()
            .unwrap();
        assert_eq!(c, StructuredOutput::Json(json!({"type": "object"})));
        assert!(so(json!({"guided_regex": "a+", "guided_whitespace_pattern": " "})).is_err());
        assert!(so(json!({"structured_outputs": {"whitespace_pattern": 5, "json": {}}})).is_err());
    }

    #[test]
    fn prompts_of_every_shape() {
        let p = parse_prompts(&serde_json::json!("hi")).unwrap();
        assert!(matches!(&p[..], [PromptIn::Text(t)] if t == "hi"));
        let p = parse_prompts(&serde_json::json!(["a", "b"])).unwrap();
        assert_eq!(p.len(), 2);
        let p = parse_prompts(&serde_json::json!([1, 2, 3])).unwrap();
        assert!(matches!(&p[..], [PromptIn::Tokens(t)] if t == &[1, 2, 3]));
        let p = parse_prompts(&serde_json::json!([[1], [2, 3]])).unwrap();
        assert_eq!(p.len(), 2);
        for bad in [
            serde_json::json!([]),
            serde_json::json!([1, "a"]),
            serde_json::json!([-1]),
            serde_json::json!([1.5]),
            serde_json::json!(5),
            serde_json::json!(null),
            serde_json::json!([[1], ["a"]]),
        ] {
            let e = parse_prompts(&bad).err().unwrap();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.param.as_deref(), Some("prompt"));
        }
    }
}
