//! The HTTP/1.1 connections under the router, with the limits a server exposed to untrusted
//! clients needs (axum's own `serve` has none of them):
//!
//! - a client gets [`ConnLimits::header_read_timeout`] to send a request's headers (hyper's
//!   timer, which starts when the connection opens): a slow-header client is closed;
//! - a connection with no request in flight and no bytes moving for
//!   [`ConnLimits::idle_timeout`] is closed (uvicorn's keep-alive timeout, which vLLM uses);
//! - at most [`ConnLimits::max_connections`] are open: past that, new ones wait in the
//!   kernel's backlog instead of exhausting the process's file descriptors (which would make
//!   every request, `/health` included, time out);
//! - at shutdown, idle connections close at once, and those with a request in flight close
//!   when it ends.

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tower::ServiceExt;

#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

/// Serves `app` on `listener` until `shutdown` completes, then until every connection has
/// closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // NOTE: out of file descriptors (or a connection reset before it was
                    // taken): wait a little rather than spin on the error.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        tasks.spawn(connection(
            stream,
            app.clone(),
            limits,
            stop_rx.clone(),
            permit,
        ));
        while tasks.try_join_next().is_some() {}
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
}

/// One connection, until the client closes it, it times out, or the server shuts down.
async fn connection(
    stream: TcpStream,
    app: Router,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let start = Instant::now();
    let activity = Arc::new(Activity {
        start,
        last_ms: AtomicU64::new(0),
        in_flight: AtomicUsize::new(0),
    });
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let act = activity.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let app = app.clone();
        let guard = InFlight::new(act.clone());
        async move {
            let response = app
                .oneshot(req.map(Body::new))
                .await
                .unwrap_or_else(|e: Infallible| match e {});
            Ok::<_, Infallible>(response.map(|body| {
                Body::new(Guarded {
                    body,
                    _guard: guard,
                })
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut closing = false;
    if *stop.borrow() {
        conn.as_mut().graceful_shutdown();
        closing = true;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(500).min(limits.idle_timeout));
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection closed: {e}");
                }
                return;
            }
            _ = stop.changed(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = tick.tick(), if !closing => {
                if activity.idle_for() >= limits.idle_timeout {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

/// What a connection is doing: when bytes last moved, and how many responses are open.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
    in_flight: AtomicUsize,
}

impl Activity {
    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// How long the connection has been idle: zero while a response is open (a long
    /// generation may send nothing for a while).
    fn idle_for(&self) -> Duration {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return Duration::ZERO;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// Counts a request from its arrival until its response body is dropped (sent or abandoned).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(a: Arc<Activity>) -> Self {
        a.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(a)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

/// A response body that holds its request's [`InFlight`] until it is dropped.
struct Guarded {
    body: Body,
    _guard: InFlight,
}

impl http_body::Body for Guarded {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A TCP stream that records when bytes last moved.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.touch();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The default connection cap: 4096, or fewer where the process may not open that many
/// files. The soft limit is first raised to the hard one (as vLLM does at start-up), since
/// the usual soft limit of 1024 is low for a server.
pub fn default_max_connections() -> usize {
    const WANTED: usize = 4096;
    // NOTE: descriptors the process needs besides connections: model files, the runtime's,
    // the GPU driver's.
    const RESERVE: usize = 128;
    match raise_nofile_limit() {
        Some(limit) => limit.saturating_sub(RESERVE).clamp(16, WANTED),
        None => WANTED,
    }
}

/// Raises the soft limit on open files to the hard limit; returns the soft limit now.
#[cfg(unix)]
fn raise_nofile_limit() -> Option<usize> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    usize::try_from(lim.rlim_cur).ok()
}

#[cfg(not(unix))]
fn raise_nofile_limit() -> Option<usize> {
    None
}
