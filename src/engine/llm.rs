//! Offline inference: a batch of prompts in, their complete outputs out (vLLM's `LLM`).

use super::{Engine, EngineArgs, Prompt};
use crate::sampling::{SamplingParams, TokenLogprobs};
use crate::sched::{FinishReason, RequestId};
use crate::tokenizer::ChatMessage;
use anyhow::Result;
use std::collections::HashMap;

/// One generated sequence of a request.
#[derive(Debug, Clone, Default)]
pub struct CompletionOutput {
    pub index: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    /// One entry per generated token when `logprobs` was asked for.
    pub logprobs: Vec<TokenLogprobs>,
    pub finish_reason: Option<FinishReason>,
    /// The stop string or stop token id that ended it (vLLM's `stop_reason`).
    pub stop_reason: Option<super::StopReason>,
}

/// The complete result of one request.
#[derive(Debug, Clone)]
pub struct RequestOutput {
    pub request_id: RequestId,
    pub prompt: Option<String>,
    pub prompt_token_ids: Vec<u32>,
    /// One per completion (`n`), in index order.
    pub outputs: Vec<CompletionOutput>,
    /// With `prompt_logprobs`: the score of each prompt token after the first.
    pub prompt_logprobs: Option<Vec<super::PromptLogprob>>,
    pub finished: bool,
}

pub struct LLM {
    engine: Engine,
}

impl LLM {
    pub fn new(args: EngineArgs) -> Result<Self> {
        Ok(LLM {
            engine: Engine::new(args)?,
        })
    }

    pub fn engine(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Generates for every prompt, all submitted at once and batched continuously. Outputs come
    /// back in the order of the prompts. A prompt that is refused fails the whole call before
    /// anything runs.
    pub fn generate<P: Into<Prompt> + Clone>(
        &mut self,
        prompts: &[P],
        params: &SamplingParams,
    ) -> Result<Vec<RequestOutput>> {
        self.generate_each(
            prompts
                .iter()
                .cloned()
                .map(|p| (p.into(), params.clone()))
                .collect(),
        )
    }

    /// As [`LLM::generate`], with sampling parameters per prompt.
    pub fn generate_each(
        &mut self,
        requests: Vec<(Prompt, SamplingParams)>,
    ) -> Result<Vec<RequestOutput>> {
        let mut order = Vec::with_capacity(requests.len());
        let mut results: HashMap<RequestId, RequestOutput> = HashMap::new();
        for (prompt, params) in requests {
            let n = params.n;
            let text = match &prompt {
                Prompt::Text(t) => Some(t.clone()),
                Prompt::Tokens(_) => None,
            };
            let id = match self.engine.add_request(prompt, params) {
                Ok(id) => id,
                Err(e) => {
                    for id in &order {
                        self.engine.abort(*id);
                    }
                    return Err(anyhow::Error::new(e).context("request refused"));
                }
            };
            order.push(id);
            let prompt_token_ids = self
                .engine
                .scheduler
                .request(id)
                .map(|r| r.prompt().to_vec())
                .unwrap_or_default();
            results.insert(
                id,
                RequestOutput {
                    request_id: id,
                    prompt: text,
                    prompt_token_ids,
                    outputs: (0..n)
                        .map(|index| CompletionOutput {
                            index,
                            ..Default::default()
                        })
                        .collect(),
                    prompt_logprobs: None,
                    finished: false,
                },
            );
        }
        while self.engine.has_unfinished() {
            let step = match self.engine.step() {
                Ok(s) => s,
                Err(e) => {
                    for id in &order {
                        self.engine.abort(*id);
                    }
                    return Err(e);
                }
            };
            for o in step {
                if let Some(r) = results.get_mut(&o.request_id)
                    && o.index == 0
                    && let Some(p) = o.prompt_logprobs.clone()
                {
                    r.prompt_logprobs = Some(p);
                }
                if let Some(r) = results.get_mut(&o.request_id)
                    && let Some(c) = r.outputs.get_mut(o.index)
                {
                    c.text.push_str(&o.new_text);
                    c.token_ids.extend(&o.new_token_ids);
                    c.logprobs.extend(o.new_logprobs);
                    if let Some(f) = o.finish_reason {
                        c.finish_reason = Some(f);
                        c.stop_reason = o.stop_reason;
                        r.finished = r.outputs.iter().all(|c| c.finish_reason.is_some());
                    }
                }
            }
        }
        Ok(order
            .into_iter()
            .filter_map(|id| results.remove(&id))
            .collect())
    }

    /// Applies the model's chat template and generates the assistant's reply.
    pub fn chat(
        &mut self,
        messages: &[ChatMessage],
        params: &SamplingParams,
    ) -> Result<RequestOutput> {
        let prompt = self.engine.apply_chat_template(messages)?;
        let mut out = self.generate(&[prompt], params)?;
        out.pop().ok_or_else(|| anyhow::anyhow!("no output"))
    }
}
