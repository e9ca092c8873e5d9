//! Offline inference: a batch of prompts in, their complete outputs out (vLLM's `LLM`).

use super::pool::cosine;
use super::{Engine, EngineArgs, PoolingParams, Prompt, StepOutput};
use crate::models::pooling::Task;
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

impl CompletionOutput {
    /// Whether the output ran out of tokens (`max_tokens` or the context) while repeating
    /// itself: the shortest period `p` (up to 64 tokens) whose last 4 repeats, at least 32
    /// tokens in all, close the output. Returns `(p, repeats)`, counting every whole repeat at
    /// the end. Greedy decoding of a small model often ends this way, and `generate` says so.
    pub fn repeating_tail(&self) -> Option<(usize, usize)> {
        if self.finish_reason != Some(FinishReason::Length) {
            return None;
        }
        let ids = &self.token_ids;
        (1..=64).find_map(|p| {
            let same = |k: usize| ids[ids.len() - 1 - k] == ids[ids.len() - 1 - k - p];
            let run = (0..ids.len().saturating_sub(p))
                .take_while(|&k| same(k))
                .count();
            let repeats = run / p + 1;
            (repeats >= 4 && repeats * p >= 32).then_some((p, repeats))
        })
    }
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

/// The result of an embedding or score request.
#[derive(Debug, Clone)]
pub struct PoolingOutput {
    pub request_id: RequestId,
    pub prompt_token_ids: Vec<u32>,
    /// The embedding, or the one score.
    pub data: Vec<f32>,
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
        self.generate_with_lora(requests.into_iter().map(|(p, s)| (p, s, None)).collect())
    }

    /// As [`LLM::generate_each`], each prompt through the LoRA adapter it names (loaded by
    /// [`Engine::load_lora`] or `--lora-modules`), or the base model with `None`; all in one
    /// batch.
    pub fn generate_with_lora(
        &mut self,
        requests: Vec<(Prompt, SamplingParams, Option<String>)>,
    ) -> Result<Vec<RequestOutput>> {
        let mut order = Vec::with_capacity(requests.len());
        let mut results: HashMap<RequestId, RequestOutput> = HashMap::new();
        for (prompt, params, lora) in requests {
            let n = params.n;
            let text = match &prompt {
                Prompt::Text(t) => Some(t.clone()),
                Prompt::Tokens(_) => None,
            };
            let added = self
                .engine
                .add_request_with_lora(prompt, params, lora.as_deref());
            let (id, prompt_token_ids) = self.added(added, &mut order)?;
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
        self.run(&order, |o| {
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
        })?;
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

    /// The embedding of every prompt (`--task embed`), batched as generation is, in the order
    /// of the prompts. A prompt that is refused fails the whole call before anything runs.
    pub fn embed<P: Into<Prompt> + Clone>(
        &mut self,
        prompts: &[P],
        params: &PoolingParams,
    ) -> Result<Vec<PoolingOutput>> {
        let requests = prompts.iter().cloned().map(Into::into).collect();
        self.pool_each(requests, params)
    }

    /// How relevant each document is to `query`: a cross-encoder's or a decoder reranker's
    /// score of the pair (`--task score`), or the cosine of their embeddings (`--task embed`).
    pub fn score(&mut self, query: &str, documents: &[&str]) -> Result<Vec<f32>> {
        let task = self.engine.pooler().map(|p| p.task);
        let params = PoolingParams::default();
        match task {
            Some(Task::Score) => {
                let tok = self.engine.tokenizer().clone();
                let pairs = documents
                    .iter()
                    .map(|d| tok.encode_pair(query, d).map(Prompt::Tokens))
                    .collect::<Result<Vec<_>>>()?;
                let out = self.pool_each(pairs, &params)?;
                Ok(out.into_iter().map(|o| o.data[0]).collect())
            }
            Some(Task::Embed) => {
                let mut texts = vec![Prompt::Text(query.to_string())];
                texts.extend(documents.iter().map(|d| Prompt::Text(d.to_string())));
                let out = self.pool_each(texts, &params)?;
                let q = &out[0].data;
                Ok(out[1..].iter().map(|d| cosine(q, &d.data)).collect())
            }
            _ => anyhow::bail!("scores need a model served with --task score or --task embed"),
        }
    }

    fn pool_each(
        &mut self,
        prompts: Vec<Prompt>,
        params: &PoolingParams,
    ) -> Result<Vec<PoolingOutput>> {
        let mut order = Vec::with_capacity(prompts.len());
        let mut results: HashMap<RequestId, PoolingOutput> = HashMap::new();
        for prompt in prompts {
            let added = self.engine.add_pooling_request(prompt, params.clone());
            let (id, prompt_token_ids) = self.added(added, &mut order)?;
            results.insert(
                id,
                PoolingOutput {
                    request_id: id,
                    prompt_token_ids,
                    data: Vec::new(),
                },
            );
        }
        self.run(&order, |o| {
            if let (Some(r), Some(data)) = (results.get_mut(&o.request_id), o.pooled) {
                r.data = data;
            }
        })?;
        Ok(order
            .into_iter()
            .filter_map(|id| results.remove(&id))
            .collect())
    }

    fn abort_all(&mut self, order: &[RequestId]) {
        for &id in order {
            self.engine.abort(id);
        }
    }

    /// The id and prompt of a request just added (`order` gets it), or, when it was refused,
    /// the error, with the requests of `order` aborted.
    fn added(
        &mut self,
        added: Result<RequestId, super::RequestError>,
        order: &mut Vec<RequestId>,
    ) -> Result<(RequestId, Vec<u32>)> {
        let id = match added {
            Ok(id) => id,
            Err(e) => {
                self.abort_all(order);
                return Err(anyhow::Error::new(e).context("request refused"));
            }
        };
        order.push(id);
        let prompt = self
            .engine
            .scheduler
            .request(id)
            .map(|r| r.prompt().to_vec());
        Ok((id, prompt.unwrap_or_default()))
    }

    /// Steps until every request has ended, each output to `on_output`; on an error the
    /// requests of `order` are aborted.
    fn run(&mut self, order: &[RequestId], mut on_output: impl FnMut(StepOutput)) -> Result<()> {
        while self.engine.has_unfinished() {
            match self.engine.step() {
                Ok(step) => step.into_iter().for_each(&mut on_output),
                Err(e) => {
                    self.abort_all(order);
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(ids: &[u32], finish: FinishReason) -> CompletionOutput {
        CompletionOutput {
            token_ids: ids.to_vec(),
            finish_reason: Some(finish),
            ..Default::default()
        }
    }

    #[test]
    fn repeating_tail_finds_the_shortest_period() {
        let mut ids = vec![5, 6, 7];
        for _ in 0..12 {
            ids.extend([1, 2, 3]);
        }
        assert_eq!(
            output(&ids, FinishReason::Length).repeating_tail(),
            Some((3, 12))
        );
        // A stop token ends it well, however it repeated before.
        assert_eq!(output(&ids, FinishReason::Stop).repeating_tail(), None);
        // A partial repeat at the end still counts; too few tokens in the loop do not.
        ids.push(1);
        assert_eq!(
            output(&ids, FinishReason::Length).repeating_tail(),
            Some((3, 12))
        );
        assert_eq!(
            output(&[9; 31], FinishReason::Length).repeating_tail(),
            None
        );
        assert_eq!(
            output(&[9; 32], FinishReason::Length).repeating_tail(),
            Some((1, 32))
        );
        let varied: Vec<u32> = (0..200).collect();
        assert_eq!(output(&varied, FinishReason::Length).repeating_tail(), None);
    }
}
