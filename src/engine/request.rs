//! A request as the engine keeps it between steps: its sampling state per sequence
//! ([`RequestState`]: parameters, seed, stop and bad-word tokens, structured-output matcher,
//! detokenizer), its samples grouped for `n`/`best_of`, what it returns each step
//! ([`StepOutput`]), and a step in flight ([`PendingStep`]).

use crate::sampling::{
    IncrementalDetokenizer, InvalidParam, RowSampling, SamplingParams, StopChecker, TokenLogprobs,
    structured::allowed_tokens,
};
use crate::sched::{FinishReason, RequestId, SchedulerOutput};
use crate::tokenizer::Tokenizer;
use std::borrow::Cow;
use std::collections::HashMap;

/// The token sequences of `bad_words` (vLLM's way): each word as written and with a leading
/// space, since a word mid-sentence is usually tokenized with its space.
pub(super) fn bad_word_ids(
    tok: &Tokenizer,
    words: &[String],
) -> Result<Vec<Vec<u32>>, RequestError> {
    let mut out: Vec<Vec<u32>> = Vec::new();
    for w in words {
        let w = w.trim_start();
        for text in [w.to_string(), format!(" {w}")] {
            let ids = tok
                .inner()
                .encode_fast(text.as_str(), false)
                .map_err(|e| RequestError::Internal(anyhow::anyhow!("tokenizing failed: {e}")))?
                .get_ids()
                .to_vec();
            if !ids.is_empty() && !out.contains(&ids) {
                out.push(ids);
            }
        }
    }
    Ok(out)
}

/// The tokens a sample may not choose next: its stop tokens while it has fewer than
/// `min_tokens`, and the last token of each bad word whose other tokens end the output.
pub(super) fn banned_tokens(st: &RequestState, output: &[u32]) -> Vec<u32> {
    let mut banned = Vec::new();
    if output.len() < st.params.min_tokens {
        banned.extend_from_slice(&st.stop_ids);
    }
    for word in &st.bad_words {
        if let Some((&last, head)) = word.split_last()
            && output.ends_with(head)
        {
            banned.push(last);
        }
    }
    banned
}

/// A request's output as its `i`-th row of a step with `drafts` sees it: the output, then the
/// first `i` drafts.
pub(super) fn with_drafts<'a>(output: &'a [u32], drafts: &[u32], i: usize) -> Cow<'a, [u32]> {
    if i == 0 {
        Cow::Borrowed(output)
    } else {
        Cow::Owned([output, &drafts[..i]].concat())
    }
}

/// The seed of sample `index` of a request seeded with `seed`: sample 0 keeps the request's
/// seed (so `n = 1` is unchanged), the others get independent streams (SplitMix64's mixer).
pub fn sample_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Why a request was refused. The server maps these to HTTP 400 with the `param` named.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    InvalidParam(#[from] InvalidParam),
    #[error("{0}")]
    PromptTooLong(String),
    #[error("{0}")]
    InvalidPrompt(String),
    /// The request names a LoRA adapter that is not loaded.
    #[error("no LoRA adapter is loaded under the name `{0}`")]
    UnknownLora(String),
    #[error("{0:#}")]
    Internal(anyhow::Error),
}

/// A prompt as text or as token ids.
#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Prompt::Text(s.to_string())
    }
}

impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Prompt::Text(s)
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(t: Vec<u32>) -> Self {
        Prompt::Tokens(t)
    }
}

/// What one step produced for one completion of a request: the new tokens and text (deltas),
/// and whether it ended. With `best_of > n` the `n` chosen completions come whole, once all
/// `best_of` have ended.
#[derive(Debug, Clone)]
pub struct StepOutput {
    pub request_id: RequestId,
    /// Which of the request's `n` completions (0 when `n` is 1).
    pub index: usize,
    pub new_token_ids: Vec<u32>,
    pub new_text: String,
    /// One entry per new token when `logprobs` was asked for.
    pub new_logprobs: Vec<TokenLogprobs>,
    /// With `prompt_logprobs`, in the request's first output: the score of each prompt token
    /// after the first (which nothing predicts).
    pub prompt_logprobs: Option<Vec<PromptLogprob>>,
    pub finish_reason: Option<FinishReason>,
    /// What ended a completion that finished with `Stop` (vLLM's `stop_reason`): `None` for
    /// the model's end of sequence or a complete grammar.
    pub stop_reason: Option<StopReason>,
    pub num_prompt_tokens: usize,
    pub num_output_tokens: usize,
    /// An embedding or score request's result (`--task embed`, `--task score`), in its one
    /// output.
    pub pooled: Option<Vec<f32>>,
}

/// A stop the request asked for, which ended a completion.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    /// One of `stop` (the text ends right before it).
    Text(String),
    /// One of `stop_token_ids`.
    Token(u32),
}

/// How likely the model found one prompt token, given the tokens before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    pub logprobs: TokenLogprobs,
    /// Its rank among all tokens (1 = the most likely).
    pub rank: usize,
}

pub(super) fn prompt_logprob(row: &[f32], token: u32, k: usize) -> PromptLogprob {
    PromptLogprob {
        logprobs: crate::sampling::sampler::logprobs_of(row, token, k),
        rank: crate::sampling::sampler::rank_of(row, token) as usize,
    }
}

impl StepOutput {
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }
}

/// One sequence the scheduler runs: a request, or one of its `best_of` samples.
pub(super) struct RequestState {
    pub(super) params: SamplingParams,
    pub(super) seed: u64,
    /// The tokens that end this sample (EOS unless ignored, `stop_token_ids`): banned before
    /// `min_tokens`.
    pub(super) stop_ids: Vec<u32>,
    /// `bad_words`, tokenized.
    pub(super) bad_words: Vec<Vec<u32>>,
    /// The structured-output constraint's state: what the output may continue with.
    pub(super) matcher: Option<llguidance::Matcher>,
    /// `prompt_logprobs`: the scores of prompt tokens 1.. so far, sent with the first output.
    pub(super) prompt_logprobs: Vec<PromptLogprob>,
    pub(super) prompt_logprobs_sent: bool,
    pub(super) detok: IncrementalDetokenizer,
    pub(super) stop: StopChecker,
    /// The request (the id its caller knows) and this sample's place in it.
    pub(super) group: RequestId,
    pub(super) index: usize,
    /// Sum of the sampled tokens' log-probabilities (ranks the samples of `best_of`).
    pub(super) cum_logprob: f64,
}

/// The samples of one request. Its id is its first sample's.
pub(super) struct Group {
    pub(super) seqs: Vec<RequestId>,
    pub(super) unfinished: usize,
    /// `best_of > n`: every sample's output so far, kept until all have ended.
    pub(super) ranked: Option<Ranked>,
}

pub(super) struct Ranked {
    /// How many samples to return.
    pub(super) n: usize,
    /// Each sample's whole output and its cumulative log-probability.
    pub(super) kept: Vec<(StepOutput, f64)>,
}

/// A scheduled step on its way through the model, and what its results are for.
pub(super) struct PendingStep {
    pub(super) sched: SchedulerOutput,
    /// The requests that sample a token, the logits row of each, and their drafts: a request
    /// with `k` drafts has `1 + k` rows from its first, one per position (speculative
    /// decoding).
    pub(super) sampling: Vec<RequestId>,
    pub(super) sample_rows: Vec<usize>,
    pub(super) drafts: Vec<Vec<u32>>,
    /// The prompt rows asked for by `prompt_logprobs`: (request, position whose next token
    /// they score, row).
    pub(super) prompt_rows: Vec<(RequestId, usize, usize)>,
    /// The rows a pooling request reads: (request, position, row).
    pub(super) pool_rows: Vec<(RequestId, usize, usize)>,

    /// How each logits row is reduced: its token chosen where the logits are (greedy rows,
    /// and random ones where the backend samples), or `None`: its logits come to the host.
    pub(super) reduce: Vec<Option<RowSampling>>,
}

/// A structured-output request's allowed tokens for the next step, or why there are none.
pub(super) type Masked = std::result::Result<llguidance::toktrie::SimpleVob, String>;

/// The matchers of the constrained requests among `sampling`.
/// NOTE: nothing is collected in a step without a constrained row (the common case).
pub(super) fn constrained_matchers<'a>(
    states: &'a mut HashMap<RequestId, RequestState>,
    sampling: &[RequestId],
) -> Vec<(RequestId, &'a mut llguidance::Matcher)> {
    if !sampling
        .iter()
        .any(|id| states.get(id).is_some_and(|st| st.matcher.is_some()))
    {
        return Vec::new();
    }
    let wanted: std::collections::HashSet<RequestId> = sampling.iter().copied().collect();
    states
        .iter_mut()
        .filter(|(id, _)| wanted.contains(id))
        .filter_map(|(id, st)| st.matcher.as_mut().map(|m| (*id, m)))
        .collect()
}

pub(super) fn compute_masks(
    constrained: Vec<(RequestId, &mut llguidance::Matcher)>,
) -> HashMap<RequestId, Masked> {
    constrained
        .into_iter()
        .map(|(id, m)| (id, allowed_tokens(m)))
        .collect()
}
