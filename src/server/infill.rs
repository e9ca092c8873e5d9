//! llama.cpp's `/infill`, the route code editors' plugins (llama.vim, llama.vscode) call to fill
//! in code at the cursor: `input_prefix` and `input_suffix` around it, `input_extra` (other
//! files of the project, `{filename, text}`), `prompt` (text typed after the prefix),
//! `n_predict` and llama.cpp's sampling fields. The prompt is laid out by [`Fim`] and cut to fit
//! the context as llama.cpp cuts it; the answer is llama.cpp's `{content, stop: true, ...}` or a
//! stream of `data: {"content", "stop": false}` events ending in one with `stop: true`.

use super::error::ApiError;
use super::params::{
    check_accepting, check_generates, check_model, from_json, ignored_fields,
    name_structured_field, read_json, refuse_unsupported, sampling_params, structured_output,
    with_ignored,
};
use super::response::{blocking, collect_one, submit};
use super::state::{AppState, St};
use super::streaming::{self, ChunkFormat};
use super::types::{SamplingFields, StopField};
use super::worker::SubRequest;
use crate::engine::{Prompt, StepOutput, StopReason};
use crate::sched::FinishReason;
use crate::tokenizer::Fim;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Deserialize)]
struct InfillRequest {
    model: Option<String>,
    #[serde(default)]
    input_prefix: String,
    #[serde(default)]
    input_suffix: String,
    #[serde(default)]
    input_extra: Vec<ExtraFile>,
    #[serde(default)]
    prompt: String,
    /// Tokens to generate; -1 (llama.cpp's default) runs to the end of the context.
    n_predict: Option<i64>,
    stream: Option<bool>,
    temperature: Option<f32>,
    top_k: Option<i32>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    /// -1 (llama.cpp's default) draws a fresh seed.
    seed: Option<i64>,
    stop: Option<Vec<String>>,
    repeat_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    /// The generated token ids too (`tokens`).
    return_tokens: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ExtraFile {
    /// llama.cpp's default name.
    #[serde(default = "tmp_name")]
    filename: String,
    text: String,
}

fn tmp_name() -> String {
    "tmp".into()
}

/// The fields this route reads; `cache_prompt` asks for what the prefix cache always does.
const KNOWN: &[&str] = &[
    "model",
    "input_prefix",
    "input_suffix",
    "input_extra",
    "prompt",
    "n_predict",
    "stream",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "cache_prompt",
    "return_tokens",
    "grammar",
    "json_schema",
];

/// llama.cpp's fields that would change the answer and are not implemented: refused by name.
/// The editor plugins' hints (`samplers`, `t_max_predict_ms`, `n_indent`, `response_fields`)
/// are accepted, and named in the ignored-fields header.
const UNSUPPORTED: &[&str] = &["logit_bias"];

/// llama.cpp's samplers not implemented here, with the value that switches each off (which
/// clients send, and which passes).
const SWITCHED_OFF: &[(&str, f64)] = &[
    ("n_probs", 0.0),
    ("mirostat", 0.0),
    ("typical_p", 1.0),
    ("dynatemp_range", 0.0),
    ("xtc_probability", 0.0),
    ("dry_multiplier", 0.0),
];

fn refuse_switched_on(body: &Value) -> Result<(), ApiError> {
    for &(name, off) in SWITCHED_OFF {
        match body.get(name) {
            None | Some(Value::Null) => {}
            Some(v) if v.as_f64() == Some(off) => {}
            Some(_) => {
                return Err(ApiError::unsupported(
                    format!("'{name}' is not supported by this server yet (only {off}, off)"),
                    name,
                ));
            }
        }
    }
    Ok(())
}

/// Tokens kept free for the answer when `n_predict` does not say how many (llama.cpp keeps a
/// batch's worth).
const ANSWER_ROOM: usize = 512;

pub(super) async fn infill(State(st): St, body: Result<Bytes, BytesRejection>) -> Response {
    match infill_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn infill_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body = read_json(&st, body)?;
    let req: InfillRequest = from_json(&body)?;
    let model = check_model(&st, &req.model)?;
    let lora = st.lora_of(&model);
    check_accepting(&st)?;
    check_generates(&st)?;
    refuse_unsupported(&body, UNSUPPORTED)?;
    let known_off: Vec<&str> = SWITCHED_OFF.iter().map(|(n, _)| *n).collect();
    let ignored = ignored_fields(&st, &body, &[KNOWN, UNSUPPORTED, &known_off]);
    let fim = st.fim.ok_or_else(|| {
        ApiError::invalid(
            "this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>), so it cannot fill in code",
            Some("model"),
        )
    })?;
    refuse_switched_on(&body)?;
    let max_tokens = match req.n_predict {
        None | Some(-1) => None,
        Some(n) if n >= 0 && (n as usize) < st.max_model_len => Some(n as usize),
        Some(n) if n >= 0 => {
            return Err(ApiError::invalid(
                format!(
                    "n_predict {n} leaves no room for the prompt in the model's context of {} tokens",
                    st.max_model_len
                ),
                Some("n_predict"),
            ));
        }
        Some(n) => {
            return Err(ApiError::invalid(
                format!("n_predict must be -1 (to the end of the context) or at least 0, got {n}"),
                Some("n_predict"),
            ));
        }
    };
    let fields = SamplingFields {
        temperature: req.temperature,
        // NOTE: llama.cpp's top_k <= 0 and top_p 1 switch the filter off, as -1 and 1 do here.
        top_k: req.top_k.map(|k| if k <= 0 { -1 } else { k }),
        top_p: req.top_p,
        min_p: req.min_p,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repeat_penalty,
        seed: req.seed.and_then(|s| u64::try_from(s).ok()),
        stop: req.stop.map(StopField::Many),
        ignore_eos: req.ignore_eos,
        ..Default::default()
    };
    let mut params = sampling_params(&fields, max_tokens, None, &st.sampling_defaults)
        .map_err(|e| e.renamed("max_tokens", "n_predict"))?;
    // NOTE: only llama.cpp's own fields constrain /infill.
    let constraint =
        json!({"grammar": body.get("grammar"), "json_schema": body.get("json_schema")});
    let structured = structured_output(&constraint)?;
    let field = structured.as_ref().map(|(_, f)| *f);
    params.structured = structured.map(|(c, _)| c);
    let total = [&req.input_prefix, &req.input_suffix, &req.prompt]
        .iter()
        .map(|s| s.len())
        .chain(
            req.input_extra
                .iter()
                .map(|f| f.filename.len() + f.text.len()),
        )
        .sum();
    // NOTE: the text may be longer than the context (it is cut), but not without bound.
    super::params::check_text_len(&st, total, "input_prefix")?;
    let budget = st
        .max_model_len
        .saturating_sub(max_tokens.unwrap_or(ANSWER_ROOM).max(1))
        .max(1);
    let tok = st.tokenizer.clone();
    let (ids, truncated) = blocking(&st, move || {
        let files: Vec<(String, String)> = req
            .input_extra
            .into_iter()
            .map(|f| (f.filename, f.text))
            .collect();
        fim_prompt(
            &fim,
            &tok,
            &req.input_prefix,
            &req.prompt,
            &req.input_suffix,
            &files,
            budget,
        )
    })
    .await?;
    let id = st.new_id("infill");
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
        "input_prefix",
        max_tokens.is_some(),
    )
    .await
    .map_err(|e| name_structured_field(e, field).renamed("max_tokens", "n_predict"))?;
    let tokens = req.return_tokens.unwrap_or(false);
    if req.stream.unwrap_or(false) {
        let fmt = InfillStream {
            model,
            truncated,
            tokens,
        };
        return Ok(with_ignored(
            streaming::response(rx, guard, 1, 1, false, fmt),
            &ignored,
        ));
    }
    let c = collect_one(&mut rx, &mut guard).await?;
    let mut answer = last_chunk(
        &model,
        truncated,
        c.finish,
        c.stop_reason.as_ref(),
        c.prompt_tokens,
        c.output_tokens,
    );
    answer["content"] = Value::String(c.text);
    if tokens {
        answer["tokens"] = json!(c.token_ids);
    }
    Ok(with_ignored(Json(answer).into_response(), &ignored))
}

fn fim_prompt(
    fim: &Fim,
    tok: &crate::tokenizer::Tokenizer,
    prefix: &str,
    prompt: &str,
    suffix: &str,
    files: &[(String, String)],
    budget: usize,
) -> Result<(Vec<u32>, bool), ApiError> {
    fim.prompt_within(tok, prefix, prompt, suffix, Some(files), budget)
        .map_err(|e| ApiError::invalid(format!("{e:#}"), Some("prompt")))
}

/// llama.cpp's closing object: why generation stopped and how many tokens it took.
fn last_chunk(
    model: &str,
    truncated: bool,
    finish: Option<FinishReason>,
    stop: Option<&StopReason>,
    prompt_tokens: usize,
    output_tokens: usize,
) -> Value {
    // NOTE: llama.cpp's stop_type: "word" for a stop string, "limit" for n_predict or the
    // context, "eos" for the end of sequence (and here a stop token id).
    let (stop_type, word) = match (finish, stop) {
        (_, Some(StopReason::Text(w))) => ("word", w.clone()),
        (Some(FinishReason::Length), _) => ("limit", String::new()),
        _ => ("eos", String::new()),
    };
    json!({
        "index": 0,
        "content": "",
        "stop": true,
        "model": model,
        "tokens_predicted": output_tokens,
        "tokens_evaluated": prompt_tokens,
        "truncated": truncated,
        "stop_type": stop_type,
        "stopping_word": word,
    })
}

/// `data: {"content", "stop": false}` per piece of text, then the closing object; no `[DONE]`.
struct InfillStream {
    model: String,
    truncated: bool,
    /// Whether each chunk carries its token ids (`return_tokens`).
    tokens: bool,
}

impl ChunkFormat for InfillStream {
    fn start(&mut self, _usage_null: bool) -> Vec<String> {
        Vec::new()
    }

    fn output(&mut self, _index: usize, out: &StepOutput, _usage_null: bool) -> Vec<String> {
        let mut chunks = Vec::new();
        if !out.new_text.is_empty() || (self.tokens && !out.new_token_ids.is_empty()) {
            let mut c = json!({"index": 0, "content": out.new_text, "stop": false});
            if self.tokens {
                c["tokens"] = json!(out.new_token_ids);
            }
            chunks.push(c.to_string());
        }
        if out.finish_reason.is_some() {
            let last = last_chunk(
                &self.model,
                self.truncated,
                out.finish_reason,
                out.stop_reason.as_ref(),
                out.num_prompt_tokens,
                out.num_output_tokens,
            );
            chunks.push(last.to_string());
        }
        chunks
    }

    fn done(&self) -> Option<Bytes> {
        None
    }
}
