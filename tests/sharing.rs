//! Memory sharing in the paged KV cache, end to end on SmolLM2: prefix caching (a repeated
//! prompt computes only its last block, and changes no output), parallel sampling (`n` samples
//! share the prompt's blocks and are reproducible from the seed whatever else runs), `best_of`,
//! and group abort.

mod common;

use common::*;
use pagoda::{DType, Engine, EngineArgs, LLM, Prompt, SamplingParams};

fn args(prefix_caching: bool) -> EngineArgs {
    EngineArgs {
        model: Some(model_path(SMOL_GGUF)),
        max_num_batched_tokens: Some(512),
        max_model_len: Some(1024),
        enable_prefix_caching: prefix_caching,
        // NOTE: compared with the f32 goldens.
        dtype: DType::F32.into(),
        ..Default::default()
    }
}

/// A prompt of about `words` tokens of real text.
fn text(words: usize, salt: usize) -> String {
    let w = "a small boat crossed the bay at dawn carrying letters bread and news from the \
             mainland while gulls followed it and the island waited on the pier"
        .split(' ')
        .collect::<Vec<_>>();
    (0..words)
        .map(|j| w[(j * (salt % 3 + 1) + salt) % w.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

fn sampled(seed: u64, n: usize, best_of: Option<usize>) -> SamplingParams {
    SamplingParams {
        n,
        best_of,
        temperature: 1.0,
        top_k: 40,
        max_tokens: Some(10),
        seed: Some(seed),
        ignore_eos: true,
        ..Default::default()
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

fn run_alone(engine: &mut Engine, prompt: &[u32], params: SamplingParams) -> Vec<Vec<u32>> {
    let id = engine
        .add_request(Prompt::Tokens(prompt.to_vec()), params.clone())
        .unwrap();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); params.n];
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            assert_eq!(o.request_id, id);
            out[o.index].extend(&o.new_token_ids);
        }
    }
    out
}

#[test]
fn a_repeated_prompt_computes_only_its_last_block_and_gives_the_same_tokens() {
    let mut llm = LLM::new(args(true)).unwrap();
    let e = llm.engine();
    let prompt = e.tokenizer().encode(&text(150, 1)).unwrap();
    let l = prompt.len();
    assert!(l > 100, "{l}");
    let first = run_alone(e, &prompt, greedy(8));
    let before = e.stats().batched_tokens;
    let pc0 = e.prefix_cache_stats();
    let second = run_alone(e, &prompt, greedy(8));
    assert_eq!(first, second, "the cached prefix changed the output");
    // all full blocks but the one holding the last prompt token come from the cache
    let hit = (l - 1) / 16 * 16;
    let pc = e.prefix_cache_stats();
    assert_eq!(pc.queries - pc0.queries, l as u64);
    assert_eq!(pc.hits - pc0.hits, hit as u64);
    // computed: the prompt's tail, then 7 decode steps of one token
    assert_eq!(
        e.stats().batched_tokens - before,
        (l - hit + 7) as u64,
        "tokens computed for the second request"
    );
    assert_eq!(e.kv_usage().blocks_used, 0);
}

#[test]
fn greedy_goldens_are_the_same_with_and_without_prefix_caching_and_on_a_second_pass() {
    let g = golden();
    let entries: Vec<_> = g["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["model"] == SMOL_HF)
        .cloned()
        .collect();
    assert!(!entries.is_empty());
    let reqs = || -> Vec<(Prompt, SamplingParams)> {
        entries
            .iter()
            .map(|e| {
                let want = ids(&e["generated_ids"]);
                (
                    Prompt::Tokens(ids(&e["prompt_ids"])),
                    SamplingParams {
                        max_tokens: Some(want.len()),
                        ..SamplingParams::greedy()
                    },
                )
            })
            .collect()
    };
    for caching in [false, true] {
        let mut llm = LLM::new(args(caching)).unwrap();
        // the second pass finds every prompt's full blocks cached (when caching is on)
        for pass in 0..2 {
            let outs = llm.generate_each(reqs()).unwrap();
            for (e, o) in entries.iter().zip(&outs) {
                assert_eq!(
                    o.outputs[0].token_ids,
                    ids(&e["generated_ids"]),
                    "{} (prefix caching {caching}, pass {pass})",
                    e["name"]
                );
            }
        }
        let pc = llm.engine().prefix_cache_stats();
        assert_eq!(pc.hits > 0, caching, "{pc:?}");
    }
}

#[test]
fn n_samples_share_the_prompt_and_are_reproducible_inside_a_busy_batch() {
    for caching in [true, false] {
        let mut llm = LLM::new(args(caching)).unwrap();
        let e = llm.engine();
        let prompt = e.tokenizer().encode(&text(100, 2)).unwrap();
        let l = prompt.len();
        // Alone, and the block count after the first step: the full blocks once, then one
        // partial block per sample.
        let id = e
            .add_request(Prompt::Tokens(prompt.clone()), sampled(11, 4, None))
            .unwrap();
        let mut alone: Vec<Vec<u32>> = vec![Vec::new(); 4];
        let mut first_step = true;
        while e.has_unfinished() {
            for o in e.step().unwrap() {
                assert_eq!(o.request_id, id);
                alone[o.index].extend(&o.new_token_ids);
            }
            if first_step {
                first_step = false;
                let shared = (l - 1) / 16;
                let own = l.div_ceil(16) - shared;
                assert_eq!(
                    e.kv_usage().blocks_used,
                    shared + 4 * own,
                    "4 samples of {l} tokens (caching {caching})"
                );
            }
        }
        assert!(
            alone.iter().any(|s| s != &alone[0]),
            "4 samples at temperature 1 should differ: {alone:?}"
        );
        assert_eq!(e.kv_usage().blocks_used, 0);
        // Inside a batch of other requests, sampled and greedy, admitted before and after.
        let mut ids = Vec::new();
        for i in 0..3 {
            let p = Prompt::Text(text(40 + 30 * i, 3 + i));
            ids.push(e.add_request(p, sampled(100 + i as u64, 2, None)).unwrap());
        }
        let ours = e
            .add_request(Prompt::Tokens(prompt.clone()), sampled(11, 4, None))
            .unwrap();
        ids.push(
            e.add_request(Prompt::Text(text(200, 9)), greedy(12))
                .unwrap(),
        );
        let mut busy: Vec<Vec<u32>> = vec![Vec::new(); 4];
        while e.has_unfinished() {
            for o in e.step().unwrap() {
                if o.request_id == ours {
                    busy[o.index].extend(&o.new_token_ids);
                }
            }
        }
        assert_eq!(
            busy, alone,
            "the samples changed inside a batch (caching {caching})"
        );
        assert_eq!(e.kv_usage().blocks_used, 0);
    }
}

#[test]
fn best_of_returns_the_most_likely_samples() {
    let mut llm = LLM::new(args(true)).unwrap();
    let prompt = text(30, 4);
    let with_lp = |mut p: SamplingParams| {
        p.logprobs = Some(0);
        p
    };
    let all = llm
        .generate(&[prompt.as_str()], &with_lp(sampled(5, 4, None)))
        .unwrap()
        .remove(0);
    let best = llm
        .generate(&[prompt.as_str()], &with_lp(sampled(5, 2, Some(4))))
        .unwrap()
        .remove(0);
    let score = |c: &pagoda::engine::CompletionOutput| -> f64 {
        c.logprobs.iter().map(|l| l.logprob as f64).sum()
    };
    let mut ranked: Vec<_> = all.outputs.iter().collect();
    ranked.sort_by(|a, b| score(b).total_cmp(&score(a)));
    assert_eq!(best.outputs.len(), 2);
    for (i, c) in best.outputs.iter().enumerate() {
        assert_eq!(c.index, i);
        assert_eq!(c.token_ids, ranked[i].token_ids, "rank {i}");
        assert_eq!(c.token_ids.len(), 10);
        assert!(c.finish_reason.is_some());
    }
    assert!(score(&best.outputs[0]) >= score(&best.outputs[1]));
}

#[test]
fn aborting_a_request_frees_all_its_samples() {
    let mut llm = LLM::new(args(false)).unwrap();
    let e = llm.engine();
    let id = e
        .add_request(Prompt::Text(text(60, 5)), sampled(1, 3, Some(5)))
        .unwrap();
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.kv_usage().blocks_used > 0);
    assert_eq!(e.num_running(), 5);
    assert!(e.abort(id));
    assert!(!e.has_unfinished());
    assert_eq!(e.kv_usage().blocks_used, 0);
    assert!(!e.abort(id), "already gone");
}
