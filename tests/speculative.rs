//! Speculative decoding (n-gram prompt lookup) must not change outputs: the same prompts,
//! batched, with and without `--speculative-config`, give the same tokens on the real models
//! (SmolLM2 as shipped, Q4_1 with 8-bit activations, and its f32 HF copy), with prefix caching
//! and preemption in play, and split into two pipeline stages: greedy requests, and seeded
//! sampled ones with penalties and log-probabilities (each draft's row is sampled with the
//! draw of its position, so the tokens are the same draw for draw, which is stronger than the
//! same distribution). The drafts must be accepted often where the output repeats the prompt.

mod common;

use common::*;
use pagoda::engine::KvBudget;
use pagoda::parallel::ParallelConfig;
use pagoda::sched::NgramConfig;
use pagoda::{BackendKind, EngineArgs, LLM, Prompt, SamplingParams};

const SPEC: NgramConfig = NgramConfig {
    num_speculative_tokens: 4,
    prompt_lookup_max: 3,
    prompt_lookup_min: 1,
    disable_by_batch_size: None,
};

/// Prompts whose continuations repeat them (lists, verses, code) and others that do not; the
/// odd ones share a prefix, for the prefix cache.
fn prompts() -> Vec<String> {
    let verse = "Row, row, row your boat, gently down the stream. Merrily, merrily, merrily, \
                 merrily, life is but a dream. ";
    let code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n";
    let shared = "Notes from the lighthouse keeper's log, kept every evening: ";
    let mut p = vec![
        verse.repeat(3),
        format!("{shared}{}", code.repeat(2)),
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,".to_string(),
        format!("{shared}The capital of France is"),
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday,".to_string(),
        format!("{shared}the lamp was lit at dusk; the lamp was lit at dusk; the lamp"),
    ];
    p.push("Once upon a time, in a small village by the sea,".to_string());
    p
}

fn args(model: &str, spec: Option<NgramConfig>, kv: Option<u64>) -> EngineArgs {
    EngineArgs {
        model: Some(model_path(model)),
        kv_budget: kv.map(KvBudget::Bytes),
        max_num_batched_tokens: Some(64),
        max_model_len: Some(512),
        speculative: spec,
        ..Default::default()
    }
}

/// Every prompt's tokens (greedy, 48 each, eos ignored), and those of seeded sampled requests
/// (one with penalties and log-probabilities, whose values are compared too, one the best of
/// three); with the engine's counters.
fn run(args: EngineArgs) -> (Vec<Vec<u32>>, pagoda::engine::EngineStats) {
    let mut llm = LLM::new(args).unwrap();
    let prompts = prompts();
    let greedy = SamplingParams {
        max_tokens: Some(48),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: Some(7),
        ..greedy.clone()
    };
    let penalized = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        seed: Some(3),
        repetition_penalty: 1.1,
        presence_penalty: 0.3,
        logprobs: Some(2),
        ..greedy.clone()
    };
    // NOTE: the sampled requests run in the same batch as the greedy ones.
    let mut all: Vec<(String, SamplingParams)> = prompts
        .iter()
        .map(|p| (p.clone(), greedy.clone()))
        .collect();
    let ranked = SamplingParams {
        best_of: Some(3),
        ..sampled.clone()
    };
    all.push((prompts[0].clone(), sampled));
    all.push((prompts[4].clone(), penalized));
    // `best_of` ranks its samples by the log-probabilities of their tokens.
    all.push((prompts[2].clone(), ranked));
    let outs = llm
        .generate_each(all.into_iter().map(|(p, s)| (p.into(), s)).collect())
        .unwrap();
    // The log-probabilities' bits ride along as extra "tokens".
    let ids = outs
        .into_iter()
        .map(|o| {
            let c = &o.outputs[0];
            let mut v = c.token_ids.clone();
            for l in &c.logprobs {
                v.push(l.logprob.to_bits());
                v.extend(l.top.iter().flat_map(|&(t, p)| [t, p.to_bits()]));
            }
            v
        })
        .collect();
    (ids, llm.engine().stats().clone())
}

fn same_outputs(model: &str) {
    let (plain, _) = run(args(model, None, None));
    // A pool of 12 MiB (16 to 32 blocks of 16 tokens, by the cache's type) for 8 requests of
    // up to 110 tokens: preemption.
    let (spec, stats) = run(args(model, Some(SPEC), Some(12 << 20)));
    for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!(a, b, "{model}: request {i} differs with speculation");
    }
    eprintln!(
        "{model}: {} of {} drafts accepted in {} verifying steps; {} preemptions",
        stats.spec_accepted_tokens, stats.spec_draft_tokens, stats.spec_drafts, stats.preemptions
    );
    assert!(
        stats.spec_accepted_tokens * 4 > stats.spec_draft_tokens,
        "the repeating prompts should have their drafts accepted often"
    );
    assert!(stats.preemptions > 0, "the small pool is meant to preempt");
}

#[test]
fn greedy_outputs_are_unchanged_q4_1() {
    same_outputs(SMOL_GGUF);
}

#[test]
fn greedy_outputs_are_unchanged_f32() {
    same_outputs(SMOL_HF);
}

#[test]
fn greedy_outputs_are_unchanged_in_two_pipeline_stages() {
    let pp = |spec| EngineArgs {
        parallel: ParallelConfig {
            tensor: 1,
            pipeline: 2,
        },
        ..args(SMOL_GGUF, spec, None)
    };
    let (plain, _) = run(pp(None));
    let (spec, stats) = run(pp(Some(SPEC)));
    assert_eq!(plain, spec);
    assert!(stats.spec_accepted_tokens > 0);
}

/// `disable_by_batch_size`: no drafts while that many requests run.
#[test]
fn large_batches_do_not_speculate() {
    let spec = NgramConfig {
        disable_by_batch_size: Some(2),
        ..SPEC
    };
    let (_, stats) = run(args(SMOL_GGUF, Some(spec), None));
    // the batch of 8 shrinks to one request only at the very end, if ever
    let (_, all) = run(args(SMOL_GGUF, Some(SPEC), None));
    assert!(
        stats.spec_drafts < all.spec_drafts / 4,
        "{stats:?} against {all:?}"
    );
}

/// Every tiny family (tests/data/tiny) with speculation reproduces transformers' greedy ids, on
/// the CPU, and on the emulated GPU (where every draft row is reduced to its argmax by the
/// device's kernel) for the first two; random weights often loop, so drafts are accepted.
#[test]
fn tiny_families_reproduce_their_goldens_with_speculation() {
    let mut accepted = 0;
    for (i, &m) in TINY_FAMILIES.iter().enumerate() {
        let backends: &[BackendKind] = if i < 2 {
            &[BackendKind::Cpu, BackendKind::Emu]
        } else {
            &[BackendKind::Cpu]
        };
        for &backend in backends {
            let mut llm = LLM::new(EngineArgs {
                model: Some(tiny(m)),
                backend,
                block_size: 4,
                max_num_batched_tokens: Some(64),
                speculative: Some(SPEC),
                ..Default::default()
            })
            .unwrap();
            let cases = tiny_cases(m);
            let requests = cases
                .iter()
                .map(|(prompt, want)| {
                    let p = SamplingParams {
                        max_tokens: Some(want.len()),
                        ignore_eos: true,
                        ..SamplingParams::greedy()
                    };
                    (Prompt::Tokens(prompt.clone()), p)
                })
                .collect();
            let outs = llm.generate_each(requests).unwrap();
            for (o, (_, want)) in outs.iter().zip(&cases) {
                assert_eq!(&o.outputs[0].token_ids, want, "{m} on {backend:?}");
            }
            accepted += llm.engine().stats().spec_accepted_tokens;
        }
    }
    assert!(accepted > 0);
}

/// Seeded sampled requests alone (temperature 0.8, top-p 0.95, eight seeds) on a prompt whose
/// continuation repeats it: drafts are made and kept, and every request gives the tokens it
/// gives without them. Also on the emulated GPU, where the rows are sampled on the device.
#[test]
fn seeded_sampling_speculates_and_keeps_its_tokens() {
    let sampled = |seed| SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(seed),
        max_tokens: Some(32),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let run = |args: EngineArgs, prompt: &Prompt| {
        let mut llm = LLM::new(args).unwrap();
        let all = (0..8).map(|s| (prompt.clone(), sampled(s))).collect();
        let outs = llm.generate_each(all).unwrap();
        let ids: Vec<Vec<u32>> = outs
            .iter()
            .map(|o| o.outputs[0].token_ids.clone())
            .collect();
        (ids, llm.engine().stats().clone())
    };
    let smol = Prompt::Text(prompts()[0].clone());
    let (plain, _) = run(args(SMOL_GGUF, None, None), &smol);
    let (spec, stats) = run(args(SMOL_GGUF, Some(SPEC), None), &smol);
    assert_eq!(plain, spec);
    assert!(stats.spec_accepted_tokens > 0, "{stats:?}");

    let m = TINY_FAMILIES[0];
    let tiny_prompt = Prompt::Tokens(tiny_cases(m)[0].0.clone());
    let emu = |spec| EngineArgs {
        model: Some(tiny(m)),
        backend: BackendKind::Emu,
        block_size: 4,
        speculative: spec,
        ..Default::default()
    };
    let (plain, _) = run(emu(None), &tiny_prompt);
    let (spec, stats) = run(emu(Some(SPEC)), &tiny_prompt);
    assert_eq!(plain, spec);
    assert!(
        stats.spec_drafts > 0 && stats.random_samples_on_device > 0,
        "{stats:?}"
    );
}
