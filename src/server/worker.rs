//! The engine thread: it owns the [`Engine`] and runs its step loop. Requests reach it as
//! [`Command`]s on a channel; each request's tokens leave it on that request's own unbounded
//! channel, so a slow reader never holds up a step, and a reader that went away (its receiver
//! dropped) gets its request aborted at the next token.
//!
//! ```text
//!  handlers ──Command──▶ [engine thread: drain commands ─ step ─ dispatch outputs] ──Event──▶ handler
//!                                     │ after each step: gauges ▶ Metrics
//! ```

use super::metrics::{EngineGauges, LoraGauge, Metrics};
use crate::engine::{Engine, LoraError, LoraInfo, PoolingParams, Prompt, RequestError, StepOutput};
use crate::sampling::SamplingParams;
use crate::sched::{FinishReason, RequestId};
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc as tmpsc, oneshot};

/// One sub-request of an HTTP request (a prompt of a completions batch, or the chat prompt).
pub struct SubRequest {
    pub prompt: Prompt,
    pub params: SamplingParams,
    /// An embedding or score request (`params` is then unused).
    pub pooling: Option<PoolingParams>,
    /// The LoRA adapter the request's `model` names (`None`: the base model).
    pub lora: Option<String>,
}

pub enum Command {
    /// Queue all of `requests` or none: the reply is their engine ids in order, or why the
    /// first refused one was refused.
    Add {
        requests: Vec<SubRequest>,
        /// For the request log line.
        log_id: String,
        arrival: Instant,
        events: tmpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<Result<Vec<RequestId>, AddError>>,
    },
    /// Abort these requests (their client went away); unknown or finished ids are ignored.
    Abort(Vec<RequestId>),
    /// Load a LoRA adapter (`None`: unload the adapter of that name; `replace`: unload the one
    /// of that name first, if any); the reply is the adapters loaded after it.
    Lora {
        name: String,
        path: Option<std::path::PathBuf>,
        replace: bool,
        reply: oneshot::Sender<Result<Vec<LoraInfo>, LoraError>>,
    },
    /// Abort whatever is left and end the thread.
    Shutdown,
}

/// What a handler receives for choice `index` (sub-request `i`'s completion `j` is choice
/// `i * n + j`, as OpenAI numbers the choices of several prompts).
pub struct Event {
    pub index: usize,
    pub kind: EventKind,
}

pub enum EventKind {
    Output(StepOutput),
    /// The engine failed; the request is over.
    Error(String),
}

#[derive(Debug)]
pub enum AddError {
    Request { index: usize, error: RequestError },
    QueueFull { max_waiting: usize },
    Dead,
}

struct Track {
    /// The choice index of the sub-request's first completion.
    index: usize,
    /// Completions not yet finished.
    unfinished: usize,
    log_id: String,
    events: tmpsc::UnboundedSender<Event>,
    arrival: Instant,
    first_token: Option<Instant>,
    prompt_tokens: usize,
    /// Output tokens per completion.
    output_tokens: Vec<usize>,
}

pub struct Worker {
    engine: Engine,
    commands: mpsc::Receiver<Command>,
    metrics: Arc<Metrics>,
    /// Set when the engine panicked: it answers nothing any more (and `/health` says so).
    dead: Arc<AtomicBool>,
    max_waiting: usize,
    tracks: HashMap<RequestId, Track>,
}

impl Worker {
    pub fn new(
        engine: Engine,
        commands: mpsc::Receiver<Command>,
        metrics: Arc<Metrics>,
        dead: Arc<AtomicBool>,
        max_waiting: usize,
    ) -> Self {
        Worker {
            engine,
            commands,
            metrics,
            dead,
            max_waiting,
            tracks: HashMap::new(),
        }
    }

    /// The step loop; returns when told to shut down or when every sender is gone.
    pub fn run(mut self) {
        self.publish_gauges();
        loop {
            // Idle: block until there is something to do.
            if !self.engine.has_unfinished() || self.dead.load(Ordering::Relaxed) {
                match self.commands.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            // Take everything that arrived during the last step before the next one.
            let mut stop = false;
            while let Ok(cmd) = self.commands.try_recv() {
                if !self.handle(cmd) {
                    stop = true;
                    break;
                }
            }
            if stop {
                break;
            }
            if self.engine.has_unfinished() && !self.dead.load(Ordering::Relaxed) {
                let before = self.engine.stats().batched_tokens;
                self.step();
                if self.engine.stats().batched_tokens == before {
                    // NOTE: nothing could be scheduled (should not happen, as the scheduler
                    // preempts); wait for a command a moment instead of spinning.
                    if let Ok(cmd) = self.commands.recv_timeout(Duration::from_millis(5))
                        && !self.handle(cmd)
                    {
                        break;
                    }
                }
            }
            self.publish_gauges();
        }
        let ids: Vec<RequestId> = self.tracks.keys().copied().collect();
        self.abort(&ids);
        self.publish_gauges();
    }

    /// Handles one command; false means shut down.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add {
                requests,
                log_id,
                arrival,
                events,
                reply,
            } => {
                let result = self.add(requests, &log_id, arrival, &events);
                // NOTE: if the handler is gone already, its requests must not linger.
                if let Err(Ok(ids)) = reply.send(result) {
                    self.abort(&ids);
                }
            }
            Command::Abort(ids) => self.abort(&ids),
            Command::Lora {
                name,
                path,
                replace,
                reply,
            } => {
                let e = &mut self.engine;
                let result = match path {
                    Some(p) => {
                        if replace {
                            let _ = e.unload_lora(&name);
                        }
                        e.load_lora(&name, &p).map(|_| ())
                    }
                    None => e.unload_lora(&name),
                };
                let _ = reply.send(result.map(|()| e.loras()));
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn add(
        &mut self,
        requests: Vec<SubRequest>,
        log_id: &str,
        arrival: Instant,
        events: &tmpsc::UnboundedSender<Event>,
    ) -> Result<Vec<RequestId>, AddError> {
        if self.dead.load(Ordering::Relaxed) {
            return Err(AddError::Dead);
        }
        if self.engine.num_waiting() + requests.len() > self.max_waiting {
            return Err(AddError::QueueFull {
                max_waiting: self.max_waiting,
            });
        }
        let n = requests.len();
        let mut ids = Vec::with_capacity(n);
        for (index, sub) in requests.into_iter().enumerate() {
            let prompt_tokens = match &sub.prompt {
                Prompt::Tokens(t) => t.len(),
                Prompt::Text(_) => 0,
            };
            let samples = if sub.pooling.is_some() {
                1
            } else {
                sub.params.n
            };
            let engine = &mut self.engine;
            let res = catch_unwind(AssertUnwindSafe(|| match sub.pooling {
                Some(p) => engine.add_pooling_request(sub.prompt, p),
                None => engine.add_request_with_lora(sub.prompt, sub.params, sub.lora.as_deref()),
            }))
            .unwrap_or_else(|_| {
                Err(RequestError::Internal(anyhow::anyhow!(
                    "the engine panicked while adding the request"
                )))
            });
            match res {
                Ok(id) => {
                    ids.push(id);
                    self.tracks.insert(
                        id,
                        Track {
                            index: index * samples,
                            unfinished: samples,
                            log_id: if n == 1 {
                                log_id.to_string()
                            } else {
                                format!("{log_id}-{index}")
                            },
                            events: events.clone(),
                            arrival,
                            first_token: None,
                            prompt_tokens,
                            output_tokens: vec![0; samples],
                        },
                    );
                }
                Err(error) => {
                    for id in &ids {
                        self.engine.abort(*id);
                        self.tracks.remove(id);
                    }
                    return Err(AddError::Request { index, error });
                }
            }
        }
        Ok(ids)
    }

    fn abort(&mut self, ids: &[RequestId]) {
        for id in ids {
            if self.tracks.contains_key(id) {
                self.engine.abort(*id);
                self.finish(*id, FinishReason::Abort);
            }
        }
    }

    fn step(&mut self) {
        let engine = &mut self.engine;
        match catch_unwind(AssertUnwindSafe(|| engine.step())) {
            Ok(Ok(outputs)) => {
                for out in outputs {
                    self.dispatch(out);
                }
            }
            Ok(Err(e)) => {
                // NOTE: a failed step cannot be pinned on one request; every request of the batch
                // gets the error and is aborted, and the engine goes on with new ones.
                tracing::error!("engine step failed: {e:#}");
                self.fail_all(&format!("the engine failed: {e:#}"));
            }
            Err(_) => {
                tracing::error!("the engine panicked; no further requests are accepted");
                self.dead.store(true, Ordering::Relaxed);
                self.fail_all("the engine panicked");
            }
        }
    }

    fn fail_all(&mut self, message: &str) {
        let ids: Vec<RequestId> = self.tracks.keys().copied().collect();
        for id in ids {
            if let Some(t) = self.tracks.get(&id) {
                let _ = t.events.send(Event {
                    index: t.index,
                    kind: EventKind::Error(message.to_string()),
                });
            }
            let engine = &mut self.engine;
            let _ = catch_unwind(AssertUnwindSafe(|| engine.abort(id)));
            self.finish(id, FinishReason::Abort);
        }
    }

    fn dispatch(&mut self, out: StepOutput) {
        let id = out.request_id;
        let Some(t) = self.tracks.get_mut(&id) else {
            return;
        };
        if t.first_token.is_none() && !out.new_token_ids.is_empty() {
            let now = Instant::now();
            t.first_token = Some(now);
            self.metrics
                .observe_first_token((now - t.arrival).as_secs_f64());
        }
        t.prompt_tokens = out.num_prompt_tokens;
        if let Some(o) = t.output_tokens.get_mut(out.index) {
            *o = out.num_output_tokens;
        }
        let finish = out.finish_reason;
        if finish.is_some() {
            t.unfinished = t.unfinished.saturating_sub(1);
        }
        let all_done = t.unfinished == 0;
        let sent = t
            .events
            .send(Event {
                index: t.index + out.index,
                kind: EventKind::Output(out),
            })
            .is_ok();
        match finish {
            Some(reason) if all_done => self.finish(id, reason),
            Some(_) => {}
            None if !sent => {
                // The reader is gone: its client disconnected.
                self.engine.abort(id);
                self.finish(id, FinishReason::Abort);
            }
            None => {}
        }
    }

    /// Ends a request's tracking: its log line and its metrics.
    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let Some(t) = self.tracks.remove(&id) else {
            return;
        };
        let now = Instant::now();
        let total = (now - t.arrival).as_secs_f64();
        let ttft = t.first_token.map(|f| (f - t.arrival).as_secs_f64());
        // NOTE: with n > 1 the time per output token is that of one completion: the longest.
        let longest = t.output_tokens.iter().copied().max().unwrap_or(0);
        let tpot = match t.first_token {
            Some(f) if longest > 1 => Some((now - f).as_secs_f64() / (longest - 1) as f64),
            _ => None,
        };
        self.metrics.observe_finished(reason.as_str(), total, tpot);
        tracing::info!(
            "request {} finished ({}): prompt tokens {}, completion tokens {}, time to first token {}, total {:.3} s",
            t.log_id,
            reason.as_str(),
            t.prompt_tokens,
            t.output_tokens.iter().sum::<usize>(),
            ttft.map_or_else(|| "-".to_string(), |s| format!("{s:.3} s")),
            total
        );
    }

    fn publish_gauges(&self) {
        let kv = self.engine.kv_usage();
        let stats = self.engine.stats();
        let pc = self.engine.prefix_cache_stats();
        self.metrics.set_gauges(EngineGauges {
            running: self.engine.num_running(),
            waiting: self.engine.num_waiting(),
            kv_usage: kv.usage,
            kv_blocks_used: kv.blocks_used,
            kv_blocks_total: kv.num_blocks,
            prompt_tokens: stats.prompt_tokens,
            generation_tokens: stats.generated_tokens,
            preemptions: stats.preemptions,
            prefix_cache_queries: pc.queries,
            prefix_cache_hits: pc.hits,
            spec_decode_num_drafts: stats.spec_drafts,
            spec_decode_num_draft_tokens: stats.spec_draft_tokens,
            spec_decode_num_accepted_tokens: stats.spec_accepted_tokens,
        });
        if self.engine.lora_enabled() {
            let (running, waiting) = self.engine.lora_requests();
            self.metrics.set_lora(LoraGauge {
                max_loras: self.engine.max_loras(),
                running,
                waiting,
            });
        }
    }
}
