//! Models by hub name (`--model ORG/NAME[:QUANT]`) against a local server that speaks the
//! hub's API (`/api/models/{repo}/revision/{rev}`, `/{repo}/resolve/{rev}/{file}` with ranges,
//! `etag` and `x-repo-commit`), reached through `HF_ENDPOINT`: the real client code path, no
//! network. Then offline, from the cache it filled.

use pagoda::hub::{HubEnv, is_hub_name, resolve};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// The repositories: name -> (commit, files).
type Repos = HashMap<String, (String, Vec<(String, Vec<u8>)>)>;

struct Hub {
    url: String,
    requests: Arc<AtomicUsize>,
}

fn tiny_qwen3() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny/qwen3")
}

fn repos() -> Repos {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(tiny_qwen3())
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.push(("README.md".into(), b"# tiny qwen3\n".to_vec()));
    let gguf = vec![
        ("m-Q4_K_M.gguf".to_string(), b"GGUF q4_k_m bytes".to_vec()),
        (
            "m-Q8_0.gguf".to_string(),
            b"GGUF q8_0 bytes, longer".to_vec(),
        ),
        ("README.md".to_string(), b"# m\n".to_vec()),
    ];
    HashMap::from([
        ("tiny/qwen3".to_string(), ("a".repeat(40), files)),
        ("tiny/m-GGUF".to_string(), ("b".repeat(40), gguf)),
    ])
}

/// One hub for the whole test binary.
fn hub() -> &'static Hub {
    static HUB: OnceLock<Hub> = OnceLock::new();
    HUB.get_or_init(|| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(AtomicUsize::new(0));
        let count = requests.clone();
        let repos = repos();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                count.fetch_add(1, Ordering::SeqCst);
                serve(conn, &repos);
            }
        });
        Hub { url, requests }
    })
}

fn serve(mut conn: std::net::TcpStream, repos: &Repos) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut range_start = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("range: bytes=") {
            range_start = v
                .trim()
                .split('-')
                .next()
                .and_then(|s| s.parse::<usize>().ok());
            if v.trim() == "0-0" {
                range_start = Some(usize::MAX);
            }
        }
    }
    let reply = |conn: &mut std::net::TcpStream,
                 status: &str,
                 headers: &[(String, String)],
                 body: &[u8]| {
        let mut head = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = conn.write_all(head.as_bytes());
        let _ = conn.write_all(body);
    };
    // GET /api/models/{org}/{name}/revision/{rev}
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let repo = rest.split("/revision/").next().unwrap_or("");
        match repos.get(repo) {
            Some((sha, files)) => {
                let siblings: Vec<_> = files
                    .iter()
                    .map(|(n, _)| serde_json::json!({"rfilename": n}))
                    .collect();
                let body = serde_json::json!({"id": repo, "sha": sha, "siblings": siblings});
                let ct = [("Content-Type".to_string(), "application/json".to_string())];
                reply(&mut conn, "200 OK", &ct, body.to_string().as_bytes());
            }
            None => reply(
                &mut conn,
                "404 Not Found",
                &[],
                b"{\"error\": \"Repository not found\"}",
            ),
        }
        return;
    }
    // GET /{org}/{name}/resolve/{rev}/{file}
    let found = path.split_once("/resolve/").and_then(|(repo, rest)| {
        let (sha, files) = repos.get(repo.trim_start_matches('/'))?;
        let file = rest.split_once('/')?.1;
        let (_, bytes) = files.iter().find(|(n, _)| n == file)?;
        Some((sha, bytes))
    });
    let Some((sha, bytes)) = found else {
        reply(&mut conn, "404 Not Found", &[], b"Entry not found");
        return;
    };
    let etag = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut h);
        format!("\"{:016x}\"", h.finish())
    };
    let (start, end) = match range_start {
        Some(usize::MAX) => (0, 0),
        Some(s) => (s, bytes.len() - 1),
        None => (0, bytes.len() - 1),
    };
    let headers = [
        ("ETag".to_string(), etag),
        ("X-Repo-Commit".to_string(), sha.clone()),
        (
            "Content-Range".to_string(),
            format!("bytes {start}-{end}/{}", bytes.len()),
        ),
    ];
    reply(
        &mut conn,
        "206 Partial Content",
        &headers,
        &bytes[start..=end],
    );
}

fn env(cache: &Path, offline: bool) -> HubEnv {
    HubEnv {
        cache: cache.to_path_buf(),
        endpoint: if offline {
            "http://127.0.0.1:9".into()
        } else {
            hub().url.clone()
        },
        token: None,
        offline,
        progress: false,
    }
}

#[test]
fn an_hf_repository_is_downloaded_then_read_from_the_cache() {
    let cache = tempfile::tempdir().unwrap();
    let dir = resolve(&env(cache.path(), false), "tiny/qwen3", None, None).unwrap();
    // Python's layout: models--ORG--NAME/snapshots/COMMIT, refs/main naming the commit.
    let repo = cache.path().join("models--tiny--qwen3");
    assert_eq!(dir, repo.join("snapshots").join("a".repeat(40)));
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main")).unwrap(),
        "a".repeat(40)
    );
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert_eq!(
            std::fs::read(dir.join(f)).unwrap(),
            std::fs::read(tiny_qwen3().join(f)).unwrap(),
            "{f}"
        );
    }
    assert!(
        !dir.join("README.md").exists(),
        "only what the model needs is fetched"
    );
    let model = pagoda::models::load_model(&dir).unwrap();
    assert_eq!(
        model.config.num_layers,
        pagoda::models::load_model(&tiny_qwen3())
            .unwrap()
            .config
            .num_layers
    );

    // Again: from the cache, without a request.
    let before = hub().requests.load(Ordering::SeqCst);
    assert_eq!(
        resolve(&env(cache.path(), false), "tiny/qwen3", None, None).unwrap(),
        dir
    );
    assert_eq!(hub().requests.load(Ordering::SeqCst), before);
    // Offline, from the cache.
    assert_eq!(
        resolve(&env(cache.path(), true), "tiny/qwen3", None, None).unwrap(),
        dir
    );
}

#[test]
fn a_gguf_repository_gives_the_file_for_the_quant() {
    let cache = tempfile::tempdir().unwrap();
    let e = env(cache.path(), false);
    let q8 = resolve(&e, "tiny/m-GGUF:Q8_0", None, None).unwrap();
    assert_eq!(std::fs::read(&q8).unwrap(), b"GGUF q8_0 bytes, longer");
    assert_eq!(q8.file_name().unwrap(), "m-Q8_0.gguf");
    // No quant: Q4_K_M, as llama.cpp's -hf; --gguf-file names one outright.
    let default = resolve(&e, "tiny/m-GGUF", None, None).unwrap();
    assert_eq!(std::fs::read(&default).unwrap(), b"GGUF q4_k_m bytes");
    let named = resolve(&e, "tiny/m-GGUF", None, Some("m-Q8_0.gguf")).unwrap();
    assert_eq!(named, q8);
    let err = resolve(&e, "tiny/m-GGUF:Q2_K", None, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("Q2_K") && err.contains("m-Q8_0.gguf"), "{err}");
    let err = resolve(&e, "tiny/nope", None, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot list tiny/nope"), "{err}");
    // Offline: what was fetched is there; what was not is a clear error.
    let off = env(cache.path(), true);
    assert_eq!(resolve(&off, "tiny/m-GGUF:Q8_0", None, None).unwrap(), q8);
    let empty = tempfile::tempdir().unwrap();
    let err = resolve(&env(empty.path(), true), "tiny/m-GGUF:Q8_0", None, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
}

/// The command line, with the hub and the cache set by the environment.
#[test]
fn the_command_line_takes_a_hub_name() {
    let home = tempfile::tempdir().unwrap();
    assert!(is_hub_name("tiny/qwen3"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args(["info", "--model", "tiny/qwen3"])
        .env("HF_ENDPOINT", &hub().url)
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        home.path()
            .join("hub/models--tiny--qwen3/snapshots")
            .exists(),
        "{text}"
    );
    // --revision applies to hub names only.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args([
            "info",
            "--model",
            tiny_qwen3().to_str().unwrap(),
            "--revision",
            "v1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--revision"));
}
