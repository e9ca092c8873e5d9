//! From the engine thread back to the client: a request's sub-requests queued with an
//! [`AbortGuard`] that aborts them if the client goes, their events collected, and the
//! engine's outputs (log-probabilities, finish reasons, tool-call ids) in OpenAI's fields. The
//! streams (`streaming.rs`) use the same pieces.

use super::error::ApiError;
use super::state::AppState;
use super::types::*;
use super::worker::{AddError, Command, Event, EventKind, SubRequest};
use crate::engine::{Prompt, RequestError, StopReason};
use crate::sampling::TokenLogprobs;
use crate::sched::{FinishReason, RequestId};
use crate::tokenizer::Tokenizer;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc as tmpsc, oneshot};

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The id of call `k` of choice `index` of response `response_id`: unique, in OpenAI's
/// `call_…` form.
pub fn call_id(response_id: &str, index: usize, k: usize) -> String {
    let tail = response_id.rsplit('-').next().unwrap_or(response_id);
    format!("call_{tail}{index:02x}{k:02x}")
}

/// vLLM's `prompt_logprobs` entries: `null` for the first token, then for each position the
/// prompt token and the top tokens, by id: `{logprob, rank, decoded_token}`.
pub(super) fn prompt_logprobs_json(tok: &Tokenizer, lps: &[crate::engine::PromptLogprob]) -> Value {
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
pub(super) fn echo_logprobs_of(
    tok: &Tokenizer,
    prompt: &[u32],
    lps: &[crate::engine::PromptLogprob],
    as_ids: bool,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut offsets = TextOffsets::new(0);
    for (i, &id) in prompt.iter().enumerate() {
        let bytes = tok.token_bytes(id);
        out.text_offset.push(offsets.advance(&bytes));
        out.tokens.push(token_name(tok, id, as_ids));
        match i.checked_sub(1).and_then(|j| lps.get(j)) {
            Some(p) => {
                out.token_logprobs.push(Some(p.logprobs.logprob));
                let mut top = serde_json::Map::new();
                for &(t, l) in &p.logprobs.top {
                    top.entry(token_name(tok, t, as_ids))
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

/// Runs tokenizer work on the blocking pool (long prompts must not hold up the async workers),
/// at most one task per core at a time: the others wait their turn instead of taking memory
/// and CPU from the engine all at once.
pub(super) async fn blocking<T: Send + 'static>(
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
pub(super) async fn submit(
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
                RequestError::UnknownLora(m) => ApiError::model_not_found(&m),
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
pub(super) struct Collected {
    pub(super) text: String,
    pub(super) token_ids: Vec<u32>,
    pub(super) logprobs: Vec<TokenLogprobs>,
    pub(super) prompt_logprobs: Option<Vec<crate::engine::PromptLogprob>>,
    pub(super) finish: Option<FinishReason>,
    pub(super) stop_reason: Option<StopReason>,
    pub(super) prompt_tokens: usize,
    pub(super) output_tokens: usize,
    /// An embedding or score request's result.
    pub(super) pooled: Option<Vec<f32>>,
}

pub(super) async fn collect(
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
                c.token_ids.extend_from_slice(&o.new_token_ids);
                c.logprobs.extend(o.new_logprobs);
                if o.prompt_logprobs.is_some() {
                    c.prompt_logprobs = o.prompt_logprobs;
                }
                c.prompt_tokens = o.num_prompt_tokens;
                c.output_tokens = o.num_output_tokens;
                if o.pooled.is_some() {
                    c.pooled = o.pooled;
                }
                if o.finish_reason.is_some() && c.finish.is_none() {
                    left -= 1;
                    c.stop_reason = o.stop_reason;
                }
                c.finish = c.finish.or(o.finish_reason);
            }
            EventKind::Error(m) => return Err(ApiError::internal(m)),
        }
    }
    Ok(out)
}

/// The one result of a single request; the guard stands down once it is complete.
pub(super) async fn collect_one(
    rx: &mut tmpsc::UnboundedReceiver<Event>,
    guard: &mut AbortGuard,
) -> Result<Collected, ApiError> {
    let c = collect(rx, 1)
        .await?
        .pop()
        .ok_or_else(|| ApiError::internal("the engine returned no output"))?;
    guard.disarm();
    Ok(c)
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

/// A token's name in log-probs: [`token_repr`] of its bytes, or vLLM's `token_id:N` with
/// `return_tokens_as_token_ids` (for clients that must tell tokens with the same text apart).
pub fn token_name(tok: &Tokenizer, id: u32, as_id: bool) -> String {
    if as_id {
        format!("token_id:{id}")
    } else {
        token_repr(&tok.token_bytes(id))
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

    /// The offset of a token with these bytes (of the character its first byte belongs to, as
    /// the text shows it: a lossy decode, where an incomplete character cut short by the next
    /// bytes is one U+FFFD); then moves past them.
    fn advance(&mut self, bytes: &[u8]) -> usize {
        // NOTE: `pending` holds at most an incomplete character; the token starts at `first`.
        let mut first = self.pending.len();
        self.pending.extend_from_slice(bytes);
        let mut at = None;
        let mut done = 0;
        while done < self.pending.len() {
            let rest = &self.pending[done..];
            let unit = match std::str::from_utf8(rest) {
                Ok(s) => s.chars().next().map_or(rest.len(), char::len_utf8),
                Err(e) if e.valid_up_to() > 0 => {
                    // A whole character first: its length from its lead byte.
                    std::str::from_utf8(&rest[..e.valid_up_to()])
                        .ok()
                        .and_then(|s| s.chars().next())
                        .map_or(1, char::len_utf8)
                }
                // Bytes that can never be a character show as one U+FFFD.
                Err(e) => match e.error_len() {
                    Some(bad) => bad,
                    None => break,
                },
            };
            if at.is_none() && first < unit {
                at = Some(self.chars);
            }
            first = first.saturating_sub(unit);
            self.chars += 1;
            done += unit;
        }
        self.pending.drain(..done);
        at.unwrap_or(self.chars)
    }
}

pub fn completion_logprobs(
    tok: &Tokenizer,
    lps: &[TokenLogprobs],
    offsets: &mut TextOffsets,
    as_ids: bool,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for lp in lps {
        let bytes = tok.token_bytes(lp.token_id);
        let s = token_name(tok, lp.token_id, as_ids);
        out.text_offset.push(offsets.advance(&bytes));
        out.token_logprobs.push(Some(lp.logprob));
        let mut top = serde_json::Map::new();
        for &(id, l) in &lp.top {
            top.entry(token_name(tok, id, as_ids))
                .or_insert(Value::from(l));
        }
        top.entry(s.clone()).or_insert(Value::from(lp.logprob));
        out.top_logprobs.push(Some(top));
        out.tokens.push(s);
    }
    out
}

pub fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs], as_ids: bool) -> ChatLogprobs {
    // NOTE: `bytes` stays the token's own bytes also when the name is its id.
    let entry = |id: u32| (token_name(tok, id, as_ids), tok.token_bytes(id));
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

pub(super) fn finish_str(f: Option<FinishReason>) -> Option<&'static str> {
    f.map(FinishReason::as_str)
}

/// vLLM's `stop_reason`: the stop string (a JSON string) or stop token id (a number).
pub(super) fn stop_reason_json(r: Option<&StopReason>) -> Option<Value> {
    r.map(|r| match r {
        StopReason::Text(s) => Value::from(s.as_str()),
        StopReason::Token(t) => Value::from(*t),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // A character cut short by the next token's bytes is one U+FFFD; the next token starts
        // after it (the text reads "\u{FFFD}\u{FFFD}x" when the second is cut short too).
        let mut o = TextOffsets::new(0);
        let got: Vec<usize> = [&emoji[..2], &emoji[..2], b"x"]
            .iter()
            .map(|t| o.advance(t))
            .collect();
        assert_eq!(got, [0, 1, 2]);
        assert_eq!(
            String::from_utf8_lossy(&[&emoji[..2], &emoji[..2], b"x"].concat()),
            "\u{FFFD}\u{FFFD}x"
        );
    }

    #[test]
    fn token_names_are_lossless() {
        assert_eq!(token_repr(b"hi"), "hi");
        assert_eq!(token_repr("é".as_bytes()), "é");
        assert_eq!(token_repr(&[0xf0, 0x9f]), "bytes:\\xf0\\x9f");
        assert_ne!(token_repr(&[0xf0]), token_repr(&[0x9f]));
    }
}
