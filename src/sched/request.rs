//! A request as the scheduler sees it: token ids and counters, no text and no sampling.

pub type RequestId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop token or stop string was produced.
    Stop,
    /// `max_tokens` or the model's context length was reached.
    Length,
    /// The caller aborted the request (a client went away, say).
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
    /// Preempted: blocks freed, back in the waiting queue, to be recomputed.
    Preempted,
    /// Preempted: blocks copied to host memory, to be copied back when it resumes.
    Swapped,
    Finished(FinishReason),
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    /// Prompt followed by the output so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub num_computed_tokens: usize,
    /// Output tokens allowed (already capped by the context length).
    pub max_tokens: usize,
    /// Token ids that end generation (EOS unless ignored, plus `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    pub status: RequestStatus,
    pub num_preemptions: usize,
    /// `Some(root)`: the request may share cached blocks registered under `root` (prefix
    /// caching uses one root for all; parallel samples without it share one of their own).
    pub cache_root: Option<u64>,
    /// Draft tokens proposed for the next step (speculative decoding), scheduled after its
    /// last token when it decodes; taken by the next `schedule`.
    pub draft_tokens: Vec<u32>,
    /// The LoRA adapter's slot (0: the base model); a step holds at most
    /// [`super::SchedulerConfig::max_loras`] distinct ones.
    pub lora: u32,
}

impl Request {
    pub fn new(
        id: RequestId,
        prompt: Vec<u32>,
        max_tokens: usize,
        stop_token_ids: Vec<u32>,
    ) -> Self {
        let prompt_len = prompt.len();
        Request {
            id,
            tokens: prompt,
            prompt_len,
            num_computed_tokens: 0,
            max_tokens,
            stop_token_ids,
            status: RequestStatus::Waiting,
            num_preemptions: 0,
            cache_root: None,
            draft_tokens: Vec::new(),
            lora: 0,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.prompt_len]
    }

    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// The same request, sharing cached blocks under `root`.
    pub fn with_cache_root(mut self, root: Option<u64>) -> Self {
        self.cache_root = root;
        self
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }
}
