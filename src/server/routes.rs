//! The HTTP routes: OpenAI's `/v1/models`, `/v1/completions`, `/v1/chat/completions`, and vLLM's
//! `/health`, `/version`, `/tokenize`, `/detokenize`, `/metrics`.
//!
//! A handler parses and checks the body, tokenizes the prompt (off the async workers), sends the
//! engine thread one `Add`, then either collects the request's events into one response or turns
//! them into a stream of Server-Sent Events. An [`AbortGuard`] aborts the engine requests when
//! the handler (or the stream) is dropped before the end — which is what happens when the client
//! disconnects.

use super::AppState;
use super::error::ApiError;
use super::streaming::{self, ChatStream, CompletionStream};
use super::types::*;
use super::worker::{AddError, Command, Event, EventKind, SubRequest};
use crate::engine::{Prompt, RequestError};
use crate::sampling::{SamplingDefaults, SamplingParams, StructuredOutput, TokenLogprobs};
use crate::sched::{FinishReason, RequestId};
use crate::tokenizer::{ChatMessage, Tokenizer};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc as tmpsc, oneshot};

type St = State<Arc<AppState>>;

pub fn router(state: Arc<AppState>) -> Router {
    // NOTE: the key covers every route that does work for the caller (tokenizing is work:
    // a long text costs seconds of CPU), not only /v1; /health, /version and /metrics stay
    // open for probes and scrapers, as in vLLM.
    let keyed = Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(keyed)
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(state.max_body_bytes))
        .with_state(state)
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn require_api_key(State(st): St, req: Request, next: Next) -> Response {
    if !has_key(&st, &req) {
        return ApiError::unauthorized().into_response();
    }
    next.run(req).await
}

/// Whether the request carries the server's API key (or none is required).
fn has_key(st: &AppState, req: &Request) -> bool {
    let Some(key) = &st.api_key else {
        return true;
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()))
}

/// Compares without an early exit, so the time taken does not tell how much of a key matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(!x));
    }
    diff == 0
}

/// An unknown route: 404, except under `/v1` without the key, which is 401 first (as vLLM
/// does: which routes exist is not told to callers without the key).
async fn fallback(State(st): St, req: Request) -> ApiError {
    if req.uri().path().starts_with("/v1") && !has_key(&st, &req) {
        return ApiError::unauthorized();
    }
    ApiError::not_found(req.uri().path())
}

async fn method_not_allowed(uri: Uri, method: axum::http::Method) -> ApiError {
    ApiError::method_not_allowed(&method, uri.path())
}

/// The model generates text; it has no embedding head.
async fn embeddings() -> ApiError {
    ApiError::invalid(
        "embeddings are not supported by this model: it is served for generation only",
        Some("model"),
    )
}

async fn health(State(st): St) -> StatusCode {
    if st.dead.load(Ordering::Relaxed) {
        StatusCode::INTERNAL_SERVER_ERROR
    } else if st.draining.load(Ordering::Relaxed) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn version() -> Json<Value> {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

async fn metrics(State(st): St) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

async fn list_models(State(st): St) -> Json<ModelList> {
    let data = st
        .model_names
        .iter()
        .map(|name| ModelCard {
            id: name.clone(),
            object: "model",
            created: st.created,
            owned_by: "pagoda",
            root: st.model_root.clone(),
            parent: None,
            max_model_len: st.max_model_len,
        })
        .collect();
    Json(ModelList {
        object: "list",
        data,
    })
}

/// Reads a JSON body (413 over the size limit, 400 when it is not JSON).
fn read_json(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
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
fn from_json<T: DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
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

fn parse_body<T: DeserializeOwned>(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    from_json(&read_json(st, body)?)
}

fn check_model(st: &AppState, model: &Option<String>) -> Result<String, ApiError> {
    match model {
        Some(m) if !st.model_names.iter().any(|n| n == m) => Err(ApiError::model_not_found(m)),
        Some(m) => Ok(m.clone()),
        None => Ok(st.model_names[0].clone()),
    }
}

fn check_accepting(st: &AppState) -> Result<(), ApiError> {
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

/// The engine's sampling parameters from the request's fields.
fn sampling_params(
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
const UNSUPPORTED: &[&str] = &[
    "guided_whitespace_pattern",
    "allowed_token_ids",
    "truncate_prompt_tokens",
    "use_beam_search",
];

/// The fields only chat completions refuse (on top of [`UNSUPPORTED`]).
const UNSUPPORTED_CHAT: &[&str] = &["functions", "function_call", "documents"];

fn refuse_unsupported(body: &Value, fields: &[&str]) -> Result<(), ApiError> {
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
/// OpenAI's `response_format`, vLLM's `structured_outputs` or its older `guided_*` fields. At
/// most one may be given.
fn structured_output(body: &Value) -> Result<Option<(StructuredOutput, &'static str)>, ApiError> {
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
    ] {
        if let Some(v) = given(field) {
            found.push((of_kind(field, kind, v)?, field));
        }
    }
    if let Some(so) = given("structured_outputs") {
        const F: &str = "structured_outputs";
        let o = so.as_object().ok_or_else(|| bad(F, "must be an object"))?;
        for (k, v) in o
            .iter()
            .filter(|(_, v)| !v.is_null() && **v != Value::Bool(false))
        {
            found.push((of_kind(F, k, v)?, F));
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
    Ok(found.pop())
}

/// The id of call `k` of choice `index` of response `response_id`: unique, in OpenAI's
/// `call_…` form.
pub fn call_id(response_id: &str, index: usize, k: usize) -> String {
    let tail = response_id.rsplit('-').next().unwrap_or(response_id);
    format!("call_{tail}{index:02x}{k:02x}")
}

/// Names the request's own field in an error about its structured-output constraint.
fn name_structured_field(mut e: ApiError, field: Option<&str>) -> ApiError {
    if let Some(f) = field
        && e.param.as_deref() == Some("structured_outputs")
    {
        e.param = Some(f.to_string());
    }
    e
}

/// `stream_options` only means something on a stream (vLLM and OpenAI refuse it otherwise).
fn check_stream_options(stream: bool, options: &Option<StreamOptions>) -> Result<(), ApiError> {
    if options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options can only be given when stream is true",
            Some("stream_options"),
        ));
    }
    Ok(())
}

/// Prompt log-probabilities come with the first output; they are not streamed (as in vLLM).
fn check_stream_prompt_logprobs(p: &SamplingParams, stream: bool) -> Result<(), ApiError> {
    if stream && p.prompt_logprobs.is_some() {
        return Err(ApiError::unsupported(
            "prompt log-probabilities (prompt_logprobs, or echo with logprobs) are not available when streaming",
            "prompt_logprobs",
        ));
    }
    Ok(())
}

/// vLLM's `prompt_logprobs` entries: `null` for the first token, then for each position the
/// prompt token and the top tokens, by id: `{logprob, rank, decoded_token}`.
fn prompt_logprobs_json(tok: &Tokenizer, lps: &[crate::engine::PromptLogprob]) -> Value {
    let entry = |id: u32, logprob: f32, rank: usize| {
        serde_json::json!({
            "logprob": logprob,
            "rank": rank,
            "decoded_token": token_repr(&tok.token_bytes(id)),
        })
    };
    let mut out = vec![Value::Null];
    for p in lps {
        let mut m = serde_json::Map::new();
        m.insert(
            p.logprobs.token_id.to_string(),
            entry(p.logprobs.token_id, p.logprobs.logprob, p.rank),
        );
        for (r, &(id, l)) in p.logprobs.top.iter().enumerate() {
            m.entry(id.to_string())
                .or_insert_with(|| entry(id, l, r + 1));
        }
        out.push(Value::Object(m));
    }
    Value::Array(out)
}

/// The echoed prompt's part of legacy completion log-probs: every prompt token, the first
/// unscored (`null`), as OpenAI returns them with `echo` and `logprobs`.
fn echo_logprobs_of(
    tok: &Tokenizer,
    prompt: &[u32],
    lps: &[crate::engine::PromptLogprob],
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut offsets = TextOffsets::new(0);
    for (i, &id) in prompt.iter().enumerate() {
        let bytes = tok.token_bytes(id);
        out.text_offset.push(offsets.advance(&bytes));
        out.tokens.push(token_repr(&bytes));
        match i.checked_sub(1).and_then(|j| lps.get(j)) {
            Some(p) => {
                out.token_logprobs.push(Some(p.logprobs.logprob));
                let mut top = serde_json::Map::new();
                for &(t, l) in &p.logprobs.top {
                    top.entry(token_repr(&tok.token_bytes(t)))
                        .or_insert(Value::from(l));
                }
                out.top_logprobs.push(Some(top));
            }
            None => {
                out.token_logprobs.push(None);
                out.top_logprobs.push(None);
            }
        }
    }
    out
}

/// `best_of > n` returns the best completions once all have ended: nothing to stream before.
fn check_stream_best_of(p: &SamplingParams, stream: bool) -> Result<(), ApiError> {
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

/// A prompt of a completions request, before tokenizing.
enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
}

fn token_list(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|x| x.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

fn parse_prompts(v: &Value) -> Result<Vec<PromptIn>, ApiError> {
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

/// Runs tokenizer work on the blocking pool (long prompts must not hold up the async workers),
/// at most one task per core at a time: the others wait their turn instead of taking memory
/// and CPU from the engine all at once.
async fn blocking<T: Send + 'static>(
    st: &AppState,
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let _slot = st
        .tokenizer_slots
        .acquire()
        .await
        .map_err(|_| ApiError::internal("the tokenizer pool is closed"))?;
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

/// Refuses a text too long to be a prompt before tokenizing it: it has more tokens than the
/// model's context holds, and tokenizing it would cost memory and CPU in proportion.
fn check_text_len(st: &AppState, len: usize, param: &str) -> Result<(), ApiError> {
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

/// Aborts the engine requests when dropped before [`AbortGuard::disarm`]: a dropped handler or
/// stream means the client is gone.
pub struct AbortGuard {
    ids: Vec<RequestId>,
    st: Arc<AppState>,
    armed: bool,
}

impl AbortGuard {
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.st.send(Command::Abort(std::mem::take(&mut self.ids)));
        }
    }
}

/// Queues the sub-requests; returns their event channel and the guard that aborts them.
async fn submit(
    st: &Arc<AppState>,
    requests: Vec<SubRequest>,
    log_id: &str,
    arrival: Instant,
    prompt_param: &str,
    max_tokens_given: bool,
) -> Result<(tmpsc::UnboundedReceiver<Event>, AbortGuard), ApiError> {
    let lens: Vec<usize> = requests
        .iter()
        .map(|r| match &r.prompt {
            Prompt::Tokens(t) => t.len(),
            Prompt::Text(_) => 0,
        })
        .collect();
    let (events, rx) = tmpsc::unbounded_channel();
    let (reply, reply_rx) = oneshot::channel();
    st.send(Command::Add {
        requests,
        log_id: log_id.to_string(),
        arrival,
        events,
        reply,
    })?;
    let ids = reply_rx
        .await
        .map_err(|_| ApiError::internal("the engine thread is gone"))?
        .map_err(|e| match e {
            AddError::QueueFull { max_waiting } => ApiError::overloaded(format!(
                "the server is at capacity: {max_waiting} requests are already waiting (--max-waiting); try again later"
            )),
            AddError::Dead => ApiError::internal("the engine has failed; restart the server"),
            AddError::Request { index, error } => match error {
                RequestError::InvalidParam(p) => ApiError::invalid(p.message, Some(p.param)),
                RequestError::PromptTooLong(m) => {
                    let prompt_fits = lens.get(index).is_some_and(|&l| l < st.max_model_len);
                    let param = if max_tokens_given && prompt_fits {
                        "max_tokens"
                    } else {
                        prompt_param
                    };
                    ApiError::invalid(m, Some(param))
                }
                RequestError::InvalidPrompt(m) => ApiError::invalid(m, Some(prompt_param)),
                RequestError::Internal(e) => ApiError::internal(format!("{e:#}")),
            },
        })?;
    let guard = AbortGuard {
        ids,
        st: st.clone(),
        armed: true,
    };
    Ok((rx, guard))
}

/// One sub-request's complete result.
#[derive(Default)]
struct Collected {
    text: String,
    logprobs: Vec<TokenLogprobs>,
    prompt_logprobs: Option<Vec<crate::engine::PromptLogprob>>,
    finish: Option<FinishReason>,
    prompt_tokens: usize,
    output_tokens: usize,
}

async fn collect(
    rx: &mut tmpsc::UnboundedReceiver<Event>,
    n: usize,
) -> Result<Vec<Collected>, ApiError> {
    let mut out: Vec<Collected> = (0..n).map(|_| Collected::default()).collect();
    let mut left = n;
    while left > 0 {
        let Some(ev) = rx.recv().await else {
            return Err(ApiError::internal("the engine thread is gone"));
        };
        let Some(c) = out.get_mut(ev.index) else {
            continue;
        };
        match ev.kind {
            EventKind::Output(o) => {
                c.text.push_str(&o.new_text);
                c.logprobs.extend(o.new_logprobs);
                if o.prompt_logprobs.is_some() {
                    c.prompt_logprobs = o.prompt_logprobs;
                }
                c.prompt_tokens = o.num_prompt_tokens;
                c.output_tokens = o.num_output_tokens;
                if o.finish_reason.is_some() && c.finish.is_none() {
                    left -= 1;
                }
                c.finish = c.finish.or(o.finish_reason);
            }
            EventKind::Error(m) => return Err(ApiError::internal(m)),
        }
    }
    Ok(out)
}

/// A token as log-probs name it: its text when its bytes are whole UTF-8 characters, else
/// vLLM's lossless `bytes:\xNN…` form, so that the fragments of a character split over
/// tokens are told apart (and never share a `top_logprobs` key).
pub fn token_repr(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => {
            let mut out = String::from("bytes:");
            for b in bytes {
                out.push_str(&format!("\\x{b:02x}"));
            }
            out
        }
    }
}

/// Where each token's text starts, in characters of the choice's text: a token whose bytes
/// end inside a character (an emoji split over tokens) adds its character only once the
/// token that completes it comes.
#[derive(Debug, Clone, Default)]
pub struct TextOffsets {
    chars: usize,
    pending: Vec<u8>,
}

impl TextOffsets {
    /// Offsets after `chars` characters of text (the echoed prompt).
    pub fn new(chars: usize) -> Self {
        TextOffsets {
            chars,
            pending: Vec::new(),
        }
    }

    /// The offset of a token with these bytes; then moves past them.
    fn advance(&mut self, bytes: &[u8]) -> usize {
        let at = self.chars;
        self.pending.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    self.chars += s.chars().count();
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    self.chars += String::from_utf8_lossy(&self.pending[..valid])
                        .chars()
                        .count();
                    match e.error_len() {
                        // NOTE: bytes that can never be a character show as one U+FFFD.
                        Some(bad) => {
                            self.chars += 1;
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                    }
                }
            }
        }
        at
    }
}

pub fn completion_logprobs(
    tok: &Tokenizer,
    lps: &[TokenLogprobs],
    offsets: &mut TextOffsets,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for lp in lps {
        let bytes = tok.token_bytes(lp.token_id);
        let s = token_repr(&bytes);
        out.text_offset.push(offsets.advance(&bytes));
        out.token_logprobs.push(Some(lp.logprob));
        let mut top = serde_json::Map::new();
        for &(id, l) in &lp.top {
            top.entry(token_repr(&tok.token_bytes(id)))
                .or_insert(Value::from(l));
        }
        top.entry(s.clone()).or_insert(Value::from(lp.logprob));
        out.top_logprobs.push(Some(top));
        out.tokens.push(s);
    }
    out
}

pub fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs]) -> ChatLogprobs {
    let entry = |id: u32| {
        let bytes = tok.token_bytes(id);
        (token_repr(&bytes), bytes)
    };
    ChatLogprobs {
        content: lps
            .iter()
            .map(|lp| {
                let (token, bytes) = entry(lp.token_id);
                ChatTokenLogprob {
                    token,
                    bytes,
                    logprob: lp.logprob,
                    top_logprobs: lp
                        .top
                        .iter()
                        .map(|&(id, logprob)| {
                            let (token, bytes) = entry(id);
                            TopLogprob {
                                token,
                                bytes,
                                logprob,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

fn finish_str(f: Option<FinishReason>) -> Option<&'static str> {
    f.map(FinishReason::as_str)
}

async fn completions(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    match completions_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body = read_json(&st, body)?;
    let req: CompletionRequest = from_json(&body)?;
    let sampling: SamplingFields = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    check_accepting(&st)?;
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix is not supported", "suffix"));
    }
    refuse_unsupported(&body, UNSUPPORTED)?;
    let structured = structured_output(&body)?;
    let field = structured.as_ref().map(|(_, f)| *f);
    let echo = req.echo.unwrap_or(false);
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
            PromptIn::Text(t) => check_text_len(&st, t.len(), "prompt")?,
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
                PromptIn::Text(t) if t.is_empty() => {
                    Err(ApiError::invalid("the prompt is empty", Some("prompt")))
                }
                PromptIn::Text(t) => tok
                    .encode(&t)
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
    let prompt_ids: Vec<Vec<u32>> = if params_prompt_logprobs {
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
        );
        return Ok(streaming::response(
            rx,
            guard,
            n,
            samples,
            include_usage,
            fmt,
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
                let tail = completion_logprobs(&st.tokenizer, &c.logprobs, &mut offsets);
                match prompt_ids.get(index) {
                    Some(ids) if echo_logprobs => {
                        let mut head = echo_logprobs_of(&st.tokenizer, ids, scored);
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
                prompt_logprobs: sampling
                    .prompt_logprobs
                    .map(|_| prompt_logprobs_json(&st.tokenizer, scored)),
            }
        })
        .collect();
    Ok(Json(CompletionResponse {
        id,
        object: "text_completion",
        created,
        model,
        choices,
        usage: UsageField::Some(usage),
    })
    .into_response())
}

/// The conversation as the chat template sees it.
fn chat_messages(messages: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    messages
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
        .collect()
}

/// A request's conversation, how to render it, and its length checked before rendering.
fn chat_input(
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
struct ChatRender {
    add_generation_prompt: bool,
    continue_final_message: bool,
}

impl ChatRender {
    fn new(
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
    fn apply(
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

async fn chat_completions(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    match chat_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body = read_json(&st, body)?;
    let req: ChatRequest = from_json(&body)?;
    let sampling: SamplingFields = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    check_accepting(&st)?;
    refuse_unsupported(&body, UNSUPPORTED)?;
    refuse_unsupported(&body, UNSUPPORTED_CHAT)?;
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
        .map_err(|mut e| {
            if e.param.as_deref() == Some("logprobs") {
                e.param = Some("top_logprobs".into());
            }
            e
        })?;
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
    let tok = st.tokenizer.clone();
    let max_bytes = st.max_prompt_bytes;
    let max_len = st.max_model_len;
    let rendered_tools = (!raw_tools.is_empty()).then_some(raw_tools);
    let ids = blocking(&st, move || {
        let text = render.apply(&tok, &messages, rendered_tools.as_deref())?;
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
    .await?;
    let id = st.new_id("chatcmpl");
    let (mut rx, mut guard) = submit(
        &st,
        vec![SubRequest {
            prompt: Prompt::Tokens(ids),
            params,
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
        .with_echo(echo);
        return Ok(streaming::response(
            rx,
            guard,
            samples,
            samples,
            include_usage,
            fmt,
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
                logprobs: want_logprobs.then(|| chat_logprobs(&st.tokenizer, &c.logprobs)),
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
            }
        })
        .collect();
    Ok(Json(ChatResponse {
        id,
        object: "chat.completion",
        created,
        model,
        choices,
        usage,
        prompt_logprobs,
    })
    .into_response())
}

async fn tokenize(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let req: TokenizeRequest = parse_body(&st, body)?;
        check_model(&st, &req.model)?;
        let tok = st.tokenizer.clone();
        let special = req.add_special_tokens.unwrap_or(true);
        let text = match (req.prompt, req.messages) {
            (Some(p), None) => p,
            (None, Some(m)) => {
                let (messages, render) = chat_input(
                    &st,
                    &m,
                    req.add_generation_prompt,
                    req.continue_final_message,
                )?;
                let tok = tok.clone();
                blocking(&st, move || render.apply(&tok, &messages, None)).await?
            }
            _ => {
                return Err(ApiError::invalid(
                    "give either prompt or messages",
                    Some("prompt"),
                ));
            }
        };
        check_text_len(&st, text.len(), "prompt")?;
        let tokens = blocking(&st, move || {
            let r = if special {
                tok.encode(&text)
            } else {
                tok.inner()
                    .encode_fast(text.as_str(), false)
                    .map(|e| e.get_ids().to_vec())
                    .map_err(|e| anyhow::anyhow!("tokenizing failed: {e}"))
            };
            r.map_err(|e| ApiError::invalid(format!("{e:#}"), Some("prompt")))
        })
        .await?;
        Ok::<_, ApiError>(Json(TokenizeResponse {
            count: tokens.len(),
            max_model_len: st.max_model_len,
            tokens,
        }))
    };
    match run.await {
        Ok(r) => r.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let req: DetokenizeRequest = parse_body(&st, body)?;
        check_model(&st, &req.model)?;
        let vocab = st.vocab_size;
        if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
                Some("tokens"),
            ));
        }
        let tok = st.tokenizer.clone();
        let prompt = blocking(&st, move || {
            tok.decode(&req.tokens, false)
                .map_err(|e| ApiError::invalid(format!("{e:#}"), Some("tokens")))
        })
        .await?;
        Ok::<_, ApiError>(Json(DetokenizeResponse { prompt }))
    };
    match run.await {
        Ok(r) => r.into_response(),
        Err(e) => e.into_response(),
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

    #[test]
    fn offsets_count_characters_once_complete() {
        // "a", then an emoji's four bytes over three tokens, then "b".
        let emoji = "😀".as_bytes();
        let mut o = TextOffsets::new(5);
        let got: Vec<usize> = [
            b"a".as_slice(),
            &emoji[..1],
            &emoji[1..3],
            &emoji[3..],
            b"b",
        ]
        .iter()
        .map(|t| o.advance(t))
        .collect();
        assert_eq!(got, [5, 6, 6, 6, 7]);
        assert_eq!(o.advance(b""), 8);
        // A byte that can never start a character counts as one U+FFFD.
        let mut o = TextOffsets::new(0);
        assert_eq!(
            (o.advance(&[0xff]), o.advance(b"x"), o.advance(b"")),
            (0, 1, 2)
        );
    }

    #[test]
    fn token_names_are_lossless() {
        assert_eq!(token_repr(b"hi"), "hi");
        assert_eq!(token_repr("é".as_bytes()), "é");
        assert_eq!(token_repr(&[0xf0, 0x9f]), "bytes:\\xf0\\x9f");
        assert_ne!(token_repr(&[0xf0]), token_repr(&[0x9f]));
    }

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }

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
            {"role": "tool", "tool_call_id": "call_1", "content": "x"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
            ]},
        ]))
        .unwrap();
        let out = chat_messages(&m).unwrap();
        assert_eq!(out[0].tool_call_id.as_deref(), Some("call_1"));
        let calls = out[1].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"]["a"], 1);
        for bad in [
            serde_json::json!([{"role": "robot", "content": "x"}]),
            serde_json::json!([{"role": "user", "content": "x", "tool_calls": []}]),
            serde_json::json!([{"role": "assistant", "tool_calls": [{"id": "x"}]}]),
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
