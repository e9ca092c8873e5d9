//! The routes of a model served for embeddings or scores (`--task embed`, `--task score`), as
//! vLLM serves them: OpenAI's `/v1/embeddings`, vLLM's `/v1/score` (and `/score`), and the
//! Jina/Cohere `/v1/rerank` (and `/rerank`, `/v2/rerank`). Every input (or query-document pair)
//! is one engine request, a prefill batched with the rest by the one scheduler; the handler
//! collects their pooled results. A score model scores a pair as the cross-encoder it is (the
//! pair tokenized as its tokenizer lays pairs out); an embedding model scores the cosine of the
//! two embeddings.

use super::error::ApiError;
use super::params::{
    PromptIn, check_accepting, check_model, check_text_len, from_json, ignored_fields,
    parse_prompts, read_json, with_ignored,
};
use super::response::{blocking, collect, submit, unix_now};
use super::state::{AppState, St};
use super::worker::SubRequest;
use crate::engine::{PoolingParams, Prompt, cosine};
use crate::models::pooling::Task;
use crate::sampling::SamplingParams;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Instant;

const KNOWN_EMBEDDINGS: &[&str] = &[
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "user",
    "truncate_prompt_tokens",
    "add_special_tokens",
];
const KNOWN_SCORE: &[&str] = &[
    "model",
    "text_1",
    "text_2",
    "truncate_prompt_tokens",
    "user",
];
const KNOWN_RERANK: &[&str] = &[
    "model",
    "query",
    "documents",
    "top_n",
    "return_documents",
    "truncate_prompt_tokens",
    "user",
];

#[derive(Deserialize)]
struct EmbeddingRequest {
    model: Option<String>,
    input: Value,
    encoding_format: Option<String>,
    dimensions: Option<usize>,
    truncate_prompt_tokens: Option<i64>,
    add_special_tokens: Option<bool>,
}

#[derive(Deserialize)]
struct ScoreRequest {
    model: Option<String>,
    text_1: Value,
    text_2: Value,
    truncate_prompt_tokens: Option<i64>,
}

#[derive(Deserialize)]
struct RerankRequest {
    model: Option<String>,
    query: String,
    documents: Vec<Value>,
    top_n: Option<usize>,
    return_documents: Option<bool>,
    truncate_prompt_tokens: Option<i64>,
}

fn answer(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

pub(super) async fn embeddings(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    answer(embeddings_inner(st, body).await)
}

pub(super) async fn score(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    answer(score_inner(st, body).await)
}

pub(super) async fn rerank(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    answer(rerank_inner(st, body).await)
}

/// The task the model is served for, which must be one of `wanted`.
fn served_for(st: &AppState, wanted: &[Task], route: &str) -> Result<Task, ApiError> {
    let task = st.pooler.as_ref().map_or(Task::Generate, |p| p.task);
    if wanted.contains(&task) {
        return Ok(task);
    }
    let how = match wanted {
        [Task::Embed] => "--task embed",
        _ => "--task score (a cross-encoder or a decoder reranker) or --task embed",
    };
    Err(ApiError::invalid(
        format!(
            "{route} is not served by this model: it is served for {} (--task {}); start the \
             server with {how}",
            match task {
                Task::Generate => "generation",
                Task::Embed => "embeddings",
                Task::Score => "scores",
            },
            task.name()
        ),
        Some("model"),
    ))
}

/// `truncate_prompt_tokens` as the engine takes it: -1 is the model's context (vLLM's
/// convention).
fn truncation(st: &AppState, k: Option<i64>) -> Result<Option<usize>, ApiError> {
    match k {
        None => Ok(None),
        Some(-1) => Ok(Some(st.max_model_len)),
        Some(k) if k >= 1 => Ok(Some(k as usize)),
        Some(k) => Err(ApiError::invalid(
            format!("truncate_prompt_tokens must be -1 or at least 1, got {k}"),
            Some("truncate_prompt_tokens"),
        )),
    }
}

/// Runs every prompt as a pooling request and returns their results and prompt tokens, in
/// order; `param` names the input in errors.
async fn pool(
    st: &Arc<AppState>,
    prompts: Vec<Vec<u32>>,
    params: PoolingParams,
    kind: &str,
    param: &str,
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    let arrival = Instant::now();
    let n = prompts.len();
    let subs = prompts
        .into_iter()
        .map(|ids| SubRequest {
            prompt: Prompt::Tokens(ids),
            params: SamplingParams::default(),
            pooling: Some(params.clone()),
            lora: None,
        })
        .collect();
    let id = st.new_id(kind);
    let (mut rx, mut guard) = submit(st, subs, &id, arrival, param, false).await?;
    let got = collect(&mut rx, n).await?;
    guard.disarm();
    let tokens = got.iter().map(|c| c.prompt_tokens).sum();
    let results = got
        .into_iter()
        .map(|c| {
            c.pooled
                .ok_or_else(|| ApiError::internal("the engine returned no pooled result"))
        })
        .collect::<Result<_, _>>()?;
    Ok((results, tokens))
}

/// Tokenizes texts as inputs to embed or score, off the async workers: with the tokenizer's
/// special tokens unless `special` is false. Texts longer than the context can hold are refused
/// unless they are to be truncated.
async fn tokenize(
    st: &Arc<AppState>,
    inputs: Vec<PromptIn>,
    special: bool,
    truncating: bool,
    param: &'static str,
) -> Result<Vec<Vec<u32>>, ApiError> {
    for p in &inputs {
        if let PromptIn::Text(t) = p
            && !truncating
        {
            check_text_len(st, t.len(), param)?;
        }
    }
    let tok = st.tokenizer.clone();
    blocking(st, move || {
        inputs
            .into_iter()
            .map(|p| match p {
                PromptIn::Tokens(ids) => Ok(ids),
                PromptIn::Text(t) if special => tok.encode_special(&t),
                PromptIn::Text(t) => tok.encode_plain(&t),
            })
            .collect::<anyhow::Result<Vec<_>>>()
            .map_err(|e| ApiError::invalid(format!("{e:#}"), Some(param)))
    })
    .await
}

async fn embeddings_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = read_json(&st, body)?;
    let req: EmbeddingRequest = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    served_for(&st, &[Task::Embed], "/v1/embeddings")?;
    check_accepting(&st)?;
    let ignored = ignored_fields(&st, &body, &[KNOWN_EMBEDDINGS]);
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(f) => {
            return Err(ApiError::invalid(
                format!(
                    "encoding_format must be float or base64, got '{}'",
                    crate::untrusted::text(f)
                ),
                Some("encoding_format"),
            ));
        }
    };
    let inputs = parse_prompts(&req.input).map_err(|e| {
        let mut e = e.renamed("prompt", "input");
        e.message = e.message.replace("prompt", "input");
        e
    })?;
    let truncate = truncation(&st, req.truncate_prompt_tokens)?;
    let special = req.add_special_tokens.unwrap_or(true);
    let ids = tokenize(&st, inputs, special, truncate.is_some(), "input").await?;
    let params = PoolingParams {
        dimensions: req.dimensions,
        truncate_prompt_tokens: truncate,
    };
    let (vectors, tokens) = pool(&st, ids, params, "embd", "input").await?;
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if base64 {
                // NOTE: as OpenAI's: the little-endian bytes of the f32 values.
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    Ok(list(&st, "embd", &model, data, tokens, &ignored))
}

/// The `{"object": "list", "data": ...}` answer of the embeddings and score routes.
fn list(
    st: &AppState,
    kind: &str,
    model: &str,
    data: Vec<Value>,
    tokens: usize,
    ignored: &[String],
) -> Response {
    let out = json!({
        "id": st.new_id(kind),
        "object": "list",
        "created": unix_now(),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    });
    with_ignored(Json(out).into_response(), ignored)
}

/// The score of each (query, document) pair, and the prompt tokens they took.
async fn score_pairs(
    st: &Arc<AppState>,
    pairs: Vec<(String, String)>,
    truncate: Option<usize>,
    param: &'static str,
) -> Result<(Vec<f32>, usize), ApiError> {
    let task = served_for(st, &[Task::Score, Task::Embed], "scoring")?;
    let params = PoolingParams {
        dimensions: None,
        truncate_prompt_tokens: truncate,
    };
    if task == Task::Embed {
        // NOTE: each distinct text is embedded once.
        let mut texts: Vec<String> = Vec::new();
        let mut at = |t: &String| match texts.iter().position(|x| x == t) {
            Some(i) => i,
            None => {
                texts.push(t.clone());
                texts.len() - 1
            }
        };
        let idx: Vec<(usize, usize)> = pairs.iter().map(|(q, d)| (at(q), at(d))).collect();
        let inputs = texts.into_iter().map(PromptIn::Text).collect();
        let ids = tokenize(st, inputs, true, truncate.is_some(), param).await?;
        let (v, tokens) = pool(st, ids, params, "score", param).await?;
        return Ok((
            idx.iter().map(|&(q, d)| cosine(&v[q], &v[d])).collect(),
            tokens,
        ));
    }
    if truncate.is_none() {
        for (q, d) in &pairs {
            check_text_len(st, q.len() + d.len(), param)?;
        }
    }
    let tok = st.tokenizer.clone();
    let ids = blocking(st, move || {
        pairs
            .iter()
            .map(|(q, d)| tok.encode_pair(q, d))
            .collect::<anyhow::Result<Vec<_>>>()
            .map_err(|e| ApiError::invalid(format!("{e:#}"), Some(param)))
    })
    .await?;
    let (v, tokens) = pool(st, ids, params, "score", param).await?;
    Ok((v.into_iter().map(|s| s[0]).collect(), tokens))
}

/// A text or a list of texts (`text_1`, `text_2`).
fn texts(v: &Value, param: &str) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::invalid(
            format!("{param} must be a string or a list of strings"),
            Some(param),
        )
    };
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|x| x.as_str().map(String::from).ok_or_else(bad))
            .collect(),
        _ => Err(bad()),
    }
}

async fn score_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = read_json(&st, body)?;
    let req: ScoreRequest = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    served_for(&st, &[Task::Score, Task::Embed], "/v1/score")?;
    check_accepting(&st)?;
    let ignored = ignored_fields(&st, &body, &[KNOWN_SCORE]);
    let (a, b) = (texts(&req.text_1, "text_1")?, texts(&req.text_2, "text_2")?);
    // NOTE: as vLLM: one text_1 against every text_2, or the lists paired one to one.
    let pairs: Vec<(String, String)> = match (a.len(), b.len()) {
        (1, _) => b.into_iter().map(|d| (a[0].clone(), d)).collect(),
        (n, m) if n == m => a.into_iter().zip(b).collect(),
        (n, m) => {
            return Err(ApiError::invalid(
                format!(
                    "text_1 has {n} texts and text_2 {m}: give one text_1, or as many as text_2"
                ),
                Some("text_2"),
            ));
        }
    };
    let truncate = truncation(&st, req.truncate_prompt_tokens)?;
    let (scores, tokens) = score_pairs(&st, pairs, truncate, "text_2").await?;
    let data: Vec<Value> = scores
        .iter()
        .enumerate()
        .map(|(index, s)| json!({"index": index, "object": "score", "score": s}))
        .collect();
    Ok(list(&st, "score", &model, data, tokens, &ignored))
}

async fn rerank_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = read_json(&st, body)?;
    let req: RerankRequest = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    served_for(&st, &[Task::Score, Task::Embed], "/v1/rerank")?;
    check_accepting(&st)?;
    let ignored = ignored_fields(&st, &body, &[KNOWN_RERANK]);
    if req.documents.is_empty() {
        return Err(ApiError::invalid(
            "documents must not be empty",
            Some("documents"),
        ));
    }
    // NOTE: Jina's and Cohere's clients send documents as strings or as {"text": ...}.
    let docs = req
        .documents
        .iter()
        .map(|d| match d {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("text").and_then(Value::as_str).map(String::from),
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| {
            ApiError::invalid(
                "documents must be strings or objects with a text field",
                Some("documents"),
            )
        })?;
    let truncate = truncation(&st, req.truncate_prompt_tokens)?;
    let pairs = docs
        .iter()
        .map(|d| (req.query.clone(), d.clone()))
        .collect();
    let (scores, tokens) = score_pairs(&st, pairs, truncate, "documents").await?;
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(req.top_n.unwrap_or(order.len()));
    let with_docs = req.return_documents.unwrap_or(true);
    let results: Vec<Value> = order
        .into_iter()
        .map(|i| {
            let mut r = json!({"index": i, "relevance_score": scores[i]});
            if with_docs {
                r["document"] = json!({"text": docs[i]});
            }
            r
        })
        .collect();
    let out = json!({
        "id": st.new_id("rerank"),
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    });
    Ok(with_ignored(Json(out).into_response(), &ignored))
}
