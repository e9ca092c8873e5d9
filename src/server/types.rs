//! OpenAI request and response bodies (the subset Pagoda serves), plus vLLM's extra sampling
//! fields (`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`).
//!
//! Every request field is an `Option` so that an explicit JSON `null` means "default", as it
//! does for the OpenAI API. Unknown fields are ignored.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling fields shared by completions and chat completions, read from the same body as
/// the request (not `#[serde(flatten)]`, which would lose the field names in errors).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub n: Option<usize>,
    pub best_of: Option<usize>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    pub min_tokens: Option<usize>,
    pub bad_words: Option<Vec<String>>,
    pub prompt_logprobs: Option<usize>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// A string, a list of strings, a list of token ids, or a list of lists of token ids.
    pub prompt: Value,
    pub max_tokens: Option<usize>,
    pub logprobs: Option<usize>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}

/// Message content: a string, or a list of parts of which only `text` parts are supported.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<MessageContent>,
    /// An assistant message's calls (`{"id", "type", "function": {"name", "arguments"}}`).
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's extra: render the generation prompt (true by default).
    pub add_generation_prompt: Option<bool>,
    /// vLLM's extra: leave the final (assistant) message open for the model to continue.
    pub continue_final_message: Option<bool>,
    /// vLLM's extra: the reply starts with the last message when it is the assistant's.
    pub echo: Option<bool>,
}

/// vLLM's `/tokenize`: a `prompt`, or chat `messages` rendered with the template.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: String,
    pub parent: Option<String>,
    pub max_model_len: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

/// Completion log-probs, in the legacy completions format.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub text_offset: Vec<usize>,
    pub token_logprobs: Vec<Option<f32>>,
    pub tokens: Vec<String>,
    /// `null` for an echoed prompt's first token, which nothing predicts.
    pub top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's `stop_reason`: the stop string or stop token id that ended the choice.
    pub stop_reason: Option<Value>,
    /// vLLM's `prompt_logprobs`, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Value>,
    /// vLLM's `return_token_ids`: the prompt's ids (in a stream, in the choice's first chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// vLLM's `return_token_ids`: the generated ids (in a stream, the chunk's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

impl CompletionLogprobs {
    /// `self` followed by `tail` (the echoed prompt's, then the completion's).
    pub fn append(&mut self, tail: CompletionLogprobs) {
        self.text_offset.extend(tail.text_offset);
        self.token_logprobs.extend(tail.token_logprobs);
        self.tokens.extend(tail.tokens);
        self.top_logprobs.extend(tail.top_logprobs);
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    /// Always present in a response; in stream chunks only when `include_usage` asked for it
    /// (`null` on every chunk but the last).
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}

/// Usage in a body: absent, `null`, or counts.
#[derive(Debug, Clone, Copy)]
pub enum UsageField {
    Absent,
    Null,
    Some(Usage),
}

impl UsageField {
    fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }
}

impl Serialize for UsageField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Some(u) => u.serialize(s),
            _ => s.serialize_none(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// `null` when the message is tool calls only.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// A call the model made, as OpenAI returns it.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCallOut {
    pub name: String,
    /// A JSON text.
    pub arguments: String,
}

/// A piece of a streamed call: the first carries its id, type and name, later ones more of
/// its arguments.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's `stop_reason`: the stop string or stop token id that ended the choice.
    pub stop_reason: Option<Value>,
    /// vLLM's `return_token_ids`: the generated ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's `prompt_logprobs`, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Value>,
    /// vLLM's `return_token_ids`: the rendered prompt's ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's `return_token_ids`: the ids this chunk's delta came from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
    /// vLLM's `return_token_ids`: the prompt's ids, in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// vLLM's token-id options, read from the body of both OpenAI routes.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct TokenIdFields {
    /// The prompt's and the output's token ids in the response.
    pub return_token_ids: Option<bool>,
    /// Log-prob tokens named `token_id:N` instead of by their text.
    pub return_tokens_as_token_ids: Option<bool>,
}

impl TokenIdFields {
    pub fn ids(&self) -> bool {
        self.return_token_ids.unwrap_or(false)
    }

    pub fn names(&self) -> bool {
        self.return_tokens_as_token_ids.unwrap_or(false)
    }
}
