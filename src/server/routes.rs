//! The router: OpenAI's `/v1/models`, `/v1/completions` (`completions.rs`),
//! `/v1/chat/completions` (`chat.rs`), Anthropic's `/v1/messages` (`anthropic.rs`), OpenAI's
//! `/v1/responses` (`responses.rs`), `/v1/embeddings`, `/v1/score` and `/v1/rerank`
//! (`pooling.rs`), llama.cpp's `/infill` (`infill.rs`), and vLLM's `/health`, `/version`, `/tokenize`,
//! `/detokenize`, `/metrics`; the API key check, and the errors for unknown routes and methods.
//!
//! A generating handler parses and checks the body (`params.rs`), tokenizes the prompt (off the
//! async workers), sends the engine thread one `Add`, then either collects the request's events
//! into one response (`response.rs`) or turns them into a stream of Server-Sent Events
//! (`streaming.rs`). An `AbortGuard` aborts the engine requests when the handler (or the stream)
//! is dropped before the end — which is what happens when the client disconnects.

use super::anthropic;
use super::chat::{chat_completions, chat_input};
use super::completions::completions;
use super::error::ApiError;
use super::infill;
use super::params::{check_model, check_text_len, parse_body};
use super::pooling;
use super::response::blocking;
use super::responses;
use super::state::{AppState, St};
use super::types::*;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub fn router(state: Arc<AppState>) -> Router {
    // NOTE: the key covers every route that does work for the caller (tokenizing is work:
    // a long text costs seconds of CPU), not only /v1; /health, /version and /metrics stay
    // open for probes and scrapers, as in vLLM.
    let keyed = Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/embeddings", post(pooling::embeddings))
        .route("/v1/score", post(pooling::score))
        .route("/score", post(pooling::score))
        .route("/v1/rerank", post(pooling::rerank))
        .route("/rerank", post(pooling::rerank))
        .route("/v2/rerank", post(pooling::rerank))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/infill", post(infill::infill))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
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

async fn require_api_key(State(st): St, req: Request, next: Next) -> Response {
    if !has_key(&st, &req) {
        if req.uri().path().starts_with("/v1/messages") {
            return anthropic::error_response(ApiError::unauthorized());
        }
        return ApiError::unauthorized().into_response();
    }
    next.run(req).await
}

/// Whether the request carries the server's API key (or none is required): as OpenAI's
/// clients send it (`Authorization: Bearer KEY`) or Anthropic's (`x-api-key: KEY`).
fn has_key(st: &AppState, req: &Request) -> bool {
    let Some(key) = &st.api_key else {
        return true;
    };
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let bearer = header(header::AUTHORIZATION.as_str()).and_then(|v| v.strip_prefix("Bearer "));
    [bearer, header("x-api-key")]
        .into_iter()
        .flatten()
        .any(|g| constant_time_eq(g.trim().as_bytes(), key.as_bytes()))
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
    let card = |id: &str, parent: Option<String>| ModelCard {
        id: id.to_string(),
        object: "model",
        created: st.created,
        owned_by: "pagoda",
        root: st.model_root.clone(),
        parent,
        max_model_len: st.max_model_len,
    };
    let mut data: Vec<ModelCard> = st.model_names.iter().map(|n| card(n, None)).collect();
    // NOTE: as vLLM's, an adapter's card has its path as the root and the base model (or
    // its --lora-modules base_model_name) as the parent.
    if let Some(loras) = &st.loras {
        let loras = loras.read().unwrap_or_else(|e| e.into_inner());
        data.extend(loras.iter().map(|l| {
            let parent = l.parent.clone().unwrap_or(st.model_names[0].clone());
            ModelCard {
                root: l.path.display().to_string(),
                ..card(&l.name, Some(parent))
            }
        }));
    }
    Json(ModelList {
        object: "list",
        data,
    })
}

/// vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` bodies (`lora_path`
/// only to load; `load_inplace`: replace an adapter of that name).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LoraBody {
    lora_name: String,
    lora_path: Option<String>,
    #[serde(default)]
    load_inplace: bool,
}

async fn load_lora_adapter(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    lora_command(st, body, true).await
}

async fn unload_lora_adapter(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    lora_command(st, body, false).await
}

/// Loads (`load`) or unloads an adapter on the engine thread; the served names follow what the
/// engine says after it.
async fn lora_command(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    load: bool,
) -> Response {
    let run = async {
        let Some(loras) = &st.loras else {
            return Err(ApiError::missing(
                "LoRA adapters are not enabled: start the server with --enable-lora",
            ));
        };
        let req: LoraBody = parse_body(&st, body)?;
        let path = match (load, req.lora_path) {
            (true, Some(p)) => Some(std::path::PathBuf::from(p)),
            (true, None) => {
                return Err(ApiError::invalid(
                    "lora_path is required",
                    Some("lora_path"),
                ));
            }
            (false, _) => None,
        };
        if st.model_names.contains(&req.lora_name) {
            return Err(ApiError::invalid(
                "lora_name must differ from the names the base model is served under",
                Some("lora_name"),
            ));
        }
        let (reply, rx) = tokio::sync::oneshot::channel();
        st.send(super::worker::Command::Lora {
            name: req.lora_name.clone(),
            path,
            replace: req.load_inplace,
            reply,
        })?;
        let result = rx
            .await
            .map_err(|_| ApiError::internal("the engine thread is gone"))?;
        use crate::engine::LoraError;
        let now = match result {
            Ok(now) => now,
            Err(e @ LoraError::NotFound(_)) => return Err(ApiError::missing(e.to_string())),
            Err(e @ LoraError::Exists(_)) => {
                return Err(ApiError::invalid(e.to_string(), Some("lora_name")));
            }
            Err(e) => return Err(ApiError::invalid(e.to_string(), Some("lora_path"))),
        };
        *loras.write().unwrap_or_else(|e| e.into_inner()) = now;
        let verb = if load { "loaded" } else { "unloaded" };
        Ok(format!(
            "Success: LoRA adapter '{}' {verb} successfully.",
            req.lora_name
        ))
    };
    match run.await {
        Ok(text) => text.into_response(),
        Err(e) => e.into_response(),
    }
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
                tok.encode_plain(&text)
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
    fn key_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }
}
