//! Sampling: per-request parameters, choosing the next token from logits (penalties,
//! temperature, top-k/top-p/min-p, seeded draws, log-probs), and turning generated tokens into
//! streamed text (incremental detokenization, stop strings).

pub mod detokenizer;
pub mod gbnf;
pub mod params;
pub mod rows;
pub mod sampler;
pub mod stop;
pub mod structured;

pub use detokenizer::IncrementalDetokenizer;
pub use params::{InvalidParam, SamplingDefaults, SamplingParams};
pub use rows::{Choice, LogitEdit, RowSampling};
pub use sampler::{Restrict, SampledToken, TokenLogprobs, sample, token_logprob};
pub use stop::StopChecker;
pub use structured::{StructuredCompiler, StructuredOutput};
