//! A SentencePiece (BPE) tokenizer from GGUF metadata (`tokenizer.ggml.model == "llama"`:
//! Gemma, Llama 2, Mistral): the pieces, their scores and types. SentencePiece merges the pair
//! whose merged piece scores highest; a BPE whose merges are ranked by that score does the same,
//! so the `tokenizers` crate's BPE runs it (with byte fallback for what no piece covers), as HF's
//! converters for these models do.

use crate::untrusted::text;
use anyhow::{Result, anyhow, bail};
use std::collections::{HashMap, HashSet};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::{AddedToken, Tokenizer};

/// GGUF token types (llama.cpp's `llama_token_type`).
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The merges: for every normal piece of two or more characters, from the highest score down,
/// each split of it into two pieces of the vocabulary (splits ordered by the halves' ids).
///
/// NOTE: a split is looked up only where both halves have the length of some piece: looking up
/// every split hashes O(n²) bytes for a piece of n bytes, and a corrupt file with one piece of a
/// few MB would take hours to load.
fn merges(tokens: &[&str], scores: &[f32], types: &[i64]) -> Vec<(String, String)> {
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let lengths: HashSet<usize> = tokens.iter().map(|t| t.len()).collect();
    let mut pieces: Vec<usize> = (0..tokens.len())
        .filter(|&i| types[i] == NORMAL && tokens[i].chars().nth(1).is_some())
        .collect();
    pieces.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut out = Vec::new();
    for i in pieces {
        let piece = tokens[i];
        let mut splits: Vec<(usize, usize, &str, &str)> = piece
            .char_indices()
            .skip(1)
            .filter(|&(k, _)| lengths.contains(&k) && lengths.contains(&(piece.len() - k)))
            .filter_map(|(k, _)| {
                let (l, r) = piece.split_at(k);
                Some((*ids.get(l)?, *ids.get(r)?, l, r))
            })
            .collect();
        splits.sort();
        out.extend(
            splits
                .into_iter()
                .map(|(_, _, l, r)| (l.to_string(), r.to_string())),
        );
    }
    out
}

/// The tokenizer of SentencePiece pieces with their scores and types; `unk` is the unknown
/// piece's id.
pub fn tokenizer(tokens: &[&str], scores: &[f32], types: &[i64], unk: usize) -> Result<Tokenizer> {
    if scores.len() != tokens.len() || types.len() != tokens.len() {
        bail!(
            "{} pieces, {} scores and {} types: the tokenizer metadata does not agree",
            tokens.len(),
            scores.len(),
            types.len()
        );
    }
    let unk_piece = tokens
        .get(unk)
        .ok_or_else(|| anyhow!("tokenizer.ggml.unknown_token_id {unk} is not a piece"))?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges(tokens, scores, types))
        .unk_token(unk_piece.to_string())
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| {
            anyhow!(
                "cannot build the SentencePiece BPE: {}",
                text(&e.to_string())
            )
        })?;
    let mut tk = Tokenizer::new(bpe);
    let space = |from: &str, to: &str| {
        Replace::new(from, to)
            .map_err(|e| anyhow!("cannot build a replacement: {}", text(&e.to_string())))
    };
    tk.with_normalizer(Some(space(" ", "\u{2581}")?))
        .map_err(|e| anyhow!("cannot set the normalizer: {}", text(&e.to_string())))?;
    tk.with_decoder(Some(Sequence::new(vec![
        DecoderWrapper::Replace(space("\u{2581}", " ")?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ])));
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|&(_, &t)| t == CONTROL || t == USER_DEFINED)
        .map(|(tok, &t)| AddedToken::from(tok.to_string(), t == CONTROL).normalized(false))
        .collect();
    // Their ids are already in the vocabulary, so they keep them.
    tk.add_tokens(added)
        .map_err(|e| anyhow!("cannot add the special tokens: {}", text(&e.to_string())))?;
    Ok(tk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_follow_the_scores_and_bytes_fall_back() {
        // pieces: specials, bytes for fallback, letters, and merged pieces with scores
        let mut tokens = vec!["<unk>", "<bos>"];
        let bytes: Vec<String> = (0..256).map(|b| format!("<0x{b:02X}>")).collect();
        tokens.extend(bytes.iter().map(String::as_str));
        tokens.extend(["a", "b", "c", "\u{2581}", "ab", "bc", "abc", "\u{2581}a"]);
        let n = tokens.len();
        let mut types = vec![NORMAL; n];
        types[0] = 2; // unknown
        types[1] = CONTROL;
        types[2..258].iter_mut().for_each(|t| *t = 6); // byte
        let mut scores = vec![0f32; n];
        let id = |t: &str| tokens.iter().position(|x| *x == t).unwrap();
        scores[id("bc")] = -1.0; // "bc" outranks "ab", so "abc" = "a" + "bc"
        scores[id("ab")] = -2.0;
        scores[id("abc")] = -3.0;
        scores[id("\u{2581}a")] = -0.5;
        let tk = tokenizer(&tokens, &scores, &types, 0).unwrap();
        let enc = tk.encode("abc a\u{e9}", false).unwrap();
        let got: Vec<&str> = enc.get_ids().iter().map(|&i| tokens[i as usize]).collect();
        // "é" is not a piece: its two UTF-8 bytes fall back to byte pieces
        assert_eq!(got, vec!["abc", "\u{2581}a", "<0xC3>", "<0xA9>"]);
        assert_eq!(tk.decode(enc.get_ids(), false).unwrap(), "abc a\u{e9}");
        // a control piece written in the text is one token
        assert_eq!(
            tk.encode("<bos>ab", false).unwrap().get_ids(),
            &[1, id("ab") as u32]
        );
    }

    /// A piece of 2 MB (a corrupt file) builds in milliseconds: only the splits whose halves
    /// have the length of some piece are looked up (looking up all of them took minutes).
    #[test]
    fn a_huge_piece_is_not_quadratic() {
        let long = "a".repeat(2 << 20);
        let tokens = vec!["<unk>", "a", "aa", "aaa", long.as_str()];
        let t = std::time::Instant::now();
        let tk = tokenizer(&tokens, &[0.0, 0.0, -1.0, -2.0, -3.0], &[2, 1, 1, 1, 1], 0).unwrap();
        assert!(t.elapsed().as_secs() < 5, "{:?}", t.elapsed());
        // the merges that exist are kept: "aaa" is "a" + "aa" or "aa" + "a"
        assert_eq!(tk.encode("aaa", false).unwrap().get_ids(), &[3]);
    }
}
