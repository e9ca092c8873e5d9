//! Iteration-level (continuous batching) scheduler, in the manner of vLLM v1.
//!
//! There is no prefill or decode phase. Each request knows its tokens (prompt, then output) and
//! how many of them have K/V in the cache (`num_computed_tokens`); each step spends one token
//! budget on running requests first, then on waiting ones. A long prompt is thereby prefilled in
//! chunks, and prefill chunks share a batch with decode tokens. Pure data: no backend imports.

mod request;
mod scheduler;
mod spec;

pub use request::{FinishReason, Request, RequestId, RequestStatus};
pub use scheduler::{
    PreemptionMode, ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput,
    SchedulingPolicy, TokenEvent,
};
pub use spec::NgramConfig;
