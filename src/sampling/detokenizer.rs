//! Incremental detokenization: text deltas as tokens arrive.
//!
//! Decoding one token at a time is wrong in two ways: a UTF-8 character can span several
//! byte-level tokens (each alone decodes to U+FFFD), and some decoders change text depending on
//! its neighbours (SentencePiece's Metaspace drops the space of the first token). So, like
//! vLLM and TGI, we decode a small window twice and emit the difference:
//!
//! ```text
//!   ids:    ... | p0  p1  p2 | r0  r1      window = ids[prefix_offset..]
//!                 ^prefix_offset ^read_offset
//!   prefix_text = decode(ids[prefix_offset..read_offset])   (already emitted)
//!   new_text    = decode(ids[prefix_offset..])
//!   emit new_text[len(prefix_text)..] unless it ends in U+FFFD (an incomplete character);
//!   then prefix_offset = read_offset, read_offset = len(ids).
//! ```

use std::sync::Arc;

use crate::tokenizer::Tokenizer;

/// Prompt tokens kept as left context for the first decode (vLLM uses 5 too).
const INITIAL_CONTEXT: usize = 5;

const REPLACEMENT: char = '\u{FFFD}';

/// Streams text as tokens arrive; never emits broken UTF-8 (holds back while the decoded tail
/// ends in U+FFFD) and handles decoders that change earlier text with the vLLM/TGI
/// prefix_offset / read_offset window.
pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    /// The window: `ids[0]` is at prefix_offset (older ids are dropped).
    ids: Vec<u32>,
    /// read_offset, relative to the window.
    read_offset: usize,
}

impl IncrementalDetokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>, prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        let start = prompt_ids.len().saturating_sub(INITIAL_CONTEXT);
        let ids = prompt_ids[start..].to_vec();
        let read_offset = ids.len();
        Self {
            tokenizer,
            skip_special_tokens,
            ids,
            read_offset,
        }
    }

    /// Adds one generated token; returns the text that is now complete (maybe empty).
    pub fn push(&mut self, token_id: u32) -> anyhow::Result<String> {
        self.ids.push(token_id);
        self.emit(false)
    }

    /// The text held back when the output ends inside a character (a limit cut it there): the
    /// incomplete character as U+FFFD, as a lossy decode shows it, so that the text has a
    /// character for every token whose bytes it holds (and log-prob offsets point into it).
    pub fn finish(&mut self) -> anyhow::Result<String> {
        self.emit(true)
    }

    fn emit(&mut self, last: bool) -> anyhow::Result<String> {
        let skip = self.skip_special_tokens;
        let prefix_text = self.tokenizer.decode(&self.ids[..self.read_offset], skip)?;
        let new_text = self.tokenizer.decode(&self.ids, skip)?;
        if new_text.len() <= prefix_text.len() || (!last && new_text.ends_with(REPLACEMENT)) {
            // Nothing new yet (a skipped special token), or a character is incomplete: wait.
            return Ok(String::new());
        }
        // Normally new_text starts with prefix_text. When it does not (the prompt's tail ended
        // inside a character that this token completes), emit from where they first differ.
        let start = if new_text.starts_with(&prefix_text) {
            prefix_text.len()
        } else {
            common_prefix_len(&prefix_text, &new_text)
        };
        let delta = new_text.get(start..).unwrap_or_default().to_string();
        // Slide the window: prefix_offset = read_offset, read_offset = end.
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
        Ok(delta)
    }
}

/// Byte length of the longest common prefix of `a` and `b` that ends on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map_or_else(|| a.len().min(b.len()), |((i, _), _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::tiny_tokenizer;

    fn tiny() -> Arc<Tokenizer> {
        Arc::new(Tokenizer::from_parts(
            tiny_tokenizer(),
            None,
            None,
            Some("<|im_end|>".into()),
            false,
        ))
    }

    fn stream(tok: &Arc<Tokenizer>, prompt: &[u32], ids: &[u32], skip: bool) -> Vec<String> {
        let mut d = IncrementalDetokenizer::new(tok.clone(), prompt, skip);
        ids.iter().map(|&id| d.push(id).unwrap()).collect()
    }

    #[test]
    fn multibyte_text_streams_without_replacement_chars() {
        let tok = tiny();
        let text = "héllo wörld 👋 日本";
        let ids = tok.encode(text).unwrap();
        // Most characters here are split over several byte tokens.
        assert!(ids.len() > text.chars().count(), "{ids:?}");
        for prompt in [vec![], tok.encode("the prompt é").unwrap()] {
            let deltas = stream(&tok, &prompt, &ids, true);
            assert!(
                deltas.iter().all(|d| !d.contains(REPLACEMENT)),
                "{deltas:?}"
            );
            assert_eq!(deltas.concat(), tok.decode(&ids, true).unwrap());
            assert_eq!(deltas.concat(), text);
            // Held back while incomplete: some pushes give nothing.
            assert!(deltas.iter().any(|d| d.is_empty()));
        }
    }

    #[test]
    fn special_tokens_are_skipped_or_kept() {
        let tok = tiny();
        let mut ids = tok.encode("hello").unwrap();
        ids.push(2); // <|im_end|>
        ids.extend(tok.encode(" the").unwrap());
        assert_eq!(stream(&tok, &[], &ids, true).concat(), "hello the");
        assert_eq!(
            stream(&tok, &[], &ids, false).concat(),
            "hello<|im_end|> the"
        );
    }

    #[test]
    fn metaspace_spaces_come_from_the_window() {
        // A SentencePiece-style decoder drops the leading space of the first token it sees, so
        // decoding token by token would lose every space.
        use tokenizers::decoders::metaspace::Metaspace;
        use tokenizers::models::bpe::{BPE, Vocab};
        let vocab: Vocab = ["▁Say", "▁Hello", "▁world", "!"]
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, vec![])
            .build()
            .unwrap();
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_decoder(Some(Metaspace::default()));
        let tok = Arc::new(Tokenizer::from_parts(inner, None, None, None, false));
        assert_eq!(tok.decode(&[1], true).unwrap(), "Hello");
        assert_eq!(
            stream(&tok, &[], &[1, 2, 3], true),
            ["Hello", " world", "!"]
        );
        assert_eq!(
            stream(&tok, &[0], &[1, 2, 3], true),
            [" Hello", " world", "!"]
        );
    }

    #[test]
    fn prompt_ending_inside_a_character() {
        let tok = tiny();
        let ids = tok.encode("日本").unwrap(); // 6 byte tokens
        assert_eq!(ids.len(), 6);
        // The prompt holds the first byte of 日; the output completes it.
        let deltas = stream(&tok, &ids[..1], &ids[1..], true);
        assert!(
            deltas.iter().all(|d| !d.contains(REPLACEMENT)),
            "{deltas:?}"
        );
        assert_eq!(deltas.concat(), "日本");
    }

    #[test]
    fn an_output_cut_inside_a_character_ends_in_a_replacement() {
        let tok = tiny();
        let ids = tok.encode("日本").unwrap(); // 6 byte tokens
        let mut d = IncrementalDetokenizer::new(tok.clone(), &[], true);
        let text: String = ids[..4].iter().map(|&id| d.push(id).unwrap()).collect();
        assert_eq!(text, "日");
        assert_eq!(d.finish().unwrap(), REPLACEMENT.to_string());
        assert_eq!(d.finish().unwrap(), "", "given once");
        // Nothing held back: nothing more.
        let mut d = IncrementalDetokenizer::new(tok.clone(), &[], true);
        ids.iter().for_each(|&id| drop(d.push(id).unwrap()));
        assert_eq!(d.finish().unwrap(), "");
    }

    #[test]
    fn unknown_ids_do_not_fail() {
        let tok = tiny();
        let a = tok.token_to_id("a").unwrap();
        let deltas = stream(&tok, &[u32::MAX], &[u32::MAX, a, 1 << 20], true);
        assert_eq!(deltas.concat(), "a");
    }
}
