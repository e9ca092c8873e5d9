//! Models served for embeddings or scores (`--task embed`, `--task score`): what the last stage
//! returns per row in place of the logits ([`OutputHead`]), and how the engine pools a prompt's
//! rows into its one result ([`Pooler`]). Read from the model's files: sentence-transformers'
//! `modules.json`, `1_Pooling/config.json` and `Normalize` for embeddings; a
//! `*ForSequenceClassification` checkpoint's `score.weight`, or the LM head's rows of chosen
//! tokens (`classifier_from_token`: Qwen3-Reranker's "no" and "yes"), for scores.

use super::config::ModelConfig;
use super::loader::WeightSource;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::Path;

/// What a server or an `LLM` is for (vLLM's `--task`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Task {
    #[default]
    Generate,
    /// One vector per input (`/v1/embeddings`).
    Embed,
    /// One relevance score per (query, document) pair (`/v1/score`, `/v1/rerank`).
    Score,
}

impl Task {
    pub fn parse(s: &str) -> Result<Task> {
        Ok(match s {
            "generate" => Task::Generate,
            "embed" | "embedding" => Task::Embed,
            "score" | "rerank" | "classify" => Task::Score,
            _ => bail!("unknown task '{s}' (generate, embed, score)"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Task::Generate => "generate",
            Task::Embed => "embed",
            Task::Score => "score",
        }
    }
}

/// Which of a prompt's rows make its result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolingType {
    /// The mean of every row.
    Mean,
    /// The first row.
    Cls,
    /// The last row.
    Last,
}

impl PoolingType {
    pub fn parse(s: &str) -> Result<PoolingType> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "mean" => PoolingType::Mean,
            "cls" => PoolingType::Cls,
            "last" | "lasttoken" => PoolingType::Last,
            _ => bail!("unknown pooling type '{s}' (mean, cls, last)"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            PoolingType::Mean => "mean",
            PoolingType::Cls => "cls",
            PoolingType::Last => "last",
        }
    }
}

/// What the last stage returns for each row it is asked for.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum OutputHead {
    /// The logits over the vocabulary (generation).
    #[default]
    Logits,
    /// The final norm's output `[R, hidden]` (embeddings).
    Hidden,
    /// The checkpoint's classifier `score.weight` `[labels, hidden]`.
    Classifier,
    /// A one-label classifier made of the LM head's rows of these tokens: `[b] - [a]` for two
    /// (NOTE: the sigmoid of the difference is the softmax over the two tokens' logits, which
    /// is how Qwen3-Reranker scores), the row itself for one.
    TokenClassifier(Vec<u32>),
}

/// How the engine makes a prompt's result of its rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Pooler {
    pub task: Task,
    pub pooling: PoolingType,
    /// L2-normalize the pooled vector (sentence-transformers' `Normalize` module).
    pub normalize: bool,
    /// A sigmoid over the one label (scores).
    pub sigmoid: bool,
    /// The lengths a request may cut its embedding to (Matryoshka models): `None`, no cut; an
    /// empty list, any length.
    pub matryoshka: Option<Vec<usize>>,
    pub head: OutputHead,
    /// The length of the head's rows (the hidden size, or the labels).
    pub width: usize,
}

/// The model a [`Pooler`] is read for: its path (a GGUF file or an HF directory), config,
/// tokenizer and weights.
pub struct ModelFiles<'a> {
    pub path: &'a Path,
    pub config: &'a ModelConfig,
    pub tokenizer: &'a Tokenizer,
    pub weights: &'a dyn WeightSource,
}

/// How `model` is served for `task` (`None` for generation): `pooling` overrides the model's
/// pooling, `from_tokens` its `classifier_from_token`.
pub fn pooler(
    model: &ModelFiles,
    task: Task,
    pooling: Option<PoolingType>,
    from_tokens: Option<&[String]>,
) -> Result<Option<Pooler>> {
    let dir = model.path.is_dir().then_some(model.path);
    let config = match dir {
        Some(d) => read_json(&d.join("config.json"))?,
        None => Value::Null,
    };
    match task {
        Task::Generate => {
            if pooling.is_some() || from_tokens.is_some() {
                bail!("--pooling-type and --classifier-from-token go with --task embed or score");
            }
            Ok(None)
        }
        Task::Embed => {
            if from_tokens.is_some() {
                bail!("--classifier-from-token goes with --task score");
            }
            let (found, normalize) = match dir {
                Some(d) => sentence_transformers(d)?,
                None => (gguf_pooling(model.path)?, true),
            };
            let pooling = match (pooling, found) {
                (Some(p), _) | (None, Some(p)) => p,
                // NOTE: Qwen3-Embedding's way, and what decoder models without
                // sentence-transformers files are trained for, if anything.
                (None, None) => PoolingType::Last,
            };
            let matryoshka = match (&config["is_matryoshka"], &config["matryoshka_dimensions"]) {
                (_, Value::Array(dims)) => Some(
                    dims.iter()
                        .map(|d| d.as_u64().map(|d| d as usize))
                        .collect::<Option<Vec<_>>>()
                        .context("matryoshka_dimensions in config.json is not a list of sizes")?,
                ),
                (Value::Bool(true), _) => Some(Vec::new()),
                _ => None,
            };
            Ok(Some(Pooler {
                task,
                pooling,
                normalize,
                sigmoid: false,
                matryoshka,
                head: OutputHead::Hidden,
                width: model.config.hidden_size,
            }))
        }
        Task::Score => {
            let named: Option<Vec<String>> = match from_tokens {
                Some(t) => Some(t.to_vec()),
                None => match &config["classifier_from_token"] {
                    Value::Null => None,
                    v => Some(serde_json::from_value(v.clone()).context(
                        "classifier_from_token in config.json is not a list of strings",
                    )?),
                },
            };
            let head = match named {
                Some(names) => {
                    if names.is_empty() || names.len() > 2 {
                        bail!(
                            "a classifier from tokens takes one or two tokens (as \"no\",\"yes\"), got {}",
                            names.len()
                        );
                    }
                    let ids = names
                        .iter()
                        .map(|n| token_id(model, n))
                        .collect::<Result<Vec<u32>>>()?;
                    OutputHead::TokenClassifier(ids)
                }
                None => match model.weights.shape("score.weight")? {
                    Some(s) if s.len() == 2 && s[0] == 1 => OutputHead::Classifier,
                    Some(s) => bail!(
                        "the classifier score.weight has shape {s:?}: scores and reranking take a \
                         model with one label (a cross-encoder)"
                    ),
                    None => bail!(
                        "--task score needs a classifier: a *ForSequenceClassification \
                         checkpoint (score.weight), or the tokens whose logits score \
                         (--classifier-from-token no,yes, or classifier_from_token in config.json)"
                    ),
                },
            };
            Ok(Some(Pooler {
                task,
                // NOTE: as transformers' *ForSequenceClassification: the last token's row.
                pooling: pooling.unwrap_or(PoolingType::Last),
                normalize: false,
                sigmoid: true,
                matryoshka: None,
                head,
                width: 1,
            }))
        }
    }
}

/// The id of the token `name`: a piece of the vocabulary, or a text that is one token.
fn token_id(model: &ModelFiles, name: &str) -> Result<u32> {
    if let Some(id) = model.tokenizer.token_to_id(name) {
        return Ok(id);
    }
    match model.tokenizer.encode_plain(name)?.as_slice() {
        [id] => Ok(*id),
        ids => bail!(
            "classifier token '{}' is not one token of the vocabulary (it encodes to {} tokens)",
            crate::untrusted::text(name),
            ids.len()
        ),
    }
}

/// A GGUF's `{arch}.pooling_type` (llama.cpp's: 0 none, 1 mean, 2 CLS, 3 last, 4 rank).
fn gguf_pooling(path: &Path) -> Result<Option<PoolingType>> {
    let g = super::gguf::GgufFile::open(path)?;
    let key = format!("{}.pooling_type", g.architecture()?);
    llama_cpp_pooling(g.meta_usize(&key)?)
}

fn llama_cpp_pooling(code: Option<usize>) -> Result<Option<PoolingType>> {
    Ok(match code {
        None | Some(0) => None,
        Some(1) => Some(PoolingType::Mean),
        Some(2) => Some(PoolingType::Cls),
        Some(3) => Some(PoolingType::Last),
        Some(4) => bail!(
            "the GGUF's pooling type is rank (a reranker's classifier head, which is not \
             supported); a decoder reranker scores with --task score --classifier-from-token"
        ),
        Some(n) => bail!("the GGUF's pooling type {n} is unknown"),
    })
}

fn read_json(path: &Path) -> Result<Value> {
    if !crate::untrusted::optional_regular_file(path)? {
        return Ok(Value::Null);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// The pooling and normalization of a sentence-transformers model directory (`None` and
/// `true` where it has no `modules.json`). Modules other than the transformer, one pooling
/// and a normalization are refused: their results would not be the model's.
fn sentence_transformers(dir: &Path) -> Result<(Option<PoolingType>, bool)> {
    let modules = read_json(&dir.join("modules.json"))?;
    let Value::Array(modules) = modules else {
        if modules.is_null() {
            return Ok((None, true));
        }
        bail!("modules.json is not a list of modules");
    };
    let (mut pooling, mut normalize) = (None, false);
    for m in &modules {
        let ty = m["type"].as_str().unwrap_or_default();
        let kind = ty.rsplit('.').next().unwrap_or_default();
        match kind {
            "Transformer" => {}
            "Normalize" => normalize = true,
            "Pooling" => {
                let sub = m["path"].as_str().unwrap_or_default();
                if sub.contains("..") || sub.starts_with('/') {
                    bail!("modules.json: the pooling module's path leaves the model directory");
                }
                let cfg = read_json(&dir.join(sub).join("config.json"))?;
                pooling =
                    Some(pooling_mode(&cfg).with_context(|| format!("in {sub}/config.json"))?);
            }
            _ => bail!(
                "the sentence-transformers module '{}' is not supported (Transformer, Pooling and \
                 Normalize are)",
                crate::untrusted::text(ty)
            ),
        }
    }
    Ok((pooling, normalize))
}

/// The one pooling mode of a sentence-transformers `Pooling` config: `pooling_mode` (a name,
/// or a list of them, in sentence-transformers 6) or the `pooling_mode_*` flags (before it).
fn pooling_mode(cfg: &Value) -> Result<PoolingType> {
    if cfg["include_prompt"] == Value::Bool(false) {
        bail!("include_prompt: false is not supported");
    }
    let mut modes: Vec<String> = match &cfg["pooling_mode"] {
        Value::String(m) => vec![m.clone()],
        Value::Array(ms) => ms
            .iter()
            .filter_map(|m| m.as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    };
    if let Value::Object(flags) = cfg {
        for (k, v) in flags {
            if let (Some(m), Some(true)) = (k.strip_prefix("pooling_mode_"), v.as_bool()) {
                modes.push(m.to_string());
            }
        }
    }
    let modes: Vec<PoolingType> = modes
        .iter()
        .map(|m| match m.as_str() {
            "mean" | "mean_tokens" => Ok(PoolingType::Mean),
            "cls" | "cls_token" => Ok(PoolingType::Cls),
            "lasttoken" | "last" => Ok(PoolingType::Last),
            other => bail!(
                "pooling mode '{}' is not supported (mean, cls and last-token pooling are)",
                crate::untrusted::text(other)
            ),
        })
        .collect::<Result<_>>()?;
    match modes.as_slice() {
        [p] => Ok(*p),
        [] => bail!("no pooling mode is on"),
        _ => bail!("several pooling modes are on (their concatenation is not supported)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pooling_modes_are_read_and_the_unsupported_refused() {
        let mean = json!({"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": false});
        assert_eq!(pooling_mode(&mean).unwrap(), PoolingType::Mean);
        let cls = json!({"pooling_mode_cls_token": true});
        assert_eq!(pooling_mode(&cls).unwrap(), PoolingType::Cls);
        let last = json!({"pooling_mode_lasttoken": true});
        assert_eq!(pooling_mode(&last).unwrap(), PoolingType::Last);
        let max = json!({"pooling_mode_max_tokens": true});
        assert!(format!("{:#}", pooling_mode(&max).unwrap_err()).contains("max_tokens"));
        // sentence-transformers 6 names the mode
        let v6 = json!({"embedding_dimension": 32, "pooling_mode": "lasttoken"});
        assert_eq!(pooling_mode(&v6).unwrap(), PoolingType::Last);
        let v6 = json!({"pooling_mode": ["mean", "max"]});
        assert!(format!("{:#}", pooling_mode(&v6).unwrap_err()).contains("'max'"));
        let two = json!({"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true});
        assert!(format!("{:#}", pooling_mode(&two).unwrap_err()).contains("several"));
        assert!(pooling_mode(&json!({})).is_err());
    }

    #[test]
    fn sentence_transformers_modules_are_read_and_the_unknown_refused() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(sentence_transformers(d.path()).unwrap(), (None, true));
        let write = |p: &str, v: Value| {
            let path = d.path().join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, v.to_string()).unwrap();
        };
        let module = |ty: &str, path: &str| json!({"type": format!("sentence_transformers.models.{ty}"), "path": path});
        write(
            "1_Pooling/config.json",
            json!({"pooling_mode_cls_token": true}),
        );
        write(
            "modules.json",
            json!([module("Transformer", ""), module("Pooling", "1_Pooling")]),
        );
        assert_eq!(
            sentence_transformers(d.path()).unwrap(),
            (Some(PoolingType::Cls), false)
        );
        write(
            "modules.json",
            json!([
                module("Transformer", ""),
                module("Pooling", "1_Pooling"),
                module("Dense", "2_Dense")
            ]),
        );
        let e = format!("{:#}", sentence_transformers(d.path()).unwrap_err());
        assert!(e.contains("Dense") && e.contains("not supported"), "{e}");
        write("modules.json", json!([module("Pooling", "../elsewhere")]));
        assert!(sentence_transformers(d.path()).is_err());
    }

    #[test]
    fn llama_cpp_pooling_codes() {
        assert_eq!(llama_cpp_pooling(None).unwrap(), None);
        assert_eq!(llama_cpp_pooling(Some(1)).unwrap(), Some(PoolingType::Mean));
        assert_eq!(llama_cpp_pooling(Some(2)).unwrap(), Some(PoolingType::Cls));
        assert_eq!(llama_cpp_pooling(Some(3)).unwrap(), Some(PoolingType::Last));
        assert!(llama_cpp_pooling(Some(4)).is_err());
        assert!(llama_cpp_pooling(Some(9)).is_err());
    }

    #[test]
    fn names_parse() {
        assert_eq!(Task::parse("embed").unwrap(), Task::Embed);
        assert_eq!(Task::parse("rerank").unwrap(), Task::Score);
        assert!(Task::parse("draw").is_err());
        assert_eq!(PoolingType::parse("LASTTOKEN").unwrap(), PoolingType::Last);
        assert!(PoolingType::parse("max").is_err());
    }
}
