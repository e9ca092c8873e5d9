//! Continuous batching must not change results: many prompts at once, with a KV pool too small
//! for all of them (so chunked prefill and preemption happen), give exactly the tokens each
//! prompt gives alone, with prefix caching on (half the prompts share a long prefix) and off,
//! and with preemption by recompute and by swapping to host memory; seeded sampling is likewise
//! independent of the batch around it.

mod common;

use common::*;
use pagoda::engine::KvBudget;
use pagoda::parallel::ParallelConfig;
use pagoda::sched::PreemptionMode;
use pagoda::{EngineArgs, LLM, Prompt, SamplingParams};

/// Prompts of 10 to 600 tokens made of real text, varied in content and length.
fn prompts(n: usize) -> Vec<String> {
    let words =
        "the lighthouse keeper climbed one hundred and twelve steps every evening to light \
        the lamp while storms drove ships onto the reef and the children rowed to school when \
        the sea was calm so they studied at the kitchen table"
            .split(' ')
            .collect::<Vec<_>>();
    let shared = "the keeper's log, page one: ".repeat(6);
    (0..n)
        .map(|i| {
            // lengths spread over 10..600 tokens (about one token per word here)
            let len = 10 + (i * 560 / n.max(1) + i * 37 % 50) % 570;
            let text = (0..len)
                .map(|j| words[(i * 7 + j * (i % 5 + 1)) % words.len()])
                .collect::<Vec<_>>()
                .join(" ");
            // NOTE: every other prompt starts with one shared prefix, for the prefix cache.
            if i % 2 == 1 {
                format!("{shared}{text}")
            } else {
                text
            }
        })
        .collect()
}

fn engine_args(kv_bytes: Option<u64>, prefix_caching: bool) -> EngineArgs {
    EngineArgs {
        model: Some(model_path(SMOL_GGUF)),
        kv_budget: kv_bytes.map(KvBudget::Bytes),
        max_num_batched_tokens: Some(512),
        max_model_len: Some(1024),
        enable_prefix_caching: prefix_caching,
        ..Default::default()
    }
}

/// The prompts that `only` picks, each alone: one request at a time, every prompt computed in
/// full; and every prompt's length in tokens.
fn alone(
    prompts: &[String],
    max_tokens: impl Fn(usize) -> usize,
    parallel: ParallelConfig,
    only: impl Fn(usize) -> bool,
) -> (Vec<Option<Vec<u32>>>, Vec<usize>) {
    let mut llm = LLM::new(EngineArgs {
        parallel,
        ..engine_args(None, false)
    })
    .unwrap();
    let want = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = SamplingParams {
                max_tokens: Some(max_tokens(i)),
                ignore_eos: true,
                ..SamplingParams::greedy()
            };
            only(i).then(|| {
                llm.generate(&[p.as_str()], &params)
                    .unwrap()
                    .remove(0)
                    .outputs
                    .remove(0)
                    .token_ids
            })
        })
        .collect();
    let lens = prompts
        .iter()
        .map(|p| llm.engine().tokenizer().encode(p).unwrap().len())
        .collect();
    (want, lens)
}

#[test]
fn batch_with_preemption_equals_each_alone() {
    let prompts = prompts(64);
    let max_tokens = |i: usize| 4 + i % 5;
    let one = ParallelConfig::default();
    let (want, lens) = alone(&prompts, max_tokens, one, |_| true);
    assert!(
        *lens.iter().min().unwrap() >= 10
            && *lens.iter().max().unwrap() <= 700
            && *lens.iter().max().unwrap() > 450,
        "{lens:?}"
    );
    // NOTE: two runs cover prefix caching on and off and both preemption modes.
    for (caching, mode) in [
        (true, PreemptionMode::Recompute),
        (false, PreemptionMode::Swap),
    ] {
        together(&prompts, &want, &lens, max_tokens, caching, mode, one);
    }
}

/// The same under tensor parallelism 3 (SmolLM2's 9 heads, 3 KV heads): the split model is
/// batch-invariant too. All 64 prompts run together; every fourth is also run alone, to keep
/// the test short. NOTE: against the split model alone, not the single device: with the
/// weights in Q4_1, activations are quantized to 8 bits per block, so the last-bit differences
/// of sums split over ranks can flip a rounding and the outputs then differ at that
/// quantization's level (in f32 a split reproduces the goldens: tests/parallel.rs).
#[test]
fn batch_with_preemption_equals_each_alone_under_tensor_parallelism() {
    let prompts = prompts(64);
    let max_tokens = |i: usize| 4 + i % 5;
    let tp3 = ParallelConfig {
        tensor: 3,
        pipeline: 1,
    };
    let (want, lens) = alone(&prompts, max_tokens, tp3, |i| i % 4 == 0);
    together(
        &prompts,
        &want,
        &lens,
        max_tokens,
        true,
        PreemptionMode::Recompute,
        tp3,
    );
}

/// The same under pipeline parallelism 2, where two steps are in flight at once (each of
/// half the requests; every eighth prompt is also run alone): preemption, prefix caching and blocks freed and handed over while a
/// step still runs give every prompt its tokens alone.
#[test]
fn batch_with_preemption_equals_each_alone_under_pipeline_parallelism() {
    let prompts = prompts(64);
    let max_tokens = |i: usize| 4 + i % 5;
    let pp2 = ParallelConfig {
        tensor: 1,
        pipeline: 2,
    };
    let (want, lens) = alone(&prompts, max_tokens, pp2, |i| i % 8 == 1);
    together(
        &prompts,
        &want,
        &lens,
        max_tokens,
        true,
        PreemptionMode::Recompute,
        pp2,
    );
}

/// All prompts at once in a pool of 2048 tokens (SmolLM2 in Q4_1 keeps an f16 cache: 23040
/// bytes of K/V per token).
fn together(
    prompts: &[String],
    want: &[Option<Vec<u32>>],
    lens: &[usize],
    max_tokens: impl Fn(usize) -> usize,
    caching: bool,
    mode: PreemptionMode,
    parallel: ParallelConfig,
) {
    let mut llm = LLM::new(EngineArgs {
        preemption_mode: mode,
        parallel,
        ..engine_args(Some(2048 * 23040), caching)
    })
    .unwrap();
    let reqs = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = SamplingParams {
                max_tokens: Some(max_tokens(i)),
                ignore_eos: true,
                ..SamplingParams::greedy()
            };
            (Prompt::Text(p.clone()), params)
        })
        .collect();
    let outs = llm.generate_each(reqs).unwrap();
    for (i, (o, want)) in outs.iter().zip(want).enumerate() {
        let Some(want) = want else { continue };
        assert_eq!(
            &o.outputs[0].token_ids, want,
            "prompt {i} ({} tokens), prefix caching {caching}, {mode:?}, {parallel:?}",
            lens[i]
        );
    }
    let e = llm.engine();
    let pc = e.prefix_cache_stats();
    assert_eq!(pc.hits > 0, caching, "{pc:?}");
    let st = e.stats();
    if mode == PreemptionMode::Swap {
        assert!(st.blocks_swapped_out > 0, "nothing was swapped: {st:?}");
        assert_eq!(st.blocks_swapped_in, st.blocks_swapped_out, "{st:?}");
    } else {
        assert_eq!(st.blocks_swapped_out, 0);
    }
    assert!(
        e.stats().preemptions > 0,
        "the pool was meant to be too small: no preemption happened"
    );
    if parallel.pipeline > 1 {
        assert!(st.overlapped_steps > 0, "{st:?}");
    }
    let usage = e.kv_usage();
    assert_eq!(
        usage.blocks_used, 0,
        "blocks still in use after every request ended"
    );
    assert_eq!(usage.blocks_free, usage.num_blocks);
}

#[test]
fn seeded_sampling_is_independent_of_the_batch() {
    let mut llm = LLM::new(engine_args(None, true)).unwrap();
    let params = |seed| SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        max_tokens: Some(12),
        seed: Some(seed),
        ignore_eos: true,
        ..Default::default()
    };
    let p = "Write a short poem about the sea:";
    let alone = llm
        .generate(&[p], &params(7))
        .unwrap()
        .remove(0)
        .outputs
        .remove(0)
        .token_ids;
    let again = llm
        .generate(&[p], &params(7))
        .unwrap()
        .remove(0)
        .outputs
        .remove(0)
        .token_ids;
    assert_eq!(alone, again, "same seed, same output");
    let others = prompts(6);
    let mut reqs: Vec<(Prompt, SamplingParams)> = others
        .iter()
        .enumerate()
        .map(|(i, o)| (Prompt::Text(o.clone()), params(100 + i as u64)))
        .collect();
    reqs.insert(3, (Prompt::Text(p.into()), params(7)));
    let outs = llm.generate_each(reqs).unwrap();
    assert_eq!(
        outs[3].outputs[0].token_ids, alone,
        "seeded output changed inside a batch"
    );
    let other_seed = llm
        .generate(&[p], &params(8))
        .unwrap()
        .remove(0)
        .outputs
        .remove(0)
        .token_ids;
    assert_ne!(
        other_seed, alone,
        "another seed should (almost surely) give other tokens"
    );
}
