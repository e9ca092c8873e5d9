//! The OpenAI-compatible HTTP server (`pagoda serve`): axum on tokio in front of one engine
//! thread.
//!
//! ```text
//!   clients ──HTTP──▶ axum handlers (tokio) ──Command──▶ engine thread (Engine::step loop)
//!                         ▲                                   │
//!                         └──────── Event per request ────────┘   (unbounded channels)
//! ```
//!
//! [`start`] runs a server on its own threads and returns once it listens (the tests use it);
//! [`serve`] is the command line's: it runs until SIGINT or SIGTERM, then stops accepting, lets
//! running requests finish within the grace period, and returns.

mod anthropic;
mod chat;
mod completions;
mod error;
mod http;
mod infill;
mod metrics;
mod params;
mod pooling;
mod response;
mod responses;
mod routes;
mod state;
mod store;
mod streaming;
pub mod tools;
mod types;
mod worker;

pub use error::ApiError;
pub use http::default_max_connections;
pub use metrics::Metrics;

use crate::engine::{Engine, EngineArgs};
use anyhow::{Context, Result};
use state::AppState;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;
use worker::{Command, Worker};

/// The server's own settings (the engine's are [`EngineArgs`]).
#[derive(Debug, Clone)]
pub struct ServerArgs {
    pub host: String,
    /// 0 picks a free port (the log line says which).
    pub port: u16,
    /// Names clients may send as `model`; the first is used in responses. Empty: the engine's
    /// model name.
    pub served_model_names: Vec<String>,
    /// When set, every `/v1` route requires `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Most requests waiting for the engine; more get 503.
    pub max_waiting: usize,
    /// How long running requests may take to finish after SIGINT/SIGTERM.
    pub shutdown_grace: Duration,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// How long a client may take to send a request's headers.
    pub header_read_timeout: Duration,
    /// How long a connection with no request in flight may stay open (keep-alive).
    pub idle_timeout: Duration,
    /// Most connections open at once; more wait to be accepted.
    pub max_connections: usize,
    /// How the model writes tool calls: set, `tool_choice: "auto"` is served (vLLM's
    /// `--enable-auto-tool-choice --tool-call-parser`).
    pub tool_call_parser: Option<tools::ToolCallParser>,
}

impl Default for ServerArgs {
    fn default() -> Self {
        ServerArgs {
            host: "127.0.0.1".into(),
            port: 8000,
            served_model_names: Vec::new(),
            api_key: None,
            max_waiting: 1024,
            shutdown_grace: Duration::from_secs(30),
            max_body_bytes: 8 << 20,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            max_connections: http::default_max_connections(),
            tool_call_parser: None,
        }
    }
}

/// A server running on its own threads; dropping it shuts it down.
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl ServerHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Graceful shutdown, as on SIGTERM; returns when the server has stopped.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow::anyhow!("the server thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("pagoda-http")
        .build()
        .context("cannot start the tokio runtime")
}

/// Starts a server for `engine` on its own threads; returns once it is listening.
pub fn start(engine: Engine, args: ServerArgs) -> Result<ServerHandle> {
    let (ready_tx, ready_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("pagoda-server".into())
        .spawn(move || {
            let rt = runtime()?;
            rt.block_on(run(
                engine,
                args,
                async move {
                    let _ = stop_rx.await;
                },
                ready_tx,
            ))
        })
        .context("cannot spawn the server thread")?;
    match ready_rx.recv() {
        Ok(addr) => Ok(ServerHandle {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        }),
        Err(_) => Err(thread
            .join()
            .map_err(|_| anyhow::anyhow!("the server thread panicked"))?
            .err()
            .unwrap_or_else(|| anyhow::anyhow!("the server stopped before listening"))),
    }
}

/// `pagoda serve`: loads the model, serves until SIGINT or SIGTERM, then shuts down gracefully.
pub fn serve(engine_args: EngineArgs, args: ServerArgs) -> Result<()> {
    let engine = Engine::new(engine_args)?;
    let (ready_tx, _ready_rx) = mpsc::channel();
    runtime()?.block_on(run(engine, args, shutdown_signal(), ready_tx))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received"),
        _ = term => tracing::info!("SIGTERM received"),
    }
}

async fn run(
    engine: Engine,
    args: ServerArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: mpsc::Sender<SocketAddr>,
) -> Result<()> {
    let model_names = if args.served_model_names.is_empty() {
        vec![engine.model_name().to_string()]
    } else {
        args.served_model_names.clone()
    };
    if let Some(l) = engine
        .loras()
        .iter()
        .find(|l| model_names.contains(&l.name))
    {
        anyhow::bail!(
            "the LoRA adapter `{}` has the name the model is served under: rename one",
            l.name
        );
    }
    let metrics = Arc::new(Metrics::new(&model_names[0]));
    let dead = Arc::new(AtomicBool::new(false));
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let state = Arc::new(AppState {
        commands: cmd_tx,
        tokenizer: engine.tokenizer().clone(),
        model_root: engine.model_name().to_string(),
        model_names,
        loras: engine
            .lora_enabled()
            .then(|| std::sync::RwLock::new(engine.loras())),
        max_model_len: engine.max_model_len(),
        vocab_size: engine.config().vocab_size,
        sampling_defaults: *engine.sampling_defaults(),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        metrics: metrics.clone(),
        created: now.as_secs(),
        id_prefix: (now.as_nanos() as u64) & 0xffff_ffff_ffff,
        next_id: AtomicU64::new(0),
        draining: AtomicBool::new(false),
        dead: dead.clone(),
        max_body_bytes: args.max_body_bytes,
        max_waiting: args.max_waiting,
        max_prompt_bytes: engine
            .max_model_len()
            .saturating_mul(engine.tokenizer().max_token_bytes()),
        tool_call_parser: args.tool_call_parser,
        warned_fields: Default::default(),
        responses: Default::default(),
        fim: crate::tokenizer::Fim::of(engine.tokenizer()),
        pooler: engine.pooler().cloned(),
        tokenizer_slots: tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(2, |n| n.get()),
        ),
    });

    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;

    let worker = Worker::new(engine, cmd_rx, metrics, dead, args.max_waiting);
    let engine_thread = std::thread::Builder::new()
        .name("pagoda-engine".into())
        .spawn(move || worker.run())
        .context("cannot spawn the engine thread")?;

    tracing::info!(
        "serving {} on http://{addr}/v1 (OpenAI API){}",
        state.model_names.join(", "),
        if state.api_key.is_some() {
            "; API key required"
        } else {
            ""
        }
    );
    let _ = ready.send(addr);

    let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
    let st = state.clone();
    let signal = async move {
        shutdown.await;
        st.draining.store(true, Ordering::Relaxed);
        tracing::info!("shutting down: no new connections; running requests may finish");
        let _ = drain_tx.send(());
    };
    let app = routes::router(state.clone());
    let limits = http::ConnLimits {
        header_read_timeout: args.header_read_timeout,
        idle_timeout: args.idle_timeout,
        max_connections: args.max_connections,
    };
    let server = http::serve(listener, app, limits, signal);
    let grace = args.shutdown_grace;
    let grace_over = async move {
        if drain_rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let result = tokio::select! {
        _ = server => Ok(()),
        _ = grace_over => {
            let g = state.metrics.gauges();
            tracing::warn!(
                "the grace period ({grace:?}) is over with {} requests running and {} waiting; aborting them",
                g.running,
                g.waiting
            );
            Ok(())
        }
    };
    let _ = state.send(Command::Shutdown);
    let joined = tokio::task::spawn_blocking(move || engine_thread.join()).await;
    if !matches!(joined, Ok(Ok(()))) {
        tracing::error!("the engine thread ended abnormally");
    }
    tracing::info!("server stopped");
    result
}
