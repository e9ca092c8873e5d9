//! Structured output: the output must match a JSON schema, a regular expression, one of a
//! list of strings, or a Lark grammar. llguidance compiles the constraint against the model's
//! vocabulary into a matcher that, at every step, gives the set of tokens that keep the output
//! on the grammar (the mask the sampler applies) and then consumes the token chosen.

use super::gbnf;
use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredOutput {
    /// JSON valid against this JSON schema.
    Json(serde_json::Value),
    /// Any JSON object (OpenAI's `{"type": "json_object"}`).
    JsonObject,
    /// Text matching this regular expression (whole).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar, in llguidance's dialect, or a GBNF one (llama.cpp's, told apart by its
    /// `::=`; see `gbnf.rs`).
    Grammar(String),
}

impl StructuredOutput {
    /// Checks what can be checked without a vocabulary (the rest fails when compiled).
    pub fn validate(&self) -> Result<(), String> {
        match self {
            StructuredOutput::Json(s) if !(s.is_object() || s.is_boolean()) => {
                Err("a JSON schema must be an object".into())
            }
            StructuredOutput::Regex(r) if r.is_empty() => Err("the regex is empty".into()),
            StructuredOutput::Grammar(g) if g.trim().is_empty() => {
                Err("the grammar is empty".into())
            }
            StructuredOutput::Grammar(g) if gbnf::is_gbnf(g) => gbnf::to_lark(g)
                .map(drop)
                .map_err(|e| format!("GBNF grammar: {e}")),
            StructuredOutput::Choice(c) if c.is_empty() || c.iter().any(String::is_empty) => {
                Err("choice must be a non-empty list of non-empty strings".into())
            }
            _ => Ok(()),
        }
    }

    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            StructuredOutput::Json(schema) => {
                TopLevelGrammar::from_json_schema(with_layout(schema.clone()))
            }
            StructuredOutput::JsonObject => TopLevelGrammar::from_json_schema(with_layout(
                serde_json::json!({"type": "object"}),
            )),
            StructuredOutput::Regex(r) => TopLevelGrammar::from_regex(r),
            StructuredOutput::Choice(choices) => {
                // NOTE: Lark string literals are JSON strings, so serde_json quotes each choice
                // exactly (quotes, backslashes and control characters escaped).
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::Value::from(c.as_str()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            StructuredOutput::Grammar(g) if gbnf::is_gbnf(g) => TopLevelGrammar::from_lark(
                gbnf::to_lark(g).map_err(|e| format!("GBNF grammar: {e}"))?,
            ),
            StructuredOutput::Grammar(g) => TopLevelGrammar::from_lark(g.clone()),
        })
    }
}

/// How generated JSON is laid out: as Python's `json.dumps` writes it (`", "` and `": "`, no
/// other whitespace), unless the schema sets llguidance's own options under `x-guidance`
/// (`whitespace_flexible`, `whitespace_pattern`, the separators).
///
/// NOTE: llguidance lets any whitespace run between JSON tokens by default, and a small model
/// then pads its output with newlines until `max_tokens` runs out; vLLM's
/// `disable_any_whitespace` exists for the same reason.
pub fn with_layout(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut()
        && !o.contains_key(LAYOUT_KEY)
    {
        o.insert(
            LAYOUT_KEY.into(),
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// Where a JSON schema carries llguidance's compile options.
pub const LAYOUT_KEY: &str = "x-guidance";

/// The vocabulary as llguidance sees it: each token's bytes in a trie, and the tokenizer for
/// the text it needs tokenized.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s);
        self.tokenizer
            .inner()
            .encode_fast(text.as_ref(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }
}

/// Compiles constraints for one model: built once (the trie of the vocabulary takes a fraction
/// of a second), shared by every request.
pub struct StructuredCompiler {
    factory: ParserFactory,
}

impl StructuredCompiler {
    /// `vocab_size`: the width of the model's logits (its embedding may be padded past the
    /// tokenizer's vocabulary); `eos`: the tokens that end generation, the first being EOS.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos: &[u32]) -> anyhow::Result<Self> {
        let mut words: Vec<Vec<u8>> = tokenizer
            .vocab_pieces()
            .into_iter()
            .map(|(bytes, special)| {
                if special {
                    // NOTE: toktrie names special tokens by a 0xFF byte, which no UTF-8 text
                    // contains, so that grammars can never produce them from text.
                    let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    b.extend(bytes);
                    b
                } else {
                    bytes
                }
            })
            .collect();
        words.resize(vocab_size, Vec::new());
        let mut info = TokRxInfo::new(words.len() as u32, eos.first().copied().unwrap_or(0));
        info.tok_end_of_turn = eos.get(1).copied();
        let env: TokEnv = Arc::new(Env {
            trie: TokTrie::from(&info, &words),
            tokenizer,
        });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(StructuredCompiler { factory })
    }

    /// A matcher for `c`, or why `c` does not compile.
    pub fn compile(&self, c: &StructuredOutput) -> Result<Matcher, String> {
        c.validate()?;
        let parser = self
            .factory
            .create_parser(c.grammar()?)
            .map_err(|e| format!("{e:#}"))?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(e),
            None => Ok(m),
        }
    }
}

/// The tokens `m` allows next, as a bitmask (bit `i % 32` of word `i / 32` is token `i`); a
/// matcher that has stopped allows only EOS. Fails when the grammar has failed.
pub fn allowed_tokens(m: &mut Matcher) -> Result<toktrie::SimpleVob, String> {
    m.compute_mask_or_eos().map_err(|e| format!("{e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compiler() -> StructuredCompiler {
        let tok = Tokenizer::from_parts(
            crate::tokenizer::tests::tiny_tokenizer(),
            None,
            None,
            Some("<|im_end|>".into()),
            false,
        );
        let n = tok.vocab_size();
        StructuredCompiler::new(Arc::new(tok), n, &[2]).unwrap()
    }

    /// Feeds `text` through a matcher of `c`; whether it is accepted whole.
    fn accepts(c: &StructuredCompiler, g: &StructuredOutput, text: &str) -> bool {
        let mut m = c.compile(g).unwrap();
        let ids = c.factory.tok_env().tokenize(text);
        m.consume_tokens(&ids).is_ok() && m.is_accepting().unwrap_or(false)
    }

    #[test]
    fn gbnf_grammars_compile_and_constrain() {
        let c = compiler();
        let g = StructuredOutput::Grammar(
            r#"root ::= "[" num ("," num){0,2} "]"
num ::= [1-9] [0-9]* | "0"
"#
            .into(),
        );
        assert!(accepts(&c, &g, "[1,20,0]"));
        assert!(!accepts(&c, &g, "[01]"));
        assert!(!accepts(&c, &g, "[1,2,3,4]"));
        let other = StructuredOutput::Grammar(
            "root ::= Word (\" \" Word)?\nWord ::= [^ \\n]+ | \"é\"".into(),
        );
        assert!(accepts(&c, &other, "hello é"));
        assert!(!accepts(&c, &other, "a  b"));
        // Lark stays Lark; a broken GBNF grammar says what is wrong before compiling.
        let lark = StructuredOutput::Grammar("start: \"a\" | \"b\"".into());
        assert!(accepts(&c, &lark, "b"));
        let bad = StructuredOutput::Grammar("root ::= missing".into());
        let e = c.compile(&bad).err().unwrap();
        assert!(e.contains("GBNF") && e.contains("missing"), "{e}");
    }
}
