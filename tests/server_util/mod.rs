//! For the server tests: a small blocking HTTP/1.1 client over `std::net` (so a test can drop a
//! connection halfway, and reads nothing it did not ask for), Server-Sent Events parsing, and
//! starting a server on the real SmolLM2 model on an ephemeral loopback port.
#![allow(dead_code)]

use pagoda::engine::KvBudget;
use pagoda::server::{ServerArgs, ServerHandle};
use pagoda::{DType, Engine, EngineArgs};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Every socket read gives up after this long, so no test can hang on a silent server.
pub const READ_TIMEOUT: Duration = Duration::from_secs(300);

pub fn engine_args(model: PathBuf, kv_mib: u64) -> EngineArgs {
    EngineArgs {
        model: Some(model),
        kv_budget: Some(KvBudget::Bytes(kv_mib << 20)),
        // NOTE: some tests expect what the f32 model says (a short answer that stops, Paris);
        // the quantized weights are tested in tests/quantized.rs and tests/batching.rs.
        dtype: DType::F32.into(),
        ..EngineArgs::default()
    }
}

pub fn start(model: PathBuf, kv_mib: u64, args: ServerArgs) -> ServerHandle {
    let engine = Engine::new(engine_args(model, kv_mib)).expect("the engine loads");
    pagoda::server::start(
        engine,
        ServerArgs {
            host: "127.0.0.1".into(),
            port: 0,
            ..args
        },
    )
    .expect("the server starts")
}

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }
}

/// Sends a request (`Connection: close`) and returns the stream positioned at the body.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, Vec<(String, String)>, BufReader<TcpStream>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).expect("write head");
    if let Some(b) = body {
        s.write_all(b).expect("write body");
    }
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).expect("header line");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers, r)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked")
    })
}

/// The body of an HTTP/1.1 response, undoing chunked transfer encoding.
pub struct BodyReader {
    inner: BufReader<TcpStream>,
    chunked: bool,
    /// Bytes left in the current chunk; `None`: read the next chunk's size line.
    left: Option<usize>,
    eof: bool,
}

impl BodyReader {
    pub fn new(inner: BufReader<TcpStream>, headers: &[(String, String)]) -> Self {
        BodyReader {
            inner,
            chunked: is_chunked(headers),
            left: None,
            eof: false,
        }
    }
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if !self.chunked {
            return self.inner.read(buf);
        }
        loop {
            if self.eof || buf.is_empty() {
                return Ok(0);
            }
            match self.left {
                Some(0) => {
                    let mut crlf = String::new();
                    self.inner.read_line(&mut crlf)?;
                    self.left = None;
                }
                Some(n) => {
                    let k = n.min(buf.len());
                    let got = self.inner.read(&mut buf[..k])?;
                    if got == 0 {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "connection closed inside a chunk",
                        ));
                    }
                    self.left = Some(n - got);
                    return Ok(got);
                }
                None => {
                    let mut size = String::new();
                    if self.inner.read_line(&mut size)? == 0 {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "connection closed before the last chunk",
                        ));
                    }
                    let hex = size.trim().split(';').next().unwrap_or("");
                    let n = usize::from_str_radix(hex, 16).map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, "bad chunk size")
                    })?;
                    if n == 0 {
                        self.eof = true;
                    } else {
                        self.left = Some(n);
                    }
                }
            }
        }
    }
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> HttpResponse {
    let (status, headers, r) = send(addr, method, path, headers, body);
    let mut body = Vec::new();
    BodyReader::new(r, &headers)
        .read_to_end(&mut body)
        .expect("read body");
    HttpResponse {
        status,
        headers,
        body,
    }
}

/// Server-Sent Events of a streamed response.
pub struct Sse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<BodyReader>,
}

impl Sse {
    pub fn open(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> Sse {
        let bytes = serde_json::to_vec(body).unwrap();
        let (status, h, r) = send(addr, "POST", path, headers, Some(&bytes));
        let reader = BufReader::new(BodyReader::new(r, &h));
        Sse {
            status,
            headers: h,
            reader,
        }
    }

    /// The data of the next event; `None` at the end of the body. Panics on anything that is
    /// not `data: ...` lines separated by blank lines.
    pub fn next_data(&mut self) -> Option<String> {
        let mut data: Option<String> = None;
        loop {
            let mut line = String::new();
            let n = self.reader.read_line(&mut line).expect("read event");
            if n == 0 {
                assert!(data.is_none(), "the body ended inside an event");
                return None;
            }
            let l = line.strip_suffix('\n').unwrap_or(&line);
            if l.is_empty() {
                if data.is_some() {
                    return data;
                }
                continue;
            }
            let d = l
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an SSE data line: {l:?}"));
            assert!(data.is_none(), "one data line per event expected");
            data = Some(d.to_string());
        }
    }

    /// Every event up to the end of the body.
    pub fn all(mut self) -> Vec<String> {
        let mut v = Vec::new();
        while let Some(d) = self.next_data() {
            v.push(d);
        }
        v
    }
}

/// Checks that `events` is a well-formed OpenAI stream — JSON chunks of one id and `object`, one
/// `finish_reason` per choice in its last chunk, an optional usage chunk, then `[DONE]` — and
/// returns (text per choice index, finish reason per index, usage if sent).
pub fn check_stream(events: &[String], chat: bool) -> (Vec<String>, Vec<String>, Option<Value>) {
    assert!(!events.is_empty(), "empty stream");
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let mut id: Option<String> = None;
    let mut texts: Vec<String> = Vec::new();
    let mut finish: Vec<Option<String>> = Vec::new();
    // Per choice: whether a chunk of it was seen (its first chat delta carries the role).
    let mut seen: Vec<bool> = Vec::new();
    let mut usage = None;
    for (i, e) in events[..events.len() - 1].iter().enumerate() {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|_| panic!("chunk {i}: {e}"));
        assert!(v.get("error").is_none(), "error chunk: {e}");
        assert_eq!(v["object"], object, "{e}");
        let this_id = v["id"].as_str().expect("id").to_string();
        assert_eq!(id.get_or_insert(this_id.clone()), &this_id);
        assert!(usage.is_none(), "a chunk after the usage chunk: {e}");
        let choices = v["choices"].as_array().expect("choices");
        if choices.is_empty() {
            assert!(v["usage"].is_object(), "no choices and no usage: {e}");
            usage = Some(v["usage"].clone());
            continue;
        }
        for c in choices {
            let idx = c["index"].as_u64().expect("index") as usize;
            if texts.len() <= idx {
                texts.resize(idx + 1, String::new());
                finish.resize(idx + 1, None);
                seen.resize(idx + 1, false);
            }
            let first = !std::mem::replace(&mut seen[idx], true);
            assert!(finish[idx].is_none(), "a chunk after finish_reason: {e}");
            if chat {
                let d = &c["delta"];
                if first {
                    assert_eq!(d["role"], "assistant", "role in the first delta: {e}");
                } else {
                    assert!(d.get("role").is_none(), "role only in the first delta: {e}");
                }
                if let Some(t) = d["content"].as_str() {
                    texts[idx].push_str(t);
                }
            } else {
                texts[idx].push_str(c["text"].as_str().expect("text"));
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish[idx] = Some(f.to_string());
            }
        }
    }
    let finish = finish
        .into_iter()
        .map(|f| f.expect("every choice ends with a finish_reason"))
        .collect();
    (texts, finish, usage)
}

pub fn post_json(addr: SocketAddr, path: &str, key: Option<&str>, body: &Value) -> HttpResponse {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("Authorization", a)])
        .unwrap_or_default();
    request(
        addr,
        "POST",
        path,
        &headers,
        Some(&serde_json::to_vec(body).unwrap()),
    )
}

pub fn get(addr: SocketAddr, path: &str, key: Option<&str>) -> HttpResponse {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("Authorization", a)])
        .unwrap_or_default();
    request(addr, "GET", path, &headers, None)
}

/// The value of an unlabelled-but-for-`model_name` metric (first sample whose name matches
/// and whose labels contain `label`).
pub fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.starts_with(name)
                && l[name.len()..].starts_with('{')
                && l.split('}').next().is_some_and(|ls| ls.contains(label))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name}{{{label}}} missing from:\n{text}"))
}

/// Polls `/metrics` until nothing runs, nothing waits and no KV block is in use.
pub fn wait_idle(addr: SocketAddr, within: Duration) -> String {
    let t0 = Instant::now();
    loop {
        let m = get(addr, "/metrics", None).text();
        let busy = metric(&m, "pagoda:num_requests_running", "")
            + metric(&m, "pagoda:num_requests_waiting", "")
            + metric(&m, "pagoda:kv_cache_blocks_used", "");
        if busy == 0.0 {
            return m;
        }
        assert!(
            t0.elapsed() < within,
            "the server is not idle after {within:?}:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
