//! Fill-in-the-middle: the special tokens a code model was trained with to write the middle of
//! a file between its prefix and its suffix, found by their text in the vocabulary (as llama.cpp
//! finds them when a GGUF does not name their ids), and the prompt laid out as llama.cpp's
//! `/infill` lays it out:
//!
//! ```text
//!   [REPO "myproject\n"] ([SEP "name\n"] text)* [SEP "filename\n"]   the project (/infill)
//!   [BOS] PRE prefix prompt SUF suffix MID                            the model writes the middle
//! ```
//!
//! OpenAI's `suffix` takes the second line alone (a file-level completion). The texts are
//! tokenized literally (`Tokenizer::encode_literal`), as llama.cpp does: code that contains
//! `<|fim_middle|>` or `<|im_end|>` as text cannot end the prefix early or stop the answer.

use super::Tokenizer;

/// A model's fill-in-the-middle tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fim {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    /// Starts the repository's name before other files (Qwen2.5-Coder's `<|repo_name|>`).
    pub repo: Option<u32>,
    /// Starts each other file (Qwen2.5-Coder's `<|file_sep|>`).
    pub file_sep: Option<u32>,
}

/// The names of (prefix, suffix, middle) by model family.
const TRIPLES: &[[&str; 3]] = &[
    // Qwen2.5-Coder, CodeGemma
    ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
    // StarCoder 1 and 2, SantaCoder, Granite code
    ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
    ["<fim-prefix>", "<fim-suffix>", "<fim-middle>"],
    // DeepSeek-Coder
    ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
    // CodeLlama (SentencePiece writes its space in front)
    ["▁<PRE>", "▁<SUF>", "▁<MID>"],
    ["<PRE>", "<SUF>", "<MID>"],
];
const REPO: &[&str] = &["<|repo_name|>", "<repo_name>", "<reponame>"];
const FILE_SEP: &[&str] = &["<|file_sep|>", "<file_sep>"];

/// Separates other files when the model has no file separator token (llama.cpp's).
const CHUNK_SEPARATOR: &str = "\n\n--- snippet ---\n\n";

impl Fim {
    /// The tokens of `tok`'s model, if it has all three.
    pub fn of(tok: &Tokenizer) -> Option<Fim> {
        let id = |names: &[&str]| names.iter().find_map(|n| tok.token_to_id(n));
        TRIPLES.iter().find_map(|[p, s, m]| {
            Some(Fim {
                prefix: tok.token_to_id(p)?,
                suffix: tok.token_to_id(s)?,
                middle: tok.token_to_id(m)?,
                repo: id(REPO),
                file_sep: id(FILE_SEP),
            })
        })
    }

    /// The prompt's ids for writing what goes between `prefix` (then `prompt`, llama.cpp's text
    /// typed after the prefix) and `suffix`; with `project` (other files, `(name, text)`), the
    /// project comes first, as llama.cpp's `/infill` puts it.
    pub fn prompt(
        &self,
        tok: &Tokenizer,
        prefix: &str,
        prompt: &str,
        suffix: &str,
        project: Option<&[(String, String)]>,
    ) -> anyhow::Result<Vec<u32>> {
        Ok(self
            .prompt_within(tok, prefix, prompt, suffix, project, usize::MAX)?
            .0)
    }

    /// [`Fim::prompt`] cut to at most `budget` tokens where it is longer, as llama.cpp cuts an
    /// editor's context: other files go first (the earliest first), then the prefix loses its
    /// start and the suffix its end, the prefix keeping three quarters of what is left. The
    /// flag says whether anything was cut. Fails when the special tokens and `prompt` alone do
    /// not fit.
    pub fn prompt_within(
        &self,
        tok: &Tokenizer,
        prefix: &str,
        prompt: &str,
        suffix: &str,
        project: Option<&[(String, String)]>,
        budget: usize,
    ) -> anyhow::Result<(Vec<u32>, bool)> {
        let mut extra = Vec::new();
        if let Some(files) = project {
            self.project(tok, files, &mut extra)?;
        }
        let bos = tok.bos_token_id().filter(|_| tok.add_bos_token());
        let prefix = tok.encode_literal(prefix)?;
        let prompt = tok.encode_literal(prompt)?;
        let suffix = tok.encode_literal(suffix)?;
        let fixed = 3 + usize::from(bos.is_some()) + prompt.len();
        let Some(room) = budget.checked_sub(fixed) else {
            anyhow::bail!(
                "the fill-in-the-middle prompt needs {fixed} tokens before any prefix or suffix, more than the {budget} it may have"
            );
        };
        let code = prefix.len() + suffix.len();
        let take_extra = extra.len().min(room.saturating_sub(code));
        let room = room - take_extra;
        let (take_prefix, take_suffix) = if code <= room {
            (prefix.len(), suffix.len())
        } else {
            let p = prefix
                .len()
                .min((room * 3 / 4).max(room.saturating_sub(suffix.len())));
            (p, suffix.len().min(room - p))
        };
        let truncated = take_extra < extra.len() || take_prefix + take_suffix < code;
        let mut ids = Vec::with_capacity(fixed + take_extra + take_prefix + take_suffix);
        ids.extend_from_slice(&extra[extra.len() - take_extra..]);
        ids.extend(bos);
        ids.push(self.prefix);
        ids.extend_from_slice(&prefix[prefix.len() - take_prefix..]);
        ids.extend(prompt);
        ids.push(self.suffix);
        ids.extend_from_slice(&suffix[..take_suffix]);
        ids.push(self.middle);
        Ok((ids, truncated))
    }

    fn project(
        &self,
        tok: &Tokenizer,
        files: &[(String, String)],
        ids: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        if let Some(repo) = self.repo {
            ids.push(repo);
            ids.extend(tok.encode_literal("myproject\n")?);
        }
        for (name, text) in files {
            match self.file_sep {
                Some(sep) => {
                    ids.push(sep);
                    ids.extend(tok.encode_literal(&format!("{name}\n"))?);
                }
                None => ids.extend(tok.encode_literal(CHUNK_SEPARATOR)?),
            }
            ids.extend(tok.encode_literal(text)?);
        }
        if let Some(sep) = self.file_sep {
            // NOTE: llama.cpp names the file being edited "filename" (it has no name for it).
            ids.push(sep);
            ids.extend(tok.encode_literal("filename\n")?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::AddedToken;

    /// The tiny tokenizer with Qwen2.5-Coder's FIM tokens as special tokens.
    fn coder(add_bos: bool) -> (Tokenizer, [u32; 5]) {
        let mut inner = crate::tokenizer::tests::tiny_tokenizer();
        let names = [
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ];
        inner
            .add_special_tokens(names.map(|n| AddedToken::from(n, true).normalized(false)))
            .unwrap();
        let ids = names.map(|n| inner.token_to_id(n).unwrap());
        let tok = Tokenizer::from_parts(
            inner,
            None,
            Some("<|endoftext|>".into()),
            Some("<|im_end|>".into()),
            add_bos,
        );
        (tok, ids)
    }

    fn text(tok: &Tokenizer, s: &str) -> Vec<u32> {
        tok.encode_plain(s).unwrap()
    }

    #[test]
    fn found_by_name_or_absent() {
        let (tok, [pre, suf, mid, repo, sep]) = coder(false);
        let fim = Fim::of(&tok).unwrap();
        assert_eq!(
            fim,
            Fim {
                prefix: pre,
                suffix: suf,
                middle: mid,
                repo: Some(repo),
                file_sep: Some(sep),
            }
        );
        let plain = Tokenizer::from_parts(
            crate::tokenizer::tests::tiny_tokenizer(),
            None,
            None,
            None,
            false,
        );
        assert_eq!(Fim::of(&plain), None);
    }

    #[test]
    fn lays_out_the_prompt_as_llama_cpp_infill() {
        let (tok, [pre, suf, mid, repo, sep]) = coder(true);
        let fim = Fim::of(&tok).unwrap();
        let bos = tok.bos_token_id().unwrap();
        // OpenAI's suffix: no project.
        let ids = fim.prompt(&tok, "hello", "", " the", None).unwrap();
        let want: Vec<u32> = [vec![bos, pre], text(&tok, "hello"), vec![suf]]
            .concat()
            .into_iter()
            .chain(text(&tok, " the"))
            .chain([mid])
            .collect();
        assert_eq!(ids, want);
        // /infill: the project first, each file after its separator, then the file edited.
        let files = vec![("a.py".to_string(), "hé".to_string())];
        let ids = fim.prompt(&tok, "he", "ll", "o", Some(&files)).unwrap();
        let want = [
            vec![repo],
            text(&tok, "myproject\n"),
            vec![sep],
            text(&tok, "a.py\n"),
            text(&tok, "hé"),
            vec![sep],
            text(&tok, "filename\n"),
            vec![bos, pre],
            text(&tok, "he"),
            text(&tok, "ll"),
            vec![suf],
            text(&tok, "o"),
            vec![mid],
        ]
        .concat();
        assert_eq!(ids, want);
    }

    #[test]
    fn special_token_text_in_the_code_stays_text() {
        let (tok, [pre, suf, mid, ..]) = coder(false);
        let fim = Fim::of(&tok).unwrap();
        let code = "x = '<|fim_middle|><|im_end|>'";
        let ids = fim.prompt(&tok, code, "", "", None).unwrap();
        let im_end = tok.token_to_id("<|im_end|>").unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == mid).count(), 1, "{ids:?}");
        assert!(!ids.contains(&im_end));
        assert_eq!(
            (ids[0], ids[ids.len() - 2], ids[ids.len() - 1]),
            (pre, suf, mid)
        );
        assert_eq!(tok.decode(&ids[1..ids.len() - 2], false).unwrap(), code);
    }

    #[test]
    fn cut_to_the_budget_as_llama_cpp_cuts() {
        let (tok, [pre, suf, mid, ..]) = coder(false);
        let fim = Fim::of(&tok).unwrap();
        let prefix = "a b c d e f g h";
        let suffix = "1 2 3 4 5 6 7 8";
        let files = vec![("x".to_string(), "y z".to_string())];
        let full = fim.prompt(&tok, prefix, "", suffix, Some(&files)).unwrap();
        let (same, cut) = fim
            .prompt_within(&tok, prefix, "", suffix, Some(&files), full.len())
            .unwrap();
        assert_eq!((same, cut), (full.clone(), false));
        // One token short: the project loses its first token.
        let (ids, cut) = fim
            .prompt_within(&tok, prefix, "", suffix, Some(&files), full.len() - 1)
            .unwrap();
        assert!(cut);
        assert_eq!(ids, full[1..]);
        // Room for 8 tokens of code: no project, the prefix's last 6, the suffix's first 2.
        let (p, s) = (text(&tok, prefix), text(&tok, suffix));
        let (ids, cut) = fim
            .prompt_within(&tok, prefix, "", suffix, Some(&files), 3 + 8)
            .unwrap();
        assert!(cut);
        let want = [
            vec![pre],
            p[p.len() - 6..].to_vec(),
            vec![suf],
            s[..2].to_vec(),
            vec![mid],
        ]
        .concat();
        assert_eq!(ids, want);
        // A short suffix leaves the prefix the rest.
        let (ids, _) = fim
            .prompt_within(&tok, prefix, "", "1", None, 3 + 8)
            .unwrap();
        assert_eq!(
            ids,
            [
                vec![pre],
                p[p.len() - 7..].to_vec(),
                vec![suf],
                text(&tok, "1"),
                vec![mid]
            ]
            .concat()
        );
        // The special tokens and the typed text must fit.
        assert!(
            fim.prompt_within(&tok, prefix, "typed", suffix, None, 3)
                .is_err()
        );
    }
}
