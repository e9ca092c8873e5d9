//! Prompt log-probabilities on SmolLM2, checked against the decode path: a greedy continuation
//! sent back as part of a prompt must be scored as it was when it was generated (same
//! log-probabilities within f32 noise, rank 1), also when the prompt is computed in chunks
//! and whatever the prefix cache holds.

mod common;

use common::*;
use pagoda::{EngineArgs, LLM, Prompt, SamplingParams};

#[test]
fn prompt_scores_match_the_generated_tokens_scores() {
    for (chunk, caching) in [(2048, true), (16, true), (16, false)] {
        let mut llm = LLM::new(EngineArgs {
            model: Some(model_path(SMOL_GGUF)),
            max_model_len: Some(512),
            max_num_batched_tokens: Some(chunk),
            enable_prefix_caching: caching,
            ..Default::default()
        })
        .unwrap();
        let prompt: Vec<u32> = llm
            .engine()
            .tokenizer()
            .encode("The capital of France is Paris, and the capital of Italy is")
            .unwrap();
        let greedy = SamplingParams {
            max_tokens: Some(10),
            ignore_eos: true,
            logprobs: Some(2),
            ..SamplingParams::greedy()
        };
        let out = llm
            .generate(&[Prompt::Tokens(prompt.clone())], &greedy)
            .unwrap();
        let c = &out[0].outputs[0];
        let mut full = prompt.clone();
        full.extend(&c.token_ids);
        let score = SamplingParams {
            max_tokens: Some(1),
            prompt_logprobs: Some(2),
            ..SamplingParams::greedy()
        };
        // Twice: the second time the prompt's blocks are cached, and must be computed anyway.
        for _ in 0..2 {
            let out = llm
                .generate(&[Prompt::Tokens(full.clone())], &score)
                .unwrap();
            let p = out[0].prompt_logprobs.as_ref().expect("prompt log-probs");
            assert_eq!(p.len(), full.len() - 1, "chunk {chunk}");
            for (j, (tok, lp)) in c.token_ids.iter().zip(&c.logprobs).enumerate() {
                let e = &p[prompt.len() - 1 + j];
                assert_eq!(e.logprobs.token_id, *tok);
                assert_eq!(e.rank, 1, "a greedy token is the most likely");
                assert!(
                    (e.logprobs.logprob - lp.logprob).abs() <= 1e-4 * lp.logprob.abs().max(1.0),
                    "chunk {chunk}, token {j}: {} against {}",
                    e.logprobs.logprob,
                    lp.logprob
                );
                assert_eq!(e.logprobs.top.len(), 2);
                assert_eq!(e.logprobs.top[0].0, *tok);
            }
            for (i, e) in p.iter().enumerate() {
                assert_eq!(e.logprobs.token_id, full[i + 1]);
                assert!(e.logprobs.logprob <= 0.0 && e.rank >= 1);
            }
        }
    }
}
