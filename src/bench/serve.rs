//! A load generator for any OpenAI-compatible server (Pagoda's `serve`, llama.cpp's
//! `llama-server`, llama-cpp-python, vLLM): streaming `/v1/completions` requests sent at a
//! Poisson rate or all at once, optionally under a concurrency limit. Per request it records
//! the time to the first token (TTFT), the gaps between tokens (ITL), the time per output token
//! after the first (TPOT) and the end-to-end latency.
//!
//! A token is a stream chunk whose first choice has non-empty text (servers send one token per
//! chunk). The output token count is the server's `usage.completion_tokens` when it reports it
//! (`stream_options.include_usage`); else `max_tokens` when the request finished for its length;
//! else the number of such chunks.
//!
//! To make every server produce the workload's output lengths, requests carry `ignore_eos: true`
//! (vLLM, Pagoda) and `min_tokens` = `max_tokens` (llama-cpp-python, vLLM); servers ignore the
//! field they do not know.

use super::stats::Summary;
use super::workload::{RequestLens, SharedPrefixes, poisson_arrivals, request_text};
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// Figures of one load run against one server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServeResult {
    /// The row's name in reports (`--label`, e.g. `pagoda-cpu`, `llama-server`).
    pub backend: String,
    pub base_url: String,
    pub model: String,
    pub num_requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// Requests never sent or cut off because the run was interrupted.
    pub cancelled: usize,
    pub duration_s: f64,
    /// Requests per second asked for; `None`: all at once.
    pub request_rate: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub total_tokens_per_s: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub ttft_ms: Summary,
    pub tpot_ms: Summary,
    pub itl_ms: Summary,
    pub e2e_ms: Summary,
    /// The first few distinct error messages.
    pub errors: Vec<String>,
    pub interrupted: bool,
}

pub struct ServeOptions<'a> {
    pub base_url: String,
    /// Path of the completions endpoint.
    pub endpoint: String,
    pub model: String,
    /// LoRA adapters named in turn as the model of each request (none: `model` for all).
    pub loras: Vec<String>,
    pub label: String,
    pub request_rate: f64,
    pub max_concurrency: Option<usize>,
    pub ignore_eos: bool,
    /// Requests sent one by one before the measured run, not counted (first-request costs such
    /// as kernel compilation or page faults stay out of the figures).
    pub warmup: usize,
    pub timeout: Duration,
    pub seed: u64,
    /// The prefix workload's shared prompts.
    pub prefixes: Option<SharedPrefixes>,
    pub stop: &'a AtomicBool,
    pub progress: bool,
}

/// Splits a byte stream into SSE `data:` payloads (events end with a blank line; `\r\n` and
/// `\n` line ends both accepted).
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let end = find_event_end(&self.buf);
            let Some((at, sep)) = end else { break };
            let event: Vec<u8> = self.buf.drain(..at + sep).collect();
            let text = String::from_utf8_lossy(&event[..at]);
            let mut data = Vec::new();
            for line in text.lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
                }
            }
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// Position and length of the first blank-line separator.
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    (0..b.len()).find_map(|i| {
        if b[i..].starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else if b[i..].starts_with(b"\n\n") {
            Some((i, 2))
        } else {
            None
        }
    })
}

/// What happened to one request; times in seconds from its sending.
#[derive(Debug, Default)]
struct Outcome {
    error: Option<String>,
    ttft: Option<f64>,
    itl: Vec<f64>,
    e2e: f64,
    chunks: usize,
    usage_prompt: Option<usize>,
    usage_completion: Option<usize>,
    finish_reason: Option<String>,
}

async fn one_request(client: &reqwest::Client, url: &str, body: &Value) -> Outcome {
    let t0 = Instant::now();
    let mut o = Outcome::default();
    let mut resp = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => {
            o.error = Some(format!("request failed: {e}"));
            return o;
        }
    };
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        o.error = Some(format!(
            "HTTP {status}: {}",
            text.chars().take(200).collect::<String>()
        ));
        return o;
    }
    let mut sse = SseParser::default();
    let mut last = None;
    let mut done = false;
    while !done {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                o.error = Some(format!("stream broke: {e}"));
                break;
            }
        };
        let now = t0.elapsed().as_secs_f64();
        for data in sse.push(&chunk) {
            if data.trim() == "[DONE]" {
                done = true;
                break;
            }
            let v: Value = match serde_json::from_str(&data) {
                Ok(v) => v,
                Err(e) => {
                    o.error = Some(format!("bad stream chunk ({e}): {data:.120}"));
                    continue;
                }
            };
            if let Some(err) = v.get("error") {
                o.error = Some(format!("server error: {err}"));
                continue;
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                let get = |k: &str| u.get(k).and_then(Value::as_u64).map(|x| x as usize);
                o.usage_prompt = get("prompt_tokens").or(o.usage_prompt);
                o.usage_completion = get("completion_tokens").or(o.usage_completion);
            }
            if let Some(f) = v
                .pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
            {
                o.finish_reason = Some(f.to_string());
            }
            let text = v
                .pointer("/choices/0/text")
                .or_else(|| v.pointer("/choices/0/delta/content"))
                .and_then(Value::as_str)
                .unwrap_or("");
            if text.is_empty() {
                continue;
            }
            o.chunks += 1;
            match last {
                None => o.ttft = Some(now),
                Some(prev) => o.itl.push(now - prev),
            }
            last = Some(now);
        }
    }
    o.e2e = t0.elapsed().as_secs_f64();
    if o.error.is_none() && o.ttft.is_none() {
        o.error = Some("the stream ended without a token".into());
    }
    // NOTE: a server may cut a stream short, even with a `[DONE]` (llama-cpp-python does when
    // another request arrives, unless started with --interrupt_requests False): a request
    // completed only if its stream gave a finish reason.
    if o.error.is_none() && o.finish_reason.is_none() {
        o.error = Some(if done {
            "the stream ended ([DONE]) without a finish reason".into()
        } else {
            "the stream ended without a finish reason".into()
        });
    }
    o
}

/// Asks the server which model it serves (`GET /v1/models`, the first id).
pub async fn discover_model(client: &reqwest::Client, base_url: &str) -> Result<String> {
    let url = format!("{}/v1/models", base_url.trim_end_matches('/'));
    let v: Value = client
        .get(&url)
        .send()
        .await
        .with_context(|| format!("cannot reach {url}"))?
        .error_for_status()?
        .json()
        .await
        .with_context(|| format!("{url} did not answer JSON"))?;
    v.pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(String::from)
        .with_context(|| format!("{url} lists no model: pass --model"))
}

/// A client that talks to the server directly (no proxy from the environment).
pub fn client() -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder().no_proxy().build()?)
}

/// Runs the load against the server (blocking: it makes its own runtime).
/// One streaming completion request: greedy, the workload's prompt and output lengths.
fn request_body(opts: &ServeOptions, i: usize, r: &RequestLens) -> Value {
    let model = match opts.loras.len() {
        0 => &opts.model,
        n => &opts.loras[i % n],
    };
    let mut body = json!({
        "model": model,
        "prompt": request_text(opts.prefixes, opts.seed, i, r.prompt_len),
        "max_tokens": r.output_len,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if opts.ignore_eos {
        body["ignore_eos"] = json!(true);
        body["min_tokens"] = json!(r.output_len);
    }
    body
}

pub fn run(reqs: &[RequestLens], opts: &ServeOptions) -> Result<ServeResult> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run_async(reqs, opts))
}

pub async fn run_async(reqs: &[RequestLens], opts: &ServeOptions<'_>) -> Result<ServeResult> {
    let client = client()?;
    let url = format!(
        "{}/{}",
        opts.base_url.trim_end_matches('/'),
        opts.endpoint.trim_start_matches('/')
    );
    // NOTE: warm-up requests reuse the workload's first prompts with a different index, so a
    // server with prefix caching gets no head start on the measured requests.
    if let Some(first) = reqs.first() {
        for w in 0..opts.warmup {
            let o = one_request(&client, &url, &request_body(opts, reqs.len() + w, first)).await;
            if let Some(e) = o.error {
                bail!("the warm-up request failed: {e}");
            }
        }
    }
    let arrivals = poisson_arrivals(reqs.len(), opts.request_rate, opts.seed);
    let sem = Arc::new(Semaphore::new(
        opts.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let bar = super::progress_bar(opts.progress, reqs.len() as u64, "requests");
    let tick = Duration::from_millis(50);
    let stopped = || opts.stop.load(Ordering::Relaxed);

    let start = Instant::now();
    let mut set: JoinSet<(usize, Outcome)> = JoinSet::new();
    let mut outcomes: Vec<(usize, Outcome)> = Vec::new();
    let mut last_end = 0.0f64;
    let mut collect = |res: Result<(usize, Outcome), tokio::task::JoinError>,
                       outcomes: &mut Vec<(usize, Outcome)>| {
        if let Ok(r) = res {
            last_end = last_end.max(start.elapsed().as_secs_f64());
            bar.inc(1);
            outcomes.push(r);
        }
    };
    let mut interrupted = false;
    'dispatch: for (i, r) in reqs.iter().enumerate() {
        let due = start + Duration::from_secs_f64(arrivals[i]);
        let permit = loop {
            while let Some(res) = set.try_join_next() {
                collect(res, &mut outcomes);
            }
            if stopped() {
                interrupted = true;
                break 'dispatch;
            }
            let now = Instant::now();
            if now < due {
                tokio::time::sleep((due - now).min(tick)).await;
                continue;
            }
            tokio::select! {
                p = sem.clone().acquire_owned() => break p?,
                Some(res) = set.join_next() => collect(res, &mut outcomes),
                _ = tokio::time::sleep(tick) => {}
            }
        };
        let body = request_body(opts, i, r);
        let (client, url, timeout) = (client.clone(), url.clone(), opts.timeout);
        set.spawn(async move {
            let _permit = permit;
            let o = match tokio::time::timeout(timeout, one_request(&client, &url, &body)).await {
                Ok(o) => o,
                Err(_) => Outcome {
                    error: Some(format!("timed out after {} s", timeout.as_secs_f64())),
                    ..Default::default()
                },
            };
            (i, o)
        });
    }
    while !set.is_empty() {
        if stopped() {
            interrupted = true;
            set.abort_all();
            while let Some(res) = set.join_next().await {
                collect(res, &mut outcomes);
            }
            break;
        }
        tokio::select! {
            Some(res) = set.join_next() => collect(res, &mut outcomes),
            _ = tokio::time::sleep(tick) => {}
        }
    }
    bar.finish_and_clear();
    let duration = if last_end > 0.0 {
        last_end
    } else {
        start.elapsed().as_secs_f64()
    };
    Ok(summarise(reqs, opts, outcomes, duration, interrupted))
}

fn summarise(
    reqs: &[RequestLens],
    opts: &ServeOptions,
    outcomes: Vec<(usize, Outcome)>,
    duration: f64,
    interrupted: bool,
) -> ServeResult {
    let (mut ttft, mut tpot, mut itl, mut e2e) = (vec![], vec![], vec![], vec![]);
    let (mut completed, mut failed, mut prompt_tokens, mut output_tokens) = (0, 0, 0, 0);
    let mut errors: Vec<String> = Vec::new();
    for (i, o) in &outcomes {
        if let Some(e) = &o.error {
            failed += 1;
            if errors.len() < 10 && !errors.contains(e) {
                errors.push(e.clone());
            }
            continue;
        }
        completed += 1;
        let n = match (o.usage_completion, o.finish_reason.as_deref()) {
            (Some(n), _) => n,
            (None, Some("length")) => reqs[*i].output_len.max(o.chunks),
            (None, _) => o.chunks,
        };
        output_tokens += n;
        prompt_tokens += o.usage_prompt.unwrap_or(reqs[*i].prompt_len);
        let first = o.ttft.unwrap_or(o.e2e);
        ttft.push(first);
        e2e.push(o.e2e);
        itl.extend_from_slice(&o.itl);
        if n > 1 {
            tpot.push((o.e2e - first) / (n - 1) as f64);
        }
    }
    let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
    ServeResult {
        backend: opts.label.clone(),
        base_url: opts.base_url.clone(),
        model: opts.model.clone(),
        num_requests: reqs.len(),
        completed,
        failed,
        cancelled: reqs.len() - completed - failed,
        duration_s: duration,
        request_rate: opts.request_rate.is_finite().then_some(opts.request_rate),
        max_concurrency: opts.max_concurrency,
        requests_per_s: per_s(completed as f64),
        output_tokens_per_s: per_s(output_tokens as f64),
        total_tokens_per_s: per_s((prompt_tokens + output_tokens) as f64),
        prompt_tokens,
        output_tokens,
        ttft_ms: Summary::of(&ttft).scaled(1e3),
        tpot_ms: Summary::of(&tpot).scaled(1e3),
        itl_ms: Summary::of(&itl).scaled(1e3),
        e2e_ms: Summary::of(&e2e).scaled(1e3),
        errors,
        interrupted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    #[test]
    fn sse_events_split_across_chunks_and_line_ends() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b":1}\n\ndata: [DO"), vec!["{\"a\":1}"]);
        assert_eq!(p.push(b"NE]\r\n\r\n: comment\n\n"), vec!["[DONE]"]);
        assert_eq!(p.push(b"event: x\ndata:y\n\n"), vec!["y"]);
    }

    /// A bounded loopback server speaking just enough HTTP/1.1 and SSE: each completion streams
    /// `max_tokens` tokens in chunks 2 ms apart, then usage (even lengths) or a finish reason
    /// (odd ones), then `[DONE]`; prompts that start with "fail" get HTTP 500. It serves `n`
    /// connections and stops.
    async fn fake_server(n: usize) -> (String, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handle = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            for _ in 0..n {
                let Ok((mut sock, _)) = listener.accept().await else {
                    break;
                };
                conns.spawn(async move {
                    let mut buf = Vec::new();
                    let mut tmp = [0u8; 4096];
                    let (head_end, body_len) = loop {
                        let k = sock.read(&mut tmp).await.unwrap();
                        assert!(k > 0, "client closed early");
                        buf.extend_from_slice(&tmp[..k]);
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
                            let len = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .map(|v| v.trim().parse::<usize>().unwrap())
                                .unwrap_or(0);
                            break (i + 4, len);
                        }
                    };
                    while buf.len() < head_end + body_len {
                        let k = sock.read(&mut tmp).await.unwrap();
                        buf.extend_from_slice(&tmp[..k]);
                    }
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
                    if head.starts_with("GET /v1/models") {
                        let body = r#"{"object":"list","data":[{"id":"fake-model"}]}"#;
                        let resp = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        sock.write_all(resp.as_bytes()).await.unwrap();
                        return;
                    }
                    let req: Value = serde_json::from_slice(&buf[head_end..]).unwrap();
                    assert_eq!(req["stream"], true);
                    assert_eq!(req["min_tokens"], req["max_tokens"]);
                    assert_eq!(req["model"], "fake-model");
                    if req["prompt"].as_str().unwrap().starts_with("fail") {
                        sock.write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\nconnection: close\r\n\r\noops")
                            .await
                            .unwrap();
                        return;
                    }
                    sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
                        .await
                        .unwrap();
                    if req["prompt"].as_str().unwrap().starts_with("cut") {
                        // cut short, as llama-cpp-python does to a stream when another arrives
                        sock.write_all(b"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\ndata: [DONE]\n\n")
                            .await
                            .unwrap();
                        return;
                    }
                    let k = req["max_tokens"].as_u64().unwrap();
                    // k tokens in k - 1 chunks: the last chunk holds two (as a server that
                    // held back text sends them); usage tells the truth, or the finish reason
                    for j in 0..k - 1 {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        let text = if j == k - 2 { "aa" } else { "a" };
                        let chunk = format!(
                            "data: {{\"choices\":[{{\"index\":0,\"text\":\"{text}\"}}]}}\n\n"
                        );
                        sock.write_all(chunk.as_bytes()).await.unwrap();
                    }
                    let usage = if k % 2 == 1 {
                        "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n".to_string()
                    } else {
                        format!(
                            "data: {{\"choices\":[{{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}}]}}\n\n\
                             data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":7,\"completion_tokens\":{k}}}}}\n\ndata: [DONE]\n\n"
                        )
                    };
                    sock.write_all(usage.as_bytes()).await.unwrap();
                });
            }
            while conns.join_next().await.is_some() {}
        });
        (format!("http://{addr}"), handle)
    }

    fn opts<'a>(base_url: String, stop: &'a AtomicBool) -> ServeOptions<'a> {
        ServeOptions {
            base_url,
            endpoint: "/v1/completions".into(),
            model: "fake-model".into(),
            loras: Vec::new(),
            label: "fake".into(),
            request_rate: f64::INFINITY,
            max_concurrency: Some(3),
            warmup: 0,
            ignore_eos: true,
            timeout: Duration::from_secs(20),
            seed: 1,
            prefixes: None,
            stop,
            progress: false,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn measures_a_streaming_server() {
        let (url, server) = fake_server(9).await;
        let client = client().unwrap();
        assert_eq!(discover_model(&client, &url).await.unwrap(), "fake-model");
        let reqs: Vec<RequestLens> = (0..8)
            .map(|i| RequestLens {
                prompt_len: 5,
                output_len: 3 + i,
            })
            .collect();
        let stop = AtomicBool::new(false);
        let mut o = opts(url, &stop);
        o.request_rate = 200.0;
        let r = run_async(&reqs, &o).await.unwrap();
        server.await.unwrap();
        assert_eq!((r.completed, r.failed, r.cancelled), (8, 0, 0));
        assert_eq!(r.output_tokens, (3..11).sum::<usize>());
        // usage from the stream where the server sends it, else the workload's prompt length
        // (the fake server leaves usage out for odd lengths: 3, 5, 7, 9)
        assert_eq!(r.prompt_tokens, 4 * 7 + 4 * 5);
        assert_eq!(r.ttft_ms.count, 8);
        // one gap fewer than chunks each; 2 ms between chunks, so the longest request (10
        // chunks) ends at least 18 ms after it was sent. NOTE: not every gap is 2 ms: on a
        // loaded machine two chunks can arrive in one read.
        assert_eq!(r.itl_ms.count, (1..9).sum::<usize>());
        assert!(
            r.itl_ms.min >= 0.0 && r.tpot_ms.min >= 0.0,
            "{:?}",
            r.itl_ms
        );
        assert!(
            r.e2e_ms.max >= 18.0 && r.e2e_ms.max >= r.ttft_ms.max,
            "{:?}",
            r.e2e_ms
        );
        assert!(r.output_tokens_per_s > 0.0 && r.duration_s > 0.0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn warm_up_requests_are_sent_first_and_not_counted() {
        // 2 warm-up connections and 3 measured ones: the server stops after 5, so a sixth
        // request (a warm-up counted twice) would fail to connect
        let (url, server) = fake_server(5).await;
        let stop = AtomicBool::new(false);
        let mut o = opts(url, &stop);
        o.warmup = 2;
        let reqs = vec![
            RequestLens {
                prompt_len: 4,
                output_len: 5,
            };
            3
        ];
        let r = run_async(&reqs, &o).await.unwrap();
        server.await.unwrap();
        assert_eq!((r.completed, r.failed, r.cancelled), (3, 0, 0));
        assert_eq!(r.output_tokens, 15);
        assert_eq!(r.ttft_ms.count, 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn counts_failures_and_unreachable_servers() {
        let (url, server) = fake_server(2).await;
        let stop = AtomicBool::new(false);
        // the fake server answers 500 to a prompt starting with "fail"
        let client = client().unwrap();
        let body = json!({"model": "fake-model", "prompt": "fail now", "max_tokens": 2, "min_tokens": 2, "stream": true});
        let o = one_request(&client, &format!("{url}/v1/completions"), &body).await;
        assert!(o.error.as_deref().unwrap().contains("500"), "{o:?}");
        let body = json!({"model": "fake-model", "prompt": "cut short", "max_tokens": 2, "min_tokens": 2, "stream": true});
        let o = one_request(&client, &format!("{url}/v1/completions"), &body).await;
        assert!(
            o.error
                .as_deref()
                .unwrap()
                .contains("without a finish reason"),
            "{o:?}"
        );
        server.await.unwrap();
        // nothing listens there any more
        let reqs = [RequestLens {
            prompt_len: 3,
            output_len: 2,
        }];
        let r = run_async(&reqs, &opts(url, &stop)).await.unwrap();
        assert_eq!((r.completed, r.failed), (0, 1));
        assert_eq!(r.errors.len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_interrupt_keeps_what_was_measured() {
        let stop = AtomicBool::new(true);
        let reqs = [RequestLens {
            prompt_len: 3,
            output_len: 2,
        }];
        let r = run_async(&reqs, &opts("http://127.0.0.1:9".into(), &stop))
            .await
            .unwrap();
        assert!(r.interrupted);
        assert_eq!((r.completed, r.failed, r.cancelled), (0, 0, 1));
    }
}
