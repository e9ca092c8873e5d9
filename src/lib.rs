//! Pagoda: an LLM inference and serving engine. A paged KV cache managed like virtual memory,
//! continuous batching under one token budget, and one engine for every backend.
//!
//! ```no_run
//! use pagoda::{EngineArgs, LLM, SamplingParams};
//! let mut llm = LLM::new(EngineArgs::default())?; // SmolLM2-135M-Instruct, fetched once
//! let params = SamplingParams { temperature: 0.8, top_p: 0.95, max_tokens: Some(512), ..Default::default() };
//! for out in llm.generate(&["Hello, my name is", "The capital of France is"], &params)? {
//!     println!("{:?} -> {:?}", out.prompt, out.outputs[0].text);
//! }
//! # anyhow::Ok(())
//! ```
//!
//! See ARCHITECTURE.md for the parts and the data flow of one engine step.

pub mod backend;
pub mod bench;
pub mod engine;
pub mod fetch;
pub mod hub;
pub mod kv;
pub mod models;
pub mod parallel;
pub mod quant;
pub mod sampling;
pub mod sched;
pub mod server;
pub mod tensor;
pub mod tokenizer;
pub mod untrusted;

pub use backend::BackendKind;
pub use engine::{CompletionOutput, Engine, EngineArgs, LLM, Prompt, RequestOutput, StepOutput};
pub use sampling::SamplingParams;
pub use tensor::{DType, WeightDtype};
pub use tokenizer::ChatMessage;
