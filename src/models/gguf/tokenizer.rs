//! The tokenizer stored in GGUF metadata: byte-level BPE (`gpt2`, with llama.cpp's
//! pre-tokenizer types) or SentencePiece (`llama`, see `tokenizer/spm.rs`), the chat template and
//! the special tokens.

use super::{GgufFile, GgufValue, in_file};
use crate::untrusted::text;
use anyhow::{Result, anyhow, bail};

impl GgufFile {
    /// The tokenizer stored in the metadata (`tokenizer.ggml.model == "gpt2"`: byte-level BPE),
    /// built like `gguf2hf.py`'s `bpe_tokenizer`.
    pub fn tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        self.tokenizer_inner().map_err(|e| in_file(&self.path, e))
    }

    fn tokenizer_inner(&self) -> Result<tokenizers::Tokenizer> {
        use tokenizers::models::bpe::{BPE, Vocab};
        use tokenizers::normalizers::unicode::NFC;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::pre_tokenizers::digits::Digits;
        use tokenizers::pre_tokenizers::sequence::Sequence;
        use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
        use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

        let model = self
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(GgufValue::as_str);
        match model {
            Some("gpt2") => {}
            Some("llama") => return self.spm_tokenizer(),
            Some(other) => bail!(
                "tokenizer model '{}' (tokenizer.ggml.model) is not supported yet \
                 (gpt2: byte-level BPE, llama: SentencePiece)",
                text(other)
            ),
            None => bail!("no tokenizer in the metadata (tokenizer.ggml.model is missing)"),
        }
        let pre = self
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(GgufValue::as_str)
            .unwrap_or("default");
        let tokens = self.string_array("tokenizer.ggml.tokens")?;
        let merges = self.string_array("tokenizer.ggml.merges")?;
        let types: Vec<i64> = match self.metadata.get("tokenizer.ggml.token_type") {
            None => vec![1; tokens.len()],
            Some(v) => {
                let a = v
                    .as_array()
                    .ok_or_else(|| anyhow!("tokenizer.ggml.token_type is not an array"))?;
                let t = a
                    .iter()
                    .map(|x| match *x {
                        GgufValue::I32(t) => Some(t.into()),
                        ref other => other.as_u64().and_then(|u| i64::try_from(u).ok()),
                    })
                    .collect::<Option<Vec<i64>>>()
                    .ok_or_else(|| anyhow!("tokenizer.ggml.token_type has non-integer entries"))?;
                if t.len() != tokens.len() {
                    bail!(
                        "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                        t.len(),
                        tokens.len()
                    );
                }
                t
            }
        };
        if u32::try_from(tokens.len()).is_err() {
            bail!("vocabulary of {} tokens is too large", tokens.len());
        }
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| {
                        anyhow!(
                            "tokenizer.ggml.merges[{i}] = \"{}\" is not a space-separated pair",
                            text(m)
                        )
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .fuse_unk(false)
            .byte_fallback(false)
            .build()
            .map_err(|e| anyhow!("cannot build the BPE model: {}", text(&e.to_string())))?;
        let mut tk = Tokenizer::new(bpe);
        match pre {
            "smollm" => {
                // llama.cpp: "\p{N}" then the GPT-2 regex == HF Digits(individual) + ByteLevel.
                tk.with_pre_tokenizer(Some(Sequence::new(vec![
                    Digits::new(true).into(),
                    ByteLevel::new(false, true, true).into(),
                ])));
            }
            "qwen2" => {
                let pat = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
                let split = Split::new(
                    SplitPattern::Regex(pat.to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| {
                    anyhow!(
                        "cannot build the qwen2 pre-tokenizer: {}",
                        text(&e.to_string())
                    )
                })?;
                tk.with_normalizer(Some(NFC))
                    .map_err(|e| anyhow!("cannot set the normalizer: {}", text(&e.to_string())))?;
                tk.with_pre_tokenizer(Some(Sequence::new(vec![
                    split.into(),
                    ByteLevel::new(false, false, false).into(),
                ])));
            }
            // Pre-tokenizer types that use the plain GPT-2 regex.
            "default" | "gpt2" | "gpt-2" => {
                tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
            }
            other => {
                bail!(
                    "tokenizer pre-tokenizer '{}' (tokenizer.ggml.pre) is not supported yet",
                    text(other)
                )
            }
        }
        tk.with_decoder(Some(ByteLevel::default()));
        tk.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|&(_, &t)| t == 3 || t == 4)
            .map(|(tok, &t)| AddedToken::from(tok.to_string(), t == 3).normalized(false))
            .collect();
        // Their ids are already in the vocabulary, so they keep them.
        tk.add_tokens(added)
            .map_err(|e| anyhow!("cannot add the special tokens: {}", text(&e.to_string())))?;
        Ok(tk)
    }

    /// `tokenizer.ggml.model == "llama"`: SentencePiece pieces with scores (see `spm.rs`).
    fn spm_tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        let tokens = self.string_array("tokenizer.ggml.tokens")?;
        let num = |key: &str| -> Result<Vec<f64>> {
            let v = self
                .metadata
                .get(key)
                .ok_or_else(|| anyhow!("metadata lacks '{key}'"))?;
            let a = v
                .as_array()
                .ok_or_else(|| anyhow!("'{key}' is a {}, not an array", v.type_name()))?;
            a.iter()
                .map(|x| match *x {
                    GgufValue::I32(t) => Some(t as f64),
                    ref other => other.as_f64(),
                })
                .collect::<Option<Vec<f64>>>()
                .ok_or_else(|| anyhow!("'{key}' has non-numeric entries"))
        };
        let scores: Vec<f32> = num("tokenizer.ggml.scores")?
            .iter()
            .map(|&x| x as f32)
            .collect();
        let types: Vec<i64> = num("tokenizer.ggml.token_type")?
            .iter()
            .map(|&x| x as i64)
            .collect();
        let unk = self
            .metadata
            .get("tokenizer.ggml.unknown_token_id")
            .and_then(GgufValue::as_u64)
            .unwrap_or(0) as usize;
        crate::tokenizer::spm::tokenizer(&tokens, &scores, &types, unk)
    }

    fn string_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self
            .metadata
            .get(key)
            .ok_or_else(|| anyhow!("metadata lacks '{key}'"))?;
        let a = v
            .as_array()
            .ok_or_else(|| anyhow!("'{key}' is a {}, not an array", v.type_name()))?;
        a.iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_str()
                    .ok_or_else(|| anyhow!("'{key}'[{i}] is a {}, not a string", x.type_name()))
            })
            .collect()
    }

    /// `tokenizer.chat_template`.
    pub fn chat_template(&self) -> Option<String> {
        self.metadata
            .get("tokenizer.chat_template")
            .and_then(GgufValue::as_str)
            .map(str::to_owned)
    }

    /// The text of token `id` in `tokenizer.ggml.tokens` (byte-level BPE form, e.g. `Ġthe`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.metadata
            .get("tokenizer.ggml.tokens")?
            .as_array()?
            .get(id as usize)?
            .as_str()
    }

    /// `tokenizer.ggml.add_bos_token` (false when absent).
    pub fn add_bos_token(&self) -> bool {
        self.metadata
            .get("tokenizer.ggml.add_bos_token")
            .and_then(GgufValue::as_bool)
            .unwrap_or(false)
    }
}
