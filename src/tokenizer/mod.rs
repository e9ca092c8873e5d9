//! The tokenizer of a model: a HF `tokenizers::Tokenizer` plus what `tokenizer_config.json` adds
//! (chat template, BOS/EOS tokens, whether to prepend BOS).

mod fim;
pub mod spm;

pub use fim::Fim;

use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, anyhow, bail};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value, context};
use serde_json::Value as Json;

/// One message of a conversation, as the chat template sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's tool calls: `{"id", "type": "function", "function": {"name",
    /// "arguments"}}` with the arguments as a JSON object, as transformers' templates read them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Json>>,
    /// A `tool` message's answer to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A model's tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: bool,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    /// The chat template compiled on first use (or why it does not compile).
    chat_env: OnceLock<Result<Environment<'static>, String>>,
    /// The most bytes one token stands for, computed on first use.
    max_token_bytes: OnceLock<usize>,
    /// `inner` with special tokens read as text, built on first use (`encode_literal`).
    literal: OnceLock<tokenizers::Tokenizer>,
}

/// Name of the chat template in its environment.
const CHAT_TEMPLATE: &str = "chat_template";

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("add_bos_token", &self.add_bos_token)
            .field("has_chat_template", &self.has_chat_template())
            .finish()
    }
}

/// `tokenizer_config.json` token fields are a string or an AddedToken object `{"content": ...}`.
fn token_field(
    config: &serde_json::Map<String, Json>,
    key: &str,
    path: &Path,
) -> anyhow::Result<Option<String>> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(o)) => match o.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => bail!(
                "{}: {key} is an object without a string \"content\"",
                path.display()
            ),
        },
        Some(other) => bail!(
            "{}: {key} must be a string or {{\"content\": ...}}, got {}",
            path.display(),
            crate::untrusted::json(other)
        ),
    }
}

/// `chat_template` is a string, or a list of `{"name", "template"}` of which we take "default".
fn chat_template_field(
    config: &serde_json::Map<String, Json>,
    path: &Path,
) -> anyhow::Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            for entry in list {
                let name = entry.get("name").and_then(Json::as_str);
                let template = entry.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(_), Some(_)) => {}
                    _ => bail!(
                        "{}: chat_template list entries must be {{\"name\": ..., \"template\": ...}}",
                        path.display()
                    ),
                }
            }
            Ok(None)
        }
        Some(_) => bail!(
            "{}: chat_template must be a string or a list of {{\"name\", \"template\"}}",
            path.display()
        ),
    }
}

impl Tokenizer {
    /// Loads a HF tokenizer directory: `tokenizer.json` (required) and `tokenizer_config.json`
    /// (optional: `chat_template`, `bos_token`, `eos_token`, `add_bos_token`). Without a
    /// `chat_template` there, `chat_template.jinja` (newer HF layout) is used when present.
    /// Without `add_bos_token`, BOS is prepended when the tokenizer's post-processor would add it.
    pub fn from_hf_dir(dir: &Path) -> anyhow::Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        if !crate::untrusted::optional_regular_file(&tok_path)? {
            bail!(
                "{} not found: a HF tokenizer directory must contain tokenizer.json",
                tok_path.display()
            );
        }
        let bytes =
            std::fs::read(&tok_path).with_context(|| format!("reading {}", tok_path.display()))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            anyhow!(
                "{}: not a valid tokenizer: {}",
                tok_path.display(),
                crate::untrusted::text(&e.to_string())
            )
        })?;

        let cfg_path = dir.join("tokenizer_config.json");
        let mut chat_template = None;
        let mut bos_token = None;
        let mut eos_token = None;
        let mut add_bos_token = None;
        if crate::untrusted::optional_regular_file(&cfg_path)? {
            let text = std::fs::read_to_string(&cfg_path)
                .with_context(|| format!("reading {}", cfg_path.display()))?;
            let json: Json = serde_json::from_str(&text)
                .with_context(|| format!("{}: invalid JSON", cfg_path.display()))?;
            let Json::Object(config) = json else {
                bail!("{}: expected a JSON object", cfg_path.display());
            };
            chat_template = chat_template_field(&config, &cfg_path)?;
            bos_token = token_field(&config, "bos_token", &cfg_path)?;
            eos_token = token_field(&config, "eos_token", &cfg_path)?;
            add_bos_token = match config.get("add_bos_token") {
                None | Some(Json::Null) => None,
                Some(Json::Bool(b)) => Some(*b),
                Some(other) => bail!(
                    "{}: add_bos_token must be true or false, got {}",
                    cfg_path.display(),
                    crate::untrusted::json(other)
                ),
            };
        }
        if chat_template.is_none() {
            let jinja = dir.join("chat_template.jinja");
            if crate::untrusted::optional_regular_file(&jinja)? {
                chat_template = Some(
                    std::fs::read_to_string(&jinja)
                        .with_context(|| format!("reading {}", jinja.display()))?,
                );
            }
        }
        let add_bos_token = match add_bos_token {
            Some(b) => b,
            None => {
                // NOTE: tokenizer.json files like Llama 3's add BOS in their post-processor
                // and say nothing in tokenizer_config.json; follow the post-processor.
                let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
                let probe = inner.encode_fast("", true).ok();
                match (bos_id, probe) {
                    (Some(id), Some(enc)) => enc.get_ids().first() == Some(&id),
                    _ => false,
                }
            }
        };
        Ok(Self::from_parts(
            inner,
            chat_template,
            bos_token,
            eos_token,
            add_bos_token,
        ))
    }

    /// Assembles a tokenizer from its parts (the GGUF loader's way in).
    pub fn from_parts(
        inner: tokenizers::Tokenizer,
        chat_template: Option<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
        add_bos_token: bool,
    ) -> Self {
        let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let eos_id = eos_token.as_deref().and_then(|t| inner.token_to_id(t));
        Self {
            inner,
            chat_template,
            bos_token,
            eos_token,
            add_bos_token,
            bos_id,
            eos_id,
            chat_env: OnceLock::new(),
            max_token_bytes: OnceLock::new(),
            literal: OnceLock::new(),
        }
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) are recognised;
    /// BOS is prepended iff `add_bos_token` and the text does not already start with it.
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let mut ids = self.encode_plain(text)?;
        if self.add_bos_token
            && let Some(bos) = self.bos_id
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Token ids of `text` with the tokenizer's own special tokens, as transformers'
    /// `tokenizer(text)` gives them (its post-processor's BOS, EOS, CLS or SEP) where it has
    /// a post-processor, else as [`Self::encode`]: what an embedding model was trained on.
    pub fn encode_special(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        if self.inner.get_post_processor().is_none() {
            return self.encode(text);
        }
        let enc = self
            .inner
            .encode_fast(text, true)
            .map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of a pair of texts, as transformers' `tokenizer(a, b)` lays them out for a
    /// cross-encoder (the post-processor's pair template), else `a` as [`Self::encode`]
    /// followed by `b`.
    pub fn encode_pair(&self, a: &str, b: &str) -> anyhow::Result<Vec<u32>> {
        if self.inner.get_post_processor().is_none() {
            let mut ids = self.encode(a)?;
            ids.extend(self.encode_plain(b)?);
            return Ok(ids);
        }
        let enc = self
            .inner
            .encode_fast((a, b), true)
            .map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` alone: no BOS (a piece of a prompt assembled from several).
    pub fn encode_plain(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` taken literally: no BOS, and a special token's text written in it
    /// (`<|im_end|>`, `<|fim_prefix|>`) is tokenized as the characters it is, as llama.cpp
    /// tokenizes user text with `parse_special = false`. Added tokens that are not special keep
    /// their ids (llama.cpp's user-defined tokens).
    pub fn encode_literal(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        // NOTE: the flag belongs to the whole tokenizer, so the literal one is a second copy
        // (made once) rather than a flag flipped under concurrent requests.
        let literal = self.literal.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = literal
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids` (unknown ids are left out).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> anyhow::Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| anyhow!("decoding failed: {e}"))
    }

    /// The bytes token `id` stands for, also when they are not whole UTF-8 characters (a
    /// byte-level BPE token holding part of an emoji, SentencePiece's `<0xE6>`), where
    /// [`Self::decode`] gives U+FFFD.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let text = self.decode(&[id], false).unwrap_or_default();
        if !text.contains('\u{FFFD}') {
            return text.into_bytes();
        }
        let Some(piece) = self.id_to_token(id) else {
            return text.into_bytes();
        };
        if let Some(b) = byte_fallback_piece(&piece) {
            return vec![b];
        }
        // NOTE: a byte-level BPE vocabulary spells each byte as one printable character
        // (GPT-2's table); undo it when every character is one of those.
        let table = byte_level_table();
        match piece
            .chars()
            .map(|c| table.get(&c).copied())
            .collect::<Option<Vec<u8>>>()
        {
            Some(bytes) => bytes,
            None => text.into_bytes(),
        }
    }

    /// Every token's bytes as the vocabulary spells them (a SentencePiece `▁` as a space,
    /// `<0xNN>` as its byte, byte-level characters as their bytes), and whether the token is
    /// special (an added control token such as `<|im_end|>`, which text never tokenizes to).
    /// Ids the tokenizer does not know get no bytes.
    pub fn vocab_pieces(&self) -> Vec<(Vec<u8>, bool)> {
        fn byte_level(d: &tokenizers::DecoderWrapper) -> bool {
            match d {
                tokenizers::DecoderWrapper::ByteLevel(_) => true,
                tokenizers::DecoderWrapper::Sequence(s) => s.get_decoders().iter().any(byte_level),
                _ => false,
            }
        }
        let is_byte_level = self.inner.get_decoder().is_some_and(byte_level);
        let added = self.inner.get_added_tokens_decoder();
        let table = byte_level_table();
        (0..self.vocab_size() as u32)
            .map(|id| {
                if let Some(a) = added.get(&id) {
                    return (a.content.as_bytes().to_vec(), a.special);
                }
                let Some(piece) = self.id_to_token(id) else {
                    return (Vec::new(), false);
                };
                let bytes = if is_byte_level {
                    piece
                        .chars()
                        .map(|c| table.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                        .unwrap_or_else(|| piece.as_bytes().to_vec())
                } else if let Some(b) = byte_fallback_piece(&piece) {
                    vec![b]
                } else {
                    piece.replace('\u{2581}', " ").into_bytes()
                };
                (bytes, false)
            })
            .collect()
    }

    /// The most bytes of text one token stands for: a text longer than `n` times this has more
    /// than `n` tokens, which bounds what is worth tokenizing.
    pub fn max_token_bytes(&self) -> usize {
        *self.max_token_bytes.get_or_init(|| {
            // NOTE: a byte-level piece has one character per byte; a SentencePiece piece one
            // per character (▁ for a space, which decoding a lone token may drop), so the
            // larger of its characters and its decoded bytes is what it can cover. The floor
            // covers normalisers that expand text.
            self.inner
                .get_vocab(true)
                .iter()
                .map(|(piece, &id)| piece.chars().count().max(self.token_bytes(id).len()))
                .max()
                .unwrap_or(1)
                .max(16)
        })
    }

    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        self.inner.token_to_id(s)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of tokens, added tokens included (HF's `len(tokenizer)`). The model's embedding
    /// may be larger (padded).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_id
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn add_bos_token(&self) -> bool {
        self.add_bos_token
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders the chat template (Jinja, as HF does it: `trim_blocks` and `lstrip_blocks`, Python
    /// string methods such as `.strip()`, and `raise_exception(msg)`, which fails with `msg`).
    /// The template sees `messages`, `bos_token`, `eos_token` and `add_generation_prompt`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> anyhow::Result<String> {
        self.apply_chat_template_with_tools(messages, add_generation_prompt, None)
    }

    /// [`Self::apply_chat_template`] with the functions the model may call, which the template
    /// sees as `tools` (the OpenAI `tools` list, as transformers passes it).
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&[Json]>,
    ) -> anyhow::Result<String> {
        let Some(source) = self.chat_template.as_deref() else {
            bail!(
                "this model's tokenizer has no chat template (no chat_template in \
                 tokenizer_config.json or the GGUF metadata); send a plain prompt instead"
            );
        };
        let env = self
            .chat_env
            .get_or_init(|| chat_environment(source))
            .as_ref()
            .map_err(|e| {
                anyhow!(
                    "the chat template does not compile: {}",
                    crate::untrusted::text(&e.to_string())
                )
            })?;
        let template = env
            .get_template(CHAT_TEMPLATE)
            .map_err(|e| anyhow!("the chat template does not compile: {}", jinja_error(&e)))?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| Value::from(minijinja::value::Serde(m)))
            .collect();
        template
            .render(context! {
                messages => messages,
                tools => tools.map(|t| Value::from(minijinja::value::Serde(t))),
                bos_token => self.bos_token.as_deref().unwrap_or(""),
                eos_token => self.eos_token.as_deref().unwrap_or(""),
                add_generation_prompt => add_generation_prompt,
            })
            .map_err(|e| anyhow!("rendering the chat template failed: {}", jinja_error(&e)))
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// A minijinja error with the chain of its sources, on one line (escaped and cut: it may quote
/// the template, which comes from the model's files).
fn jinja_error(e: &JinjaError) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    crate::untrusted::text(&out)
}

/// JSON as transformers' `tojson` writes it (Python's `json.dumps` with `ensure_ascii=False`):
/// `", "` and `": "` separators, keys in their order, non-ASCII text as it is.
fn python_json(v: &Json) -> String {
    fn string(s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    fn value(v: &Json, out: &mut String) {
        match v {
            Json::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    value(x, out);
                }
                out.push(']');
            }
            Json::Object(o) => {
                out.push('{');
                for (i, (k, x)) in o.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    string(k, out);
                    out.push_str(": ");
                    value(x, out);
                }
                out.push('}');
            }
            Json::String(s) => string(s, out),
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    value(v, &mut out);
    out
}

/// The byte of a SentencePiece byte-fallback piece such as `<0xE6>`.
fn byte_fallback_piece(piece: &str) -> Option<u8> {
    piece
        .strip_prefix("<0x")
        .and_then(|h| h.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        .and_then(|h| u8::from_str_radix(h, 16).ok())
}

/// GPT-2's byte-level alphabet, character to byte: the bytes that are printable stand for
/// themselves, the others are shifted to 256 and up, in order.
fn byte_level_table() -> &'static std::collections::HashMap<char, u8> {
    static TABLE: OnceLock<std::collections::HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut next = 256u32;
        (0..=255u8)
            .map(|b| {
                let c = if printable(b) {
                    char::from(b)
                } else {
                    let c = char::from_u32(next).unwrap_or('\u{FFFD}');
                    next += 1;
                    c
                };
                (c, b)
            })
            .collect()
    })
}

/// Work a chat template may do in one rendering (minijinja's fuel: about one unit per
/// instruction). Real templates use thousands; a template with runaway loops stops with an
/// error instead of holding a thread.
const CHAT_TEMPLATE_FUEL: u64 = 20_000_000;

/// The Jinja environment HF renders chat templates in (`trim_blocks`, `lstrip_blocks`, Python
/// string methods, `raise_exception`), holding the compiled chat template.
fn chat_environment(source: &str) -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| jinja_error(&e))?;
    env.set_syntax(syntax);
    env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // NOTE: transformers' `tojson` is Python's json.dumps (keys in the given order, nothing
    // escaped for HTML, `indent` optional); minijinja's own escapes `<`, `>`, `&` and `'`,
    // which would change the prompts of templates that render tools with it.
    env.add_filter(
        "tojson",
        |v: Value, indent: Option<usize>| -> Result<String, JinjaError> {
            let json: Json = serde_json::to_value(&v)
                .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
            let out = match indent {
                Some(n) => {
                    let pad = vec![b' '; n];
                    let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
                    let mut buf = Vec::new();
                    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
                    serde::Serialize::serialize(&json, &mut ser)
                        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
                    String::from_utf8_lossy(&buf).into_owned()
                }
                None => python_json(&json),
            };
            Ok(out)
        },
    );
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<Value, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_template_owned(CHAT_TEMPLATE, source.to_string())
        .map_err(|e| jinja_error(&e))?;
    Ok(env)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokenizers::AddedToken;
    use tokenizers::models::bpe::{BPE, Vocab};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    /// A tiny byte-level BPE tokenizer: the 256 byte symbols of the GPT-2 ByteLevel alphabet,
    /// a few merges, and the ChatML special tokens (ids 0..=2 like SmolLM2's).
    pub(crate) fn tiny_tokenizer() -> tokenizers::Tokenizer {
        let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        assert_eq!(alphabet.len(), 256);
        let mut tokens: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
        tokens.extend(alphabet.iter().map(|c| c.to_string()));
        // "Ġ" is the byte-level symbol of a space; "Ã" + "©" are the two bytes of "é".
        let merges: Vec<(String, String)> = [
            ("h", "e"),
            ("l", "l"),
            ("he", "ll"),
            ("hell", "o"),
            ("Ġ", "w"),
            ("Ã", "©"),
            ("h", "Ã©"),
            ("hÃ©", "ll"),
            ("Ġ", "t"),
            ("Ġt", "h"),
            ("Ġth", "e"),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        for (a, b) in &merges {
            tokens.push(format!("{a}{b}"));
        }
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .unwrap();
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tk.with_decoder(Some(ByteLevel::default()));
        tk.add_special_tokens(
            specials
                .iter()
                .map(|s| AddedToken::from(*s, true).normalized(false)),
        )
        .unwrap();
        tk
    }

    /// SmolLM2-Instruct's template (ChatML with a default system prompt).
    pub(crate) const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn write_dir(config: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        tiny_tokenizer()
            .save(dir.path().join("tokenizer.json"), false)
            .unwrap();
        if let Some(c) = config {
            std::fs::write(dir.path().join("tokenizer_config.json"), c).unwrap();
        }
        dir
    }

    fn config(template: &str, extra: &str) -> String {
        format!(
            r#"{{"bos_token": "<|im_start|>", "eos_token": {{"content": "<|im_end|>", "special": true}},
                "add_bos_token": false, "chat_template": {}{extra}}}"#,
            serde_json::to_string(template).unwrap()
        )
    }

    #[test]
    fn tokenizer_is_shareable_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }

    #[test]
    fn hf_dir_renders_chatml() {
        let dir = write_dir(Some(&config(CHATML, "")));
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        assert!(tok.has_chat_template());
        assert_eq!(tok.bos_token_id(), Some(1));
        assert_eq!(tok.eos_token_id(), Some(2));
        assert_eq!(tok.vocab_size(), 3 + 256 + 11);
        let msgs = [
            ChatMessage::new("user", "hello"),
            ChatMessage::new("assistant", "hi there"),
            ChatMessage::new("user", "the end"),
        ];
        let prompt = tok.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nhello<|im_end|>\n\
             <|im_start|>assistant\nhi there<|im_end|>\n\
             <|im_start|>user\nthe end<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        // With a system message, no default one; no generation prompt.
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "hello"),
        ];
        assert_eq!(
            tok.apply_chat_template(&msgs, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
        );
        // Special tokens in the text become single ids; text between them is BPE-merged.
        let ids = tok.encode("<|im_start|>user\nhello<|im_end|>").unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(*ids.last().unwrap(), 2);
        // [<|im_start|>, u, s, e, r, Ċ, hello, <|im_end|>]
        assert_eq!(ids.len(), 8, "{ids:?}");
        assert_eq!(tok.id_to_token(ids[6]).as_deref(), Some("hello"));
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            "<|im_start|>user\nhello<|im_end|>"
        );
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhello");
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    }

    #[test]
    fn bos_is_prepended_only_when_asked_and_missing() {
        let inner = tiny_tokenizer;
        let tok = Tokenizer::from_parts(inner(), None, Some("<|endoftext|>".into()), None, true);
        assert_eq!(tok.bos_token_id(), Some(0));
        assert_eq!(tok.encode("hello").unwrap()[0], 0);
        let ids = tok.encode("<|endoftext|>hello").unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == 0).count(), 1);
        assert_eq!(ids[0], 0);
        let tok = Tokenizer::from_parts(inner(), None, Some("<|endoftext|>".into()), None, false);
        assert_ne!(tok.encode("hello").unwrap()[0], 0);
        assert!(tok.encode("").unwrap().is_empty());
    }

    #[test]
    fn python_string_methods_and_namespace() {
        let t = "{% for m in messages %}[{{ m['role'] | upper }}:{{ m['content'].strip() }}]{% endfor %}\
                 {% if messages[0].content.startswith(' x') %}S{% endif %}{{ bos_token }}|{{ eos_token }}";
        let dir = write_dir(Some(&config(t, "")));
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        let out = tok
            .apply_chat_template(&[ChatMessage::new("user", " x y \n")], false)
            .unwrap();
        assert_eq!(out, "[USER:x y]S<|im_start|>|<|im_end|>");
    }

    #[test]
    fn raise_exception_is_an_error_with_its_message() {
        let t = "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}\
                 {{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}\
                 {{ m['content'] }}{% endfor %}";
        let dir = write_dir(Some(&config(t, "")));
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        assert_eq!(
            tok.apply_chat_template(&[ChatMessage::new("user", "ok")], false)
                .unwrap(),
            "ok"
        );
        let err = tok
            .apply_chat_template(&[ChatMessage::new("tool", "x")], false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Only user and assistant roles are supported!"),
            "{err}"
        );
    }

    #[test]
    fn template_list_takes_default_and_token_objects() {
        let cfg = r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}],
                     "bos_token": {"content": "<|endoftext|>"}, "eos_token": null}"#;
        let dir = write_dir(Some(cfg));
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        assert_eq!(
            tok.apply_chat_template(&[ChatMessage::new("user", "a")], true)
                .unwrap(),
            "D1"
        );
        assert_eq!(tok.bos_token_id(), Some(0));
        assert_eq!(tok.eos_token_id(), None);
        // No add_bos_token and a post-processor that adds nothing: no BOS.
        assert!(!tok.add_bos_token());
    }

    #[test]
    fn no_template_is_a_clear_error() {
        let dir = write_dir(None);
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        assert!(!tok.has_chat_template());
        assert_eq!(tok.eos_token_id(), None);
        let err = tok
            .apply_chat_template(&[ChatMessage::new("user", "a")], true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no chat template"), "{err}");
        // chat_template.jinja is picked up when the config has none.
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "J{{ add_generation_prompt }}",
        )
        .unwrap();
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        // Booleans print the Python way, as in HF's Jinja.
        assert_eq!(tok.apply_chat_template(&[], true).unwrap(), "JTrue");
    }

    #[test]
    fn broken_templates_are_errors() {
        let dir = write_dir(Some(&config("{% for m in messages %}", "")));
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        let err = tok.apply_chat_template(&[], true).unwrap_err().to_string();
        assert!(err.contains("does not compile"), "{err}");
    }

    #[test]
    fn missing_or_invalid_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!("{:#}", Tokenizer::from_hf_dir(dir.path()).unwrap_err());
        assert!(
            err.contains("tokenizer.json") && err.contains("not found"),
            "{err}"
        );

        std::fs::write(dir.path().join("tokenizer.json"), "{ not json").unwrap();
        let err = format!("{:#}", Tokenizer::from_hf_dir(dir.path()).unwrap_err());
        assert!(
            err.contains("tokenizer.json") && err.contains("not a valid tokenizer"),
            "{err}"
        );

        let dir = write_dir(Some("{ nope"));
        let err = format!("{:#}", Tokenizer::from_hf_dir(dir.path()).unwrap_err());
        assert!(
            err.contains("tokenizer_config.json") && err.contains("invalid JSON"),
            "{err}"
        );

        let dir = write_dir(Some(r#"{"add_bos_token": "yes"}"#));
        let err = format!("{:#}", Tokenizer::from_hf_dir(dir.path()).unwrap_err());
        assert!(
            err.contains("tokenizer_config.json") && err.contains("add_bos_token"),
            "{err}"
        );

        let dir = write_dir(Some(r#"{"chat_template": 3}"#));
        let err = format!("{:#}", Tokenizer::from_hf_dir(dir.path()).unwrap_err());
        assert!(err.contains("chat_template"), "{err}");

        let missing = Path::new("/nonexistent/pagoda/model");
        let err = format!("{:#}", Tokenizer::from_hf_dir(missing).unwrap_err());
        assert!(
            err.contains("/nonexistent/pagoda/model/tokenizer.json"),
            "{err}"
        );
    }

    #[test]
    fn token_bytes_are_the_real_bytes_of_partial_characters() {
        let tok = Tokenizer::from_parts(tiny_tokenizer(), None, None, None, false);
        // "é" is the bytes c3 a9, one merged token; each byte alone is a token too.
        let ids = tok.encode("hé").unwrap();
        assert_eq!(ids.len(), 1);
        assert_eq!(tok.token_bytes(ids[0]), "hé".as_bytes());
        let c3 = tok.token_to_id("Ã").unwrap();
        let a9 = tok.token_to_id("©").unwrap();
        assert_eq!(tok.decode(&[c3], false).unwrap(), "\u{FFFD}");
        assert_eq!(tok.token_bytes(c3), [0xc3]);
        assert_eq!(tok.token_bytes(a9), [0xa9]);
        // Printable bytes and the shifted ones ("Ġ" is a space).
        assert_eq!(tok.token_bytes(tok.token_to_id("Ġ").unwrap()), b" ");
        assert_eq!(tok.token_bytes(tok.token_to_id("h").unwrap()), b"h");
        // The longest piece: "<|endoftext|>", 13 characters, under the floor of 16.
        assert_eq!(tok.max_token_bytes(), 16);
    }

    #[test]
    fn runaway_templates_run_out_of_fuel() {
        let t = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
        let dir = write_dir(Some(&config(t, "")));
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        let err = tok
            .apply_chat_template(&[ChatMessage::new("user", "x")], false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("fuel"), "{err}");
    }
}
