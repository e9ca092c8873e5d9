//! Tensor and pipeline parallelism on the CPU backend (workers are threads, the in-process
//! communicator adds in rank order): every split reproduces the single-device greedy goldens
//! exactly, and its logits agree with the single device's within 1e-4 relative (the sums are
//! split differently, so not to the bit); splits that cannot work are clear errors before any
//! weight is loaded.

mod common;

use common::*;
use pagoda::backend::{BackendKind, BatchInput};
use pagoda::engine::KvBudget;
use pagoda::engine::launch::create_runner;
use pagoda::engine::runner::{ModelRunner, RunnerArgs};
use pagoda::models::{LoadedModel, load_model};
use pagoda::parallel::{NodeConfig, ParallelConfig};
use pagoda::tensor::DType;
use pagoda::{EngineArgs, LLM, Prompt, SamplingParams};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn split(tensor: usize, pipeline: usize) -> ParallelConfig {
    ParallelConfig { tensor, pipeline }
}

fn runner(model: &LoadedModel, parallel: ParallelConfig) -> anyhow::Result<Box<dyn ModelRunner>> {
    runner_on(BackendKind::Cpu, model, parallel)
}

fn runner_on(
    backend: BackendKind,
    model: &LoadedModel,
    parallel: ParallelConfig,
) -> anyhow::Result<Box<dyn ModelRunner>> {
    runner_with(backend, model, parallel, NodeConfig::default(), 1024)
}

/// Block size 16, `max_model_len` positions.
fn runner_with(
    backend: BackendKind,
    model: &LoadedModel,
    parallel: ParallelConfig,
    nodes: NodeConfig,
    max_model_len: usize,
) -> anyhow::Result<Box<dyn ModelRunner>> {
    let args = RunnerArgs {
        backend,
        dtype: DType::F32.into(),
        kv_cache_dtype: Default::default(),
        block_size: 16,
        kv_budget: Some(KvBudget::Bytes(256 << 20)),
        max_model_len,
        max_useful_blocks: 64,
        parallel,
        nodes,
        head: Default::default(),
    };
    create_runner(model, &args, &mut |_, _| {})
}

/// The prefill of `prompt` in blocks 1.. (one sequence): its last row's logits.
fn prefill(r: &mut dyn ModelRunner, prompt: &[u32]) -> Vec<f32> {
    let table: Vec<u32> = (1..64u32).rev().collect();
    let input: BatchInput = single_sequence_step(prompt.to_vec(), 0, &table, 16);
    let out = r.execute(input, &[None]).unwrap();
    assert_eq!(out.choices, [None]);
    out.logits
}

/// Greedy decoding of `(prompt, generated)` pairs, all in one batch, under `parallel`.
fn check_greedy(path: &Path, parallel: ParallelConfig, cases: &[(Vec<u32>, Vec<u32>)], what: &str) {
    check_greedy_on(path, parallel, NodeConfig::default(), cases, what)
}

/// The same, as node 0 of `nodes`.
fn check_greedy_on(
    path: &Path,
    parallel: ParallelConfig,
    nodes: NodeConfig,
    cases: &[(Vec<u32>, Vec<u32>)],
    what: &str,
) {
    check_greedy_with(BackendKind::Cpu, path, parallel, nodes, cases, what);
}

/// The same, on `backend`'s devices; returns the runner's name.
fn check_greedy_with(
    backend: BackendKind,
    path: &Path,
    parallel: ParallelConfig,
    nodes: NodeConfig,
    cases: &[(Vec<u32>, Vec<u32>)],
    what: &str,
) -> String {
    let mut llm = LLM::new(EngineArgs {
        model: Some(path.to_path_buf()),
        backend,
        dtype: DType::F32.into(),
        kv_budget: Some(KvBudget::Bytes(256 << 20)),
        block_size: 4,
        max_num_batched_tokens: Some(64),
        parallel,
        nodes,
        ..Default::default()
    })
    .unwrap();
    assert!(
        llm.engine().backend_name().contains(&format!(
            "tensor parallel {}, pipeline parallel {}",
            parallel.tensor, parallel.pipeline
        )),
        "{}",
        llm.engine().backend_name()
    );
    let reqs = cases
        .iter()
        .map(|(p, want)| {
            let params = SamplingParams {
                max_tokens: Some(want.len()),
                ignore_eos: true,
                ..SamplingParams::greedy()
            };
            (Prompt::Tokens(p.clone()), params)
        })
        .collect();
    let outs = llm.generate_each(reqs).unwrap();
    for (i, ((_, want), o)) in cases.iter().zip(&outs).enumerate() {
        assert_eq!(
            &o.outputs[0].token_ids, want,
            "{what} {parallel:?}: prompt {i}"
        );
    }
    // every block came back to the one pool
    let u = llm.engine().kv_usage();
    assert_eq!(u.blocks_used, 0, "{u:?}");
    // with several stages, the steps overlapped (one stage on a step while the next runs the
    // one before), given more than one request to keep apart
    if parallel.pipeline > 1 && cases.len() > 1 {
        assert!(llm.engine().stats().overlapped_steps > 0, "{parallel:?}");
    }
    llm.engine().backend_name()
}

/// The top-5 logits of the single device at the end of each prompt, under each split, within
/// 1e-4 relative.
fn check_logits(model: &LoadedModel, splits: &[ParallelConfig], prompts: &[Vec<u32>]) {
    let mut one = runner(model, ParallelConfig::default()).unwrap();
    let want: Vec<Vec<f32>> = prompts.iter().map(|p| prefill(one.as_mut(), p)).collect();
    drop(one);
    for &s in splits {
        let mut r = runner(model, s).unwrap();
        assert_eq!(r.parallel(), s);
        for (p, want) in prompts.iter().zip(&want) {
            let got = prefill(r.as_mut(), p);
            assert_eq!(got.len(), want.len());
            let mut top: Vec<usize> = (0..want.len()).collect();
            top.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
            for &id in &top[..5] {
                let rel = (got[id] - want[id]).abs() / want[id].abs().max(1.0);
                assert!(rel < 1e-4, "{s:?} token {id}: {} vs {}", got[id], want[id]);
            }
        }
    }
}

fn golden_cases(model_id: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    golden()["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["model"] == model_id)
        .map(|e| (ids(&e["prompt_ids"]), ids(&e["generated_ids"])))
        .collect()
}

#[test]
fn smollm2_tensor_3_pipeline_2_and_both_reproduce_the_goldens() {
    // SmolLM2: 9 heads, 3 KV heads, 30 layers
    let path = model_path(SMOL_HF);
    let cases = golden_cases("smollm2-135m-instruct-f32");
    let splits = [split(3, 1), split(1, 2), split(3, 2)];
    for s in splits {
        check_greedy(&path, s, &cases, "smollm2");
    }
    let model = load_model(&path).unwrap();
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| c.0.clone()).collect();
    check_logits(&model, &splits, &prompts);
}

#[test]
fn qwen25_tensor_2_and_7_with_kv_heads_replicated_reproduce_the_goldens() {
    // Qwen2.5-0.5B: 14 heads, 2 KV heads (QKV biases); at 7 ranks of 2 heads, rank 3 holds
    // heads 6 and 7, which read different KV heads: it keeps both
    let path = model_path(QWEN_GGUF);
    let cases = golden_cases("qwen2.5-coder-0.5b-instruct-f32");
    let splits = [split(2, 1), split(7, 1)];
    for s in splits {
        check_greedy(&path, s, &cases, "qwen2.5");
    }
    let model = load_model(&path).unwrap();
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| c.0.clone()).collect();
    check_logits(&model, &splits, &prompts);
}

/// The tiny model's transformers goldens.
/// Every family's tiny model (4 heads, 2 KV heads, 3 layers; Phi-3's projections fused; Gemma 3:
/// 1 KV head, replicated, 6 layers of local and global attention; GPT-2 and Falcon: biases on
/// the row-parallel projections, added by rank 0 only; Falcon: multi-query, attention and MLP
/// in parallel; OLMo 2: Q/K norms over all heads, each rank computing all of Q and K; BLOOM,
/// MPT, Falcon-RW: ALiBi slopes of the rank's heads): their transformers goldens under tensor
/// 2, pipeline 2 and both.
#[test]
fn tiny_families_split_reproduce_their_goldens() {
    for &m in TINY_FAMILIES {
        let cases = tiny_cases(m);
        for s in [split(2, 1), split(1, 2), split(2, 2)] {
            check_greedy(&tiny(m), s, &cases, m);
        }
    }
}

#[test]
fn splits_that_cannot_work_are_clear_errors_before_loading() {
    let smol = load_model(&model_path(SMOL_HF)).unwrap();
    let err = |m: &LoadedModel, s| format!("{:#}", runner(m, s).err().expect("an error"));
    let e = err(&smol, split(2, 1));
    assert!(
        e.contains("does not divide the model's 9 attention heads"),
        "{e}"
    );
    let e = err(&smol, split(1, 31));
    assert!(e.contains("more than the model's 30 layers"), "{e}");
    let e = err(&smol, split(0, 1));
    assert!(e.contains("at least 1"), "{e}");
    let e = format!(
        "{:#}",
        create_runner(
            &smol,
            &RunnerArgs {
                backend: BackendKind::Cuda,
                dtype: DType::F32.into(),
                kv_cache_dtype: Default::default(),
                block_size: 16,
                kv_budget: None,
                max_model_len: 1024,
                max_useful_blocks: 64,
                parallel: split(3, 1),
                nodes: NodeConfig::default(),
                head: Default::default(),
            },
            &mut |_, _| {}
        )
        .err()
        .expect("an error")
    );
    // no CUDA here: the error says why, before any weight is loaded
    assert!(e.contains("CUDA") || e.contains("cuda"), "{e}");
    // more workers than devices
    let e = format!(
        "{:#}",
        create_runner(
            &smol,
            &RunnerArgs {
                backend: BackendKind::Emu,
                dtype: DType::F32.into(),
                kv_cache_dtype: Default::default(),
                block_size: 16,
                kv_budget: None,
                max_model_len: 1024,
                max_useful_blocks: 64,
                parallel: split(3, 3),
                nodes: NodeConfig::default(),
                head: Default::default(),
            },
            &mut |_, _| {}
        )
        .err()
        .expect("an error")
    );
    assert!(
        e.contains("needs 9 devices on this node, and this process sees 8"),
        "{e}"
    );
}

/// One worker per emulated GPU (`--backend emu`: the CUDA kernels and the GPU backend's host
/// code, each worker with its own device memory), exchanging activations through the host.
#[test]
fn workers_on_emulated_gpus_reproduce_the_goldens() {
    let cases = tiny_cases("mistral");
    for s in [split(2, 1), split(1, 2)] {
        check_greedy_with(
            BackendKind::Emu,
            &tiny("mistral"),
            s,
            NodeConfig::default(),
            &cases,
            "emu",
        );
    }
}

/// Builds `tests/data/ccl_host.cc`, a library with NCCL's C API over host memory.
fn build_ccl_host(dir: &Path) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/ccl_host.cc");
    let lib = dir.join("libccl_host.so");
    let out = Command::new("c++")
        .args(["-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .expect("a C++ compiler (c++)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lib
}

/// The NCCL binding (src/parallel/ccl.rs) on the emulated GPUs, through a library with NCCL's
/// API over host memory: every collective the sharded models use (all-reduce in place, the
/// pipeline's send and receive) goes through the binding's real calls, and the goldens come
/// out. A library that is not there is a clear error before any weight is loaded.
///
/// NOTE: the library is named in the environment, which the emulator reads when it opens: the
/// test runs itself again in a child process with it set (tests in one process share theirs),
/// and with PAGODA_PARALLEL_RUNNER=1, which sends even one device through the workers.
#[test]
fn workers_on_emulated_gpus_through_an_nccl_api_library_reproduce_the_goldens() {
    const NAME: &str = "workers_on_emulated_gpus_through_an_nccl_api_library_reproduce_the_goldens";
    let Some(lib) = std::env::var_os("PAGODA_EMU_CCL").map(PathBuf::from) else {
        let dir = tempfile::tempdir().unwrap();
        let built = build_ccl_host(dir.path());
        for lib in [built, dir.path().join("libnccl-missing.so")] {
            let out = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
                .env("PAGODA_EMU_CCL", &lib)
                .env("PAGODA_PARALLEL_RUNNER", "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "{}: {text}",
                lib.display()
            );
        }
        return;
    };
    let path = tiny("mistral");
    if !lib.exists() {
        let model = load_model(&path).unwrap();
        let args = RunnerArgs {
            backend: BackendKind::Emu,
            dtype: DType::F32.into(),
            kv_cache_dtype: Default::default(),
            block_size: 16,
            kv_budget: Some(KvBudget::Bytes(16 << 20)),
            max_model_len: 256,
            max_useful_blocks: 64,
            parallel: split(2, 1),
            nodes: NodeConfig::default(),
            head: Default::default(),
        };
        let mut loaded = 0;
        let e = create_runner(&model, &args, &mut |_, _| loaded += 1)
            .err()
            .expect("an error");
        let e = format!("{e:#}");
        assert!(
            e.contains("was not found (tried") && e.contains("libnccl-missing.so"),
            "{e}"
        );
        assert_eq!(loaded, 0, "no layer is loaded before the error");
        return;
    }
    let cases = tiny_cases("mistral");
    // 1 x 1: through the workers and the library too (PAGODA_PARALLEL_RUNNER=1, as
    // scripts/gpu-check.sh runs it on a machine with one GPU)
    for s in [split(1, 1), split(2, 1), split(1, 2), split(2, 2)] {
        let none = NodeConfig::default();
        let name = check_greedy_with(BackendKind::Emu, &path, s, none, &cases, "emu + ccl");
        let through = format!(
            "through the collective library of PAGODA_EMU_CCL {}",
            lib.display()
        );
        assert!(name.contains(&through), "{name}");
    }
    // a failed step aborts the communicators, and the next step makes them anew
    a_failed_step_leaves_the_workers_usable_on(BackendKind::Emu);

    // workers on two nodes (processes) whose groups are made from node 0's unique ids (NCCL's
    // own bootstrap): tensor parallelism across the nodes (2 x 1, one worker each), and the
    // pipeline across them (2 x 2)
    for s in [split(2, 1), split(2, 2)] {
        let port = free_port();
        let child = spawn_node_with(BackendKind::Emu, &path, s, 2, 1, port, 4, &[]);
        let name = check_greedy_with(
            BackendKind::Emu,
            &path,
            s,
            nodes(2, port, 120),
            &cases,
            "emu + ccl, 2 nodes",
        );
        assert!(
            name.contains("2 nodes") && name.contains("PAGODA_EMU_CCL"),
            "{name}"
        );
        wait_ok(child);
    }
    // a failed step across nodes: aborted on both, made again on both from fresh ids
    let port = free_port();
    let child = spawn_node_with(
        BackendKind::Emu,
        &path,
        split(2, 2),
        2,
        1,
        port,
        16,
        &["--max-model-len", "256"],
    );
    let model = load_model(&path).unwrap();
    let mut r = runner_with(
        BackendKind::Emu,
        &model,
        split(2, 2),
        nodes(2, port, 120),
        256,
    )
    .unwrap();
    fail_and_recover(r.as_mut());
    drop(r);
    wait_ok(child);
}

/// A failing step (a position past the RoPE tables, refused by every worker) is an error, and
/// the workers run the next step as if nothing had happened.
#[test]
fn a_failed_step_leaves_the_workers_usable() {
    a_failed_step_leaves_the_workers_usable_on(BackendKind::Cpu);
}

fn a_failed_step_leaves_the_workers_usable_on(backend: BackendKind) {
    let model = load_model(&tiny("mistral")).unwrap();
    let mut r = runner_on(backend, &model, split(2, 2)).unwrap();
    fail_and_recover(r.as_mut());
}

fn fail_and_recover(r: &mut dyn ModelRunner) {
    let prompt: Vec<u32> = vec![5, 17, 33, 2, 9];
    let before = prefill(r, &prompt);
    let table: Vec<u32> = (1..64u32).rev().collect();
    let mut bad = single_sequence_step(prompt.clone(), 0, &table, 16);
    bad.positions[2] = 1 << 20;
    let e = format!("{:#}", r.execute(bad, &[None]).unwrap_err());
    assert!(e.contains("beyond the maximum model length"), "{e}");
    assert!(!e.contains("another worker failed"), "{e}");
    assert_eq!(prefill(r, &prompt), before);
}

/// With pipeline parallelism two steps are in flight; the second fails in every worker. The
/// failure comes back (with the first step's results, or instead of them when the abort
/// reached the first step's collectives), nothing hangs, and the workers run the next step as
/// if nothing had happened.
#[test]
fn a_failed_step_with_another_in_flight_leaves_the_workers_usable() {
    let model = load_model(&tiny("mistral")).unwrap();
    let mut r = runner(&model, split(2, 2)).unwrap();
    assert_eq!(r.max_in_flight(), 2);
    let prompt: Vec<u32> = vec![5, 17, 33, 2, 9];
    let before = prefill(r.as_mut(), &prompt);
    let table: Vec<u32> = (1..64u32).rev().collect();
    let good = single_sequence_step(prompt.clone(), 0, &table, 16);
    let mut bad = good.clone();
    bad.positions[2] = 1 << 20;
    r.start(good, vec![None]).unwrap();
    r.start(bad, vec![None]).unwrap();
    let e = match r.finish() {
        Ok(out) => {
            assert_eq!(
                out.choices,
                [None],
                "a token for a step that asked for logits"
            );
            assert_eq!(out.logits, before);
            r.finish().unwrap_err()
        }
        Err(e) => {
            let again = format!("{:#}", r.finish().unwrap_err());
            assert!(again.contains("no step is in flight"), "{again}");
            e
        }
    };
    let e = format!("{e:#}");
    assert!(e.contains("beyond the maximum model length"), "{e}");
    assert_eq!(prefill(r.as_mut(), &prompt), before);
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `pagoda info` as node `rank` of `nnodes`, with the settings `check_greedy_on` uses (a node
/// other than 0 serves its workers and ignores the command).
fn spawn_node(
    path: &Path,
    s: ParallelConfig,
    nnodes: usize,
    rank: usize,
    port: u16,
    block_size: usize,
) -> std::process::Child {
    spawn_node_with(
        BackendKind::Cpu,
        path,
        s,
        nnodes,
        rank,
        port,
        block_size,
        &[],
    )
}

/// The same on `backend`, with `extra` arguments.
#[allow(clippy::too_many_arguments)]
fn spawn_node_with(
    backend: BackendKind,
    path: &Path,
    s: ParallelConfig,
    nnodes: usize,
    rank: usize,
    port: u16,
    block_size: usize,
    extra: &[&str],
) -> std::process::Child {
    let arg = |v: usize| v.to_string();
    Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .arg("info")
        .args(["--backend", backend.name()])
        .args(extra)
        .arg("--model")
        .arg(path)
        .args(["--dtype", "f32", "--kv-cache-memory", "256MiB"])
        .args(["--block-size", &arg(block_size)])
        .args(["--tensor-parallel-size", &arg(s.tensor)])
        .args(["--pipeline-parallel-size", &arg(s.pipeline)])
        .args(["--nnodes", &arg(nnodes), "--node-rank", &arg(rank)])
        .args([
            "--master-port",
            &arg(port as usize),
            "--rendezvous-timeout",
            "120",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn nodes(nnodes: usize, port: u16, timeout_s: u64) -> NodeConfig {
    NodeConfig {
        nnodes,
        node_rank: 0,
        master_port: port,
        timeout: std::time::Duration::from_secs(timeout_s),
        ..NodeConfig::default()
    }
}

/// Exits with success once node 0 has closed its connections.
fn wait_ok(child: std::process::Child) {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The workers spread over processes that meet over TCP (`--nnodes`): SmolLM2 at tensor 3 x
/// pipeline 2 on 2 nodes (node 1 holds the second stage: the pipeline hand-over crosses nodes,
/// node 1's all-reduces run through node 0), and a tiny Gemma 3 at 2 x 2 on 4 nodes (one
/// worker each, every collective between processes), reproduce their goldens; each other
/// node exits cleanly when node 0 is done; stray connections to node 0 are ignored.
#[test]
fn workers_on_other_nodes_over_tcp_reproduce_the_goldens() {
    let smol = model_path(SMOL_HF);
    let port = free_port();
    let child = spawn_node(&smol, split(3, 2), 2, 1, port, 4);
    // NOTE: a stray client (an HTTP request, then one that sends nothing) is ignored by node 0
    let stray = std::thread::spawn(move || {
        use std::io::Write;
        for msg in [&b"GET / HTTP/1.1\r\n\r\n"[..], b""] {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            loop {
                if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                    let _ = s.write_all(msg);
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "node 0 never listened"
                );
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    });
    let cases = golden_cases("smollm2-135m-instruct-f32");
    check_greedy_on(
        &smol,
        split(3, 2),
        nodes(2, port, 120),
        &cases,
        "smollm2, 2 nodes",
    );
    wait_ok(child);
    stray.join().unwrap();

    let cases = tiny_cases("gemma3");
    let port = free_port();
    let children: Vec<_> = (1..4)
        .map(|r| spawn_node(&tiny("gemma3"), split(2, 2), 4, r, port, 4))
        .collect();
    check_greedy_on(
        &tiny("gemma3"),
        split(2, 2),
        nodes(4, port, 120),
        &cases,
        "gemma3, 4 nodes",
    );
    children.into_iter().for_each(wait_ok);
}

/// A node that never comes, or comes with other settings, is a clear error on node 0 (and the
/// other node exits with an error too); a split that does not spread over the nodes is one
/// before anything is loaded.
#[test]
fn nodes_that_do_not_fit_are_clear_errors() {
    let path = tiny("mistral");
    let start = |n: NodeConfig| {
        LLM::new(EngineArgs {
            model: Some(path.clone()),
            dtype: DType::F32.into(),
            kv_budget: Some(KvBudget::Bytes(256 << 20)),
            block_size: 4,
            parallel: split(2, 2),
            nodes: n,
            ..Default::default()
        })
        .err()
        .map(|e| format!("{e:#}"))
        .expect("an error")
    };
    let e = start(nodes(2, free_port(), 1));
    assert!(e.contains("the other nodes' 2 workers and 0 came"), "{e}");
    assert!(e.contains("--node-rank 1..1"), "{e}");

    let port = free_port();
    let child = spawn_node(&path, split(2, 2), 2, 1, port, 8);
    let e = start(nodes(2, port, 120));
    assert!(e.contains("other settings than node 0's"), "{e}");
    assert!(
        e.contains("block size 8") && e.contains("block size 4"),
        "{e}"
    );
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());

    let e = start(nodes(3, free_port(), 120));
    assert!(e.contains("4 workers"), "{e}");
    assert!(e.contains("do not spread evenly over --nnodes 3"), "{e}");
}

/// What a worker reads of a weight (only the bytes of its rows and columns, from the mapped
/// file) is the whole weight cut, to the bit and in the same format: in SmolLM2's Q4_1 file,
/// Qwen2.5's Q4_K_M mix (Q4_K, Q6_K, Q5_0, Q8_0 tensors, llama-ordered Q/K rows undone), the
/// f32 safetensors directory, and a tiny Qwen3 stored in bf16 and f16 (alternate tensors).
#[test]
fn a_shard_reads_only_its_part_and_it_is_the_whole_weight_cut() {
    let half = half_copy(&tiny("qwen3"));
    use pagoda::models::Part;
    use pagoda::models::loader::WeightSource;
    let bits = |w: pagoda::models::Weight| {
        let quant = matches!(w, pagoda::models::Weight::Quant(_));
        let (t, stored) = w.into_dense().unwrap();
        let b: Vec<u32> = t.data.iter().map(|x| x.to_bits()).collect();
        (quant, stored, t.shape, b)
    };
    for path in [
        model_path(SMOL_GGUF),
        model_path(QWEN_GGUF),
        model_path(SMOL_HF),
        half.path().to_path_buf(),
    ] {
        let m = load_model(&path).unwrap();
        let c = &m.config;
        let src: &dyn WeightSource = m.weights.as_ref();
        let last = c.num_layers - 1;
        let mut names = vec!["model.embed_tokens.weight".to_string()];
        for l in [0, last] {
            for t in [
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
            ] {
                names.push(format!("model.layers.{l}.{t}.weight"));
            }
            for t in ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"] {
                names.push(format!("model.layers.{l}.{t}.weight"));
            }
        }
        let mut checked = 0;
        for name in &names {
            let Some(whole) = src.get_weight(name).unwrap() else {
                continue;
            };
            let [rows, k] = whole.shape()[..] else {
                panic!("{name}")
            };
            assert_eq!(src.shape(name).unwrap().unwrap(), vec![rows, k]);
            // a rank's heads-like runs, and columns on 256 (every block format's boundary)
            // and off it
            let parts = [
                Part::rows(vec![rows / 3..rows / 2, rows - rows / 5..rows]),
                Part::cols(k / 256 * 128..k / 256 * 256),
                Part::cols(k / 3..k / 2),
                Part {
                    rows: Some(vec![1..rows / 4, rows / 2..rows / 2 + 1]),
                    cols: Some(k / 2..k),
                },
            ];
            for p in &parts {
                let got = src.get_weight_part(name, p).unwrap().unwrap();
                assert_eq!(
                    bits(got),
                    bits(p.apply(whole.clone()).unwrap()),
                    "{path:?} {name} {p:?}"
                );
            }
            checked += 1;
        }
        assert!(checked >= 10, "{path:?}: {checked} weights");
    }
}

/// A copy of an HF directory whose f32 tensors are stored in bf16 and f16, alternately.
fn half_copy(dir: &Path) -> tempfile::TempDir {
    use safetensors::{Dtype, SafeTensors, tensor::TensorView};
    let out = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x != "safetensors") {
            std::fs::copy(&p, out.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let t = st.tensor(n).unwrap();
            assert_eq!(t.dtype(), Dtype::F32);
            let vals = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()));
            let (dt, b): (Dtype, Vec<u8>) = if i % 2 == 0 {
                (
                    Dtype::BF16,
                    vals.flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
                        .collect(),
                )
            } else {
                (
                    Dtype::F16,
                    vals.flat_map(|v| half::f16::from_f32(v).to_le_bytes())
                        .collect(),
                )
            };
            (n.clone(), dt, t.shape().to_vec(), b)
        })
        .collect();
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, dt, shape, b)| (n.clone(), TensorView::new(*dt, shape.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &out.path().join("model.safetensors")).unwrap();
    out
}

/// A node that dies between steps fails the next step with an error naming the worker, and
/// every later one at once (no step waits for it), and node 0 shuts down cleanly.
#[test]
fn a_node_that_dies_fails_the_steps_and_nothing_hangs() {
    let path = tiny("mistral");
    let port = free_port();
    let mut child = spawn_node(&path, split(2, 2), 2, 1, port, 4);
    let mut llm = LLM::new(EngineArgs {
        model: Some(path.clone()),
        dtype: DType::F32.into(),
        kv_budget: Some(KvBudget::Bytes(256 << 20)),
        block_size: 4,
        parallel: split(2, 2),
        nodes: nodes(2, port, 120),
        ..Default::default()
    })
    .unwrap();
    let params = SamplingParams {
        max_tokens: Some(4),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let prompt = || vec![(Prompt::Tokens(vec![5, 17, 33, 2, 9]), params.clone())];
    let before = llm.generate_each(prompt()).unwrap();
    assert_eq!(before[0].outputs[0].token_ids.len(), 4);
    child.kill().unwrap();
    child.wait().unwrap();
    for _ in 0..2 {
        let e = format!("{:#}", llm.generate_each(prompt()).unwrap_err());
        assert!(e.contains("on another node is gone"), "{e}");
    }
    drop(llm);
}
