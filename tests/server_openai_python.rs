//! The official `openai` and `anthropic` Python packages against `pagoda serve` (the real
//! binary) on SmolLM2 (tests/python/test_openai_client.py, test_anthropic_client.py,
//! test_openai_responses.py) and on Qwen2.5-Coder for tool calling (test_openai_tools.py,
//! test_anthropic_tools.py, test_openai_responses_tools.py) and on a tiny embedding model
//! (test_openai_embeddings.py), run with
//! pytest from a virtual environment under `$PAGODA_CACHE` (created, and the clients and
//! `pytest` installed into it, on first use). Then SIGTERM must stop the server cleanly.

mod common;

use common::{QWEN_GGUF, SMOL_GGUF, model_path};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const KEY: &str = "sk-pagoda-python-test";
const MODEL: &str = "SmolLM2-135M-Instruct";

fn cache_dir() -> PathBuf {
    std::env::var_os("PAGODA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/pagoda")
        })
}

fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(status.success(), "{cmd:?} failed: {status}");
}

/// A virtual environment with `openai`, `anthropic`, `pytest` and `jsonschema` (which validates
/// structured output independently of the engine's grammar compiler).
fn venv() -> PathBuf {
    // NOTE: the tests of this file run at once; the first makes the environment while the
    // other waits (two `python3 -m venv` into one folder fail).
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _making = MAKING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = cache_dir().join("venv-openai");
    let python = dir.join("bin/python");
    let ready = |p: &Path| {
        Command::new(p)
            .args(["-c", "import openai, anthropic, pytest, jsonschema"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !ready(&python) {
        run(Command::new("python3").args(["-m", "venv"]).arg(&dir));
        run(Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "openai>=1.40",
            "anthropic>=0.40",
            "pytest",
            "jsonschema",
        ]));
        assert!(
            ready(&python),
            "openai, anthropic, pytest and jsonschema do not import after pip install"
        );
    }
    python
}

/// Kills the server if the test fails before it is stopped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `pagoda serve` on `model` with `extra` flags and the pytest files `tests` against it,
/// then stops the server with SIGTERM, which must end it cleanly; returns the server's log.
fn serve_and_pytest(
    model: &Path,
    served_name: &str,
    extra: &[&str],
    tests: &[&str],
) -> Vec<String> {
    let python = venv();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args(["serve", "--port", "0", "--kv-cache-memory", "256MiB"])
        .args(["--served-model-name", served_name, "--api-key", KEY])
        .args(extra)
        .arg("--model")
        .arg(model)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start pagoda serve");
    let stderr = child.stderr.take().unwrap();
    let mut server = Server(child);

    // Pass the log through, and pick the address from the "serving ... on http://ADDR/v1" line.
    let (tx, rx) = mpsc::channel();
    let log = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[server] {line}");
            if let Some(rest) = line.split("on http://").nth(1)
                && let Some(addr) = rest.split("/v1").next()
            {
                let _ = tx.send(addr.to_string());
            }
            lines.push(line);
        }
        lines
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the server did not start listening");

    let out = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .args(tests.iter().map(|t| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/python")
                .join(t)
        }))
        .env("PAGODA_BASE_URL", format!("http://{addr}/v1"))
        .env("PAGODA_API_KEY", KEY)
        .env("PAGODA_MODEL", served_name)
        .output()
        .expect("run pytest");
    let report = String::from_utf8_lossy(&out.stdout);
    eprintln!("{report}{}", String::from_utf8_lossy(&out.stderr));
    // NOTE: exit code 5 is pytest's "no tests collected": a failure here too.
    assert!(out.status.success(), "pytest failed: {}", out.status);
    assert!(report.contains(" passed"), "pytest ran no test");

    // SIGTERM: a clean exit.
    run(Command::new("kill").args(["-TERM", &server.0.id().to_string()]));
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = server.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the server did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "pagoda serve exited with {status}");
    let lines = log.join().unwrap();
    assert!(lines.iter().any(|l| l.contains("server stopped")));
    lines
}

#[test]
fn openai_python_client() {
    let lines = serve_and_pytest(
        &model_path(SMOL_GGUF),
        MODEL,
        &[],
        &[
            "test_openai_client.py",
            "test_anthropic_client.py",
            "test_openai_responses.py",
        ],
    );
    // One log line per request.
    assert!(
        lines
            .iter()
            .filter(|l| l.contains("request cmpl-") && l.contains("time to first token"))
            .count()
            >= 5
    );
}

/// `client.embeddings` on a tiny embedding model (`--task embed`).
#[test]
fn openai_python_client_embeddings() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny/pooling/embed-last");
    serve_and_pytest(
        &model,
        "embed-last",
        &["--task", "embed", "--dtype", "f32"],
        &["test_openai_embeddings.py"],
    );
}

/// Tool calling with the official clients on Qwen2.5-Coder (its template renders tools).
#[test]
fn openai_python_client_tools() {
    serve_and_pytest(
        &model_path(QWEN_GGUF),
        "Qwen2.5-Coder-0.5B-Instruct",
        &["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        &[
            "test_openai_tools.py",
            "test_anthropic_tools.py",
            "test_openai_responses_tools.py",
        ],
    );
}
