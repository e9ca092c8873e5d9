//! Speculative decoding's n-gram proposer (prompt lookup, as vLLM's `ngram` method): the
//! tokens that followed the last earlier occurrence of the context's final n-gram. Pure data;
//! the engine asks it for drafts, the scheduler schedules them as extra query tokens, and the
//! model's own choices at those positions decide how many are kept.

/// `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": max,
/// "prompt_lookup_min": min, "disable_by_batch_size": b}` (vLLM's `--speculative-config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramConfig {
    /// The most draft tokens a step verifies for one request.
    pub num_speculative_tokens: usize,
    /// The longest and shortest n-gram looked up (the longest that is found wins).
    pub prompt_lookup_max: usize,
    pub prompt_lookup_min: usize,
    /// No drafts while this many requests or more are running (verifying drafts costs compute
    /// that a large batch no longer has to spare). `None`: drafts at any batch size.
    pub disable_by_batch_size: Option<usize>,
}

/// `disable_by_batch_size` where the JSON does not give it.
///
/// NOTE: measured on the CPU backend (docs/benchmarks.md, `scripts/bench-spec.sh`): with 16 or
/// 64 requests at once, SmolLM2 Q4_1 ran 0.76-0.89x as fast with drafts as without (the
/// matmuls are compute-bound there, and every rejected draft is a wasted row); with 4 it was
/// 0.83-0.87x for SmolLM2 (its LM head is a fifth of its weights, and computes every draft's
/// row) and 1.06-1.42x for Qwen2.5-Coder. Below 4, both gain.
pub const DEFAULT_DISABLE_BY_BATCH_SIZE: usize = 4;

impl NgramConfig {
    /// Reads vLLM's `--speculative-config` JSON. Only the `ngram` method exists here; the
    /// others (a draft model, EAGLE, MTP) and unknown keys are refused by name.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| format!("--speculative-config is not valid JSON: {e}"))?;
        let obj = v
            .as_object()
            .ok_or("--speculative-config must be a JSON object")?;
        let method = match obj.get("method") {
            None if obj.contains_key("model") => "draft_model",
            None => return Err("--speculative-config needs \"method\" (\"ngram\")".into()),
            Some(m) => m
                .as_str()
                .ok_or("--speculative-config: \"method\" must be a string")?,
        };
        if method != "ngram" {
            return Err(format!(
                "--speculative-config: method \"{method}\" is not implemented (only \"ngram\", \
                 prompt lookup, is; a draft model, EAGLE and MTP are not yet)"
            ));
        }
        let int = |key: &str| -> Result<Option<usize>, String> {
            match obj.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n >= 1)
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| {
                        format!("--speculative-config: \"{key}\" must be an integer >= 1, got {x}")
                    }),
            }
        };
        const KEYS: [&str; 5] = [
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
            "method",
        ];
        if let Some(k) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(format!(
                "--speculative-config: unknown key \"{k}\" for method \"ngram\" (known: {})",
                KEYS.join(", ")
            ));
        }
        let k = int("num_speculative_tokens")?
            .ok_or("--speculative-config: \"num_speculative_tokens\" is required")?;
        // NOTE: as vLLM: one bound given sets the other; none, both 5.
        let (max, min) = match (int("prompt_lookup_max")?, int("prompt_lookup_min")?) {
            (None, None) => (5, 5),
            (Some(a), None) => (a, a),
            (None, Some(b)) => (b, b),
            (Some(a), Some(b)) => (a, b),
        };
        if min > max {
            return Err(format!(
                "--speculative-config: prompt_lookup_min {min} is greater than prompt_lookup_max {max}"
            ));
        }
        if k > 64 || max > 64 {
            return Err(
                "--speculative-config: num_speculative_tokens and prompt_lookup_max are at most 64"
                    .into(),
            );
        }
        Ok(NgramConfig {
            num_speculative_tokens: k,
            prompt_lookup_max: max,
            prompt_lookup_min: min,
            disable_by_batch_size: Some(
                int("disable_by_batch_size")?.unwrap_or(DEFAULT_DISABLE_BY_BATCH_SIZE),
            ),
        })
    }

    /// Up to `num_speculative_tokens` tokens that followed the most recent earlier occurrence
    /// of the last `n` tokens of `tokens`, for the largest `n` from `prompt_lookup_max` down to
    /// `prompt_lookup_min` that occurs; none when no n-gram recurs.
    pub fn propose(&self, tokens: &[u32]) -> Vec<u32> {
        let len = tokens.len();
        for n in (self.prompt_lookup_min..=self.prompt_lookup_max).rev() {
            if n == 0 || n >= len {
                continue;
            }
            let tail = &tokens[len - n..];
            // NOTE: the most recent occurrence: in a rewrite the text being copied is the
            // one seen last.
            if let Some(start) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == tail) {
                let from = start + n;
                let to = (from + self.num_speculative_tokens).min(len);
                return tokens[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(k: usize, min: usize, max: usize) -> NgramConfig {
        NgramConfig {
            num_speculative_tokens: k,
            prompt_lookup_max: max,
            prompt_lookup_min: min,
            disable_by_batch_size: None,
        }
    }

    #[test]
    fn reads_vllm_json_and_names_what_is_wrong() {
        let ok = |s: &str| NgramConfig::from_json(s).unwrap();
        let err = |s: &str| NgramConfig::from_json(s).unwrap_err();
        let dflt = |c: NgramConfig| NgramConfig {
            disable_by_batch_size: Some(DEFAULT_DISABLE_BY_BATCH_SIZE),
            ..c
        };
        assert_eq!(
            ok(r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}"#),
            dflt(cfg(4, 3, 3))
        );
        assert_eq!(
            ok(
                r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_max":4,"prompt_lookup_min":2,"disable_by_batch_size":8}"#
            ),
            NgramConfig {
                disable_by_batch_size: Some(8),
                ..cfg(2, 2, 4)
            }
        );
        assert_eq!(
            ok(r#"{"method": "ngram", "num_speculative_tokens": 1}"#),
            dflt(cfg(1, 5, 5))
        );
        assert!(err("{").contains("not valid JSON"));
        assert!(err("[]").contains("JSON object"));
        assert!(err(r#"{"method": "ngram"}"#).contains("num_speculative_tokens"));
        assert!(
            err(r#"{"model": "draft.gguf", "num_speculative_tokens": 3}"#).contains("draft_model")
        );
        assert!(
            err(r#"{"method": "eagle3", "model": "x"}"#).contains("\"eagle3\" is not implemented")
        );
        assert!(
            err(r#"{"method": "ngram", "num_speculative_tokens": 0}"#).contains("integer >= 1")
        );
        assert!(
            err(r#"{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}"#)
                .contains("unknown key \"lookahead\"")
        );
        assert!(err(r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3}"#).contains("greater than"));
    }

    #[test]
    fn proposes_what_followed_the_last_match() {
        // The tail [3, 4] occurred twice; the later one was followed by 9, 9, 3.
        let t = [1, 3, 4, 5, 6, 3, 4, 9, 9, 3, 4];
        assert_eq!(cfg(3, 1, 2).propose(&t), vec![9, 9, 3]);
        assert_eq!(cfg(2, 1, 2).propose(&t), vec![9, 9]);
        // The longest n-gram wins: [9, 3, 4] never recurs, [3, 4] does.
        assert_eq!(cfg(1, 1, 3).propose(&t), vec![9]);
        // The drafts stop at the end of the context.
        assert_eq!(cfg(8, 2, 2).propose(&[7, 8, 7, 8]), vec![7, 8]);
    }

    #[test]
    fn proposes_nothing_without_a_match() {
        assert!(cfg(4, 1, 3).propose(&[1, 2, 3, 4]).is_empty());
        assert!(cfg(4, 2, 3).propose(&[5, 1, 5]).is_empty());
        assert!(cfg(4, 1, 3).propose(&[]).is_empty());
        assert!(cfg(4, 1, 1).propose(&[5]).is_empty());
    }
}
