//! Models: configuration, weight loading (HF safetensors directories and GGUF files), the
//! tokenizer with its chat template, and one file per model family.

pub mod config;
pub mod gguf;
pub mod llama;
pub mod loader;
pub mod tokenizer;

pub use config::{Arch, ModelConfig};
pub use loader::{LoadedModel, WeightSource, load_model};
