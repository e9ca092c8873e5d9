//! Per-request sampling parameters (the OpenAI / vLLM set) and their validation.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The most top log-probs a request may ask for per position (OpenAI's limit).
pub const MAX_LOGPROBS: usize = 20;

/// The most stop strings (and stop token ids) a request may give, and the longest stop string.
pub const MAX_STOP: usize = 256;
pub const MAX_STOP_BYTES: usize = 4096;
/// The most `logit_bias` entries (OpenAI's limit is 300; vLLM's the vocabulary).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Temperatures below this are treated as greedy (vLLM's `_SAMPLING_EPS`): dividing by a
/// near-zero temperature only amplifies rounding noise.
pub const GREEDY_EPS: f32 = 1e-5;

/// How one request's next tokens are chosen, and when its generation stops.
///
/// Missing fields take their defaults when deserialized (`#[serde(default)]`), so `{}` is the
/// default request. Call [`SamplingParams::validate`] before using values that came from a user.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Number of completions returned per prompt.
    pub n: usize,
    /// Completions generated per prompt, of which the `n` with the highest cumulative
    /// log-probability are returned; `None`: `n`. At least `n`.
    pub best_of: Option<usize>,
    /// Most tokens to generate; `None` = until the context is full. `Some(0)` is invalid.
    pub max_tokens: Option<usize>,
    /// Softmax temperature; 0 = greedy. Must be finite and >= 0.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`. In (0, 1].
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; -1 or 0 = disabled.
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p` times the largest probability. In [0, 1].
    pub min_p: f32,
    /// HF/vLLM repetition penalty over prompt + output tokens (> 0; 1 = off).
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over output tokens, in [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over output tokens, in [-2, 2].
    pub frequency_penalty: f32,
    /// Seed of the request's random draws; the engine draws one when `None`.
    pub seed: Option<u64>,
    /// Generation stops when the output text contains one of these (not included in the output).
    pub stop: Vec<String>,
    /// Generation stops when one of these tokens is generated (in addition to EOS).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the EOS token.
    pub ignore_eos: bool,
    /// Number of top log-probs to return per generated position (at most [`MAX_LOGPROBS`]).
    pub logprobs: Option<usize>,
    /// Leave special tokens out of the output text.
    pub skip_special_tokens: bool,
    /// Added to the logits of these token ids before sampling (OpenAI's `logit_bias`), each in
    /// [-100, 100]: -100 in effect bans a token, 100 forces it.
    pub logit_bias: BTreeMap<u32, f32>,
    /// The end-of-sequence and stop tokens cannot be generated before this many tokens.
    pub min_tokens: usize,
    /// Words that are never generated (vLLM's `bad_words`): the last token of each word's
    /// tokenization (with and without a leading space) is banned after its other tokens.
    pub bad_words: Vec<String>,
    /// What the output must match (a JSON schema, a regex, a choice, a grammar).
    pub structured: Option<super::StructuredOutput>,
    /// Score every prompt token after the first: its log-probability and the `k` most likely
    /// tokens' at that position (vLLM's `prompt_logprobs`; `Some(0)`: the token's own only).
    pub prompt_logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            best_of: None,
            max_tokens: None,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            skip_special_tokens: true,
            logit_bias: BTreeMap::new(),
            min_tokens: 0,
            bad_words: Vec::new(),
            structured: None,
            prompt_logprobs: None,
        }
    }
}

/// A sampling parameter out of its range: `param` names the field, `message` says why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct InvalidParam {
    pub param: &'static str,
    pub message: String,
}

impl InvalidParam {
    fn new(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            param,
            message: message.into(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0), everything else default.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether the next token is the argmax (temperature 0, or so small that it is the same).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_EPS
    }

    /// Whether the token is the argmax of the (edited) logits: greedy, or top-k 1.
    pub fn chooses_argmax(&self) -> bool {
        self.is_greedy() || self.effective_top_k() == Some(1)
    }

    /// Completions generated: `best_of`, or `n` when it is not given.
    pub fn best_of(&self) -> usize {
        self.best_of.unwrap_or(self.n)
    }

    /// The effective top-k: `None` when disabled.
    pub fn effective_top_k(&self) -> Option<usize> {
        usize::try_from(self.top_k).ok().filter(|&k| k >= 1)
    }

    /// Checks every field's range; the first violation is returned.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        if self.n == 0 {
            return Err(InvalidParam::new("n", "n must be >= 1, got 0"));
        }
        if let Some(b) = self.best_of
            && b < self.n
        {
            return Err(InvalidParam::new(
                "best_of",
                format!("best_of must be >= n, got best_of {b} and n {}", self.n),
            ));
        }
        if self.max_tokens == Some(0) {
            return Err(InvalidParam::new(
                "max_tokens",
                "max_tokens must be >= 1, got 0",
            ));
        }
        // NOTE: the comparisons are written so that NaN fails them.
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(InvalidParam::new(
                "temperature",
                format!("temperature must be >= 0 and finite, got {t}"),
            ));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(InvalidParam::new(
                "top_p",
                format!("top_p must be in (0, 1], got {p}"),
            ));
        }
        if self.top_k < -1 {
            return Err(InvalidParam::new(
                "top_k",
                format!(
                    "top_k must be -1 or 0 (disabled) or >= 1, got {}",
                    self.top_k
                ),
            ));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(InvalidParam::new(
                "min_p",
                format!("min_p must be in [0, 1], got {m}"),
            ));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(InvalidParam::new(
                "repetition_penalty",
                format!("repetition_penalty must be > 0 and finite, got {r}"),
            ));
        }
        for (param, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(InvalidParam::new(
                    param,
                    format!("{param} must be in [-2, 2], got {v}"),
                ));
            }
        }
        // NOTE: every stop string is searched for at every step; a bound keeps one request
        // from slowing the detokenizer for all (OpenAI allows 4; vLLM sets no bound).
        if self.stop.len() > MAX_STOP || self.stop_token_ids.len() > MAX_STOP {
            return Err(InvalidParam::new(
                if self.stop.len() > MAX_STOP {
                    "stop"
                } else {
                    "stop_token_ids"
                },
                format!("at most {MAX_STOP} stop strings and {MAX_STOP} stop token ids"),
            ));
        }
        if let Some(i) = self.stop.iter().position(|s| s.len() > MAX_STOP_BYTES) {
            return Err(InvalidParam::new(
                "stop",
                format!("stop[{i}] is longer than {MAX_STOP_BYTES} bytes"),
            ));
        }
        if let Some(i) = self.stop.iter().position(|s| s.is_empty()) {
            return Err(InvalidParam::new(
                "stop",
                format!("stop strings must not be empty (stop[{i}] is empty)"),
            ));
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|&(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(InvalidParam::new(
                "logit_bias",
                format!("logit_bias values must be in [-100, 100], got {b} for token {id}"),
            ));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(InvalidParam::new(
                "logit_bias",
                format!("at most {MAX_LOGIT_BIAS} logit_bias entries"),
            ));
        }
        if let Some(m) = self.max_tokens
            && self.min_tokens > m
        {
            return Err(InvalidParam::new(
                "min_tokens",
                format!(
                    "min_tokens ({}) must not exceed max_tokens ({m})",
                    self.min_tokens
                ),
            ));
        }
        if self.bad_words.len() > MAX_STOP
            || self
                .bad_words
                .iter()
                .any(|w| w.trim().is_empty() || w.len() > MAX_STOP_BYTES)
        {
            return Err(InvalidParam::new(
                "bad_words",
                format!(
                    "bad_words must be at most {MAX_STOP} words, each not blank and at most {MAX_STOP_BYTES} bytes"
                ),
            ));
        }
        if let Some(s) = &self.structured {
            s.validate()
                .map_err(|m| InvalidParam::new("structured_outputs", m))?;
        }
        if let Some(k) = self.prompt_logprobs
            && k > MAX_LOGPROBS
        {
            return Err(InvalidParam::new(
                "prompt_logprobs",
                format!("prompt_logprobs must be at most {MAX_LOGPROBS}, got {k}"),
            ));
        }
        if let Some(k) = self.logprobs
            && k > MAX_LOGPROBS
        {
            return Err(InvalidParam::new(
                "logprobs",
                format!("logprobs must be at most {MAX_LOGPROBS}, got {k}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_invalid(p: SamplingParams, param: &str) {
        match p.validate() {
            Ok(()) => panic!("{p:?} should be invalid ({param})"),
            Err(e) => {
                assert_eq!(e.param, param, "{e}");
                assert!(e.message.contains(param), "{e}");
            }
        }
    }

    #[test]
    fn defaults_are_valid() {
        let p = SamplingParams::default();
        p.validate().unwrap();
        assert!(!p.is_greedy());
        assert_eq!(p.effective_top_k(), None);
        assert!(p.skip_special_tokens);
        let g = SamplingParams::greedy();
        g.validate().unwrap();
        assert!(g.is_greedy());
    }

    #[test]
    fn boundary_values_are_valid() {
        let d = SamplingParams::default;
        for p in [
            SamplingParams { top_k: 0, ..d() },
            SamplingParams { top_k: 1, ..d() },
            SamplingParams { top_p: 1e-6, ..d() },
            SamplingParams { min_p: 1.0, ..d() },
            SamplingParams {
                presence_penalty: -2.0,
                frequency_penalty: 2.0,
                ..d()
            },
            SamplingParams {
                logprobs: Some(20),
                ..d()
            },
            SamplingParams {
                logprobs: Some(0),
                ..d()
            },
            SamplingParams {
                max_tokens: Some(1),
                ..d()
            },
            SamplingParams {
                repetition_penalty: 0.5,
                ..d()
            },
        ] {
            p.validate().unwrap_or_else(|e| panic!("{p:?}: {e}"));
        }
    }

    #[test]
    fn logit_bias_min_tokens_and_bad_words_are_checked() {
        let d = SamplingParams::default;
        let bias = |b: f32| SamplingParams {
            logit_bias: [(1, b)].into_iter().collect(),
            ..d()
        };
        bias(100.0).validate().unwrap();
        bias(-100.0).validate().unwrap();
        check_invalid(bias(100.5), "logit_bias");
        check_invalid(bias(f32::NAN), "logit_bias");
        check_invalid(
            SamplingParams {
                min_tokens: 3,
                max_tokens: Some(2),
                ..d()
            },
            "min_tokens",
        );
        check_invalid(
            SamplingParams {
                bad_words: vec![" ".into()],
                ..d()
            },
            "bad_words",
        );
        // serde: token ids as JSON object keys, as the library's users write them.
        let p: SamplingParams =
            serde_json::from_str(r#"{"logit_bias": {"7": -5.5}, "min_tokens": 2}"#).unwrap();
        assert_eq!(p.logit_bias.get(&7), Some(&-5.5));
    }

    #[test]
    fn each_invalid_value_names_its_param() {
        let d = SamplingParams::default;
        check_invalid(SamplingParams { n: 0, ..d() }, "n");
        check_invalid(
            SamplingParams {
                n: 3,
                best_of: Some(2),
                ..d()
            },
            "best_of",
        );
        SamplingParams {
            n: 2,
            best_of: Some(5),
            ..d()
        }
        .validate()
        .unwrap();
        check_invalid(
            SamplingParams {
                max_tokens: Some(0),
                ..d()
            },
            "max_tokens",
        );
        for t in [-1.0, f32::NAN, f32::INFINITY] {
            check_invalid(
                SamplingParams {
                    temperature: t,
                    ..d()
                },
                "temperature",
            );
        }
        assert_eq!(
            SamplingParams {
                temperature: -1.0,
                ..d()
            }
            .validate()
            .unwrap_err()
            .to_string(),
            "temperature must be >= 0 and finite, got -1"
        );
        for p in [0.0, -0.1, 1.01, f32::NAN] {
            check_invalid(SamplingParams { top_p: p, ..d() }, "top_p");
        }
        check_invalid(SamplingParams { top_k: -2, ..d() }, "top_k");
        for m in [-0.1, 1.5, f32::NAN] {
            check_invalid(SamplingParams { min_p: m, ..d() }, "min_p");
        }
        for r in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            check_invalid(
                SamplingParams {
                    repetition_penalty: r,
                    ..d()
                },
                "repetition_penalty",
            );
        }
        for v in [-2.1, 2.1, f32::NAN] {
            check_invalid(
                SamplingParams {
                    presence_penalty: v,
                    ..d()
                },
                "presence_penalty",
            );
            check_invalid(
                SamplingParams {
                    frequency_penalty: v,
                    ..d()
                },
                "frequency_penalty",
            );
        }
        check_invalid(
            SamplingParams {
                stop: vec!["x".into(), String::new()],
                ..d()
            },
            "stop",
        );
        check_invalid(
            SamplingParams {
                logprobs: Some(21),
                ..d()
            },
            "logprobs",
        );
    }

    #[test]
    fn serde_fills_defaults() {
        let p: SamplingParams = serde_json::from_str("{}").unwrap();
        assert_eq!(p, SamplingParams::default());
        let p: SamplingParams =
            serde_json::from_str(r#"{"temperature": 0, "stop": ["\n"], "seed": 7}"#).unwrap();
        assert!(p.is_greedy());
        assert_eq!(p.stop, vec!["\n".to_string()]);
        assert_eq!(p.seed, Some(7));
        let back: SamplingParams =
            serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }
}

/// A model's own default sampling parameters: HF `generation_config.json` (`temperature`,
/// `top_p`, `top_k`, `min_p`, `repetition_penalty`) or a GGUF's `general.sampling.*` keys, as
/// vLLM reads them. A field the model does not set is `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// From a `generation_config.json` value (`Null` when the model has none). A field of
    /// the wrong type, or a value no request could use, is an error naming it.
    pub fn from_generation_config(v: &serde_json::Value) -> Result<Self, String> {
        let get = |k: &str| v.get(k).filter(|x| !x.is_null());
        let bad = |k: &str, what: &str, x: &serde_json::Value| {
            format!(
                "generation_config.json: '{k}' must be {what}, found {}",
                crate::untrusted::json(x)
            )
        };
        let f = |k: &str| match get(k) {
            None => Ok(None),
            Some(x) => x
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| bad(k, "a number", x)),
        };
        let top_k = match get("top_k") {
            None => None,
            Some(x) => Some(
                x.as_i64()
                    .ok_or_else(|| bad("top_k", "an integer", x))?
                    .clamp(-1, i32::MAX as i64) as i32,
            ),
        };
        let d = SamplingDefaults {
            temperature: f("temperature")?,
            top_p: f("top_p")?,
            top_k,
            min_p: f("min_p")?,
            repetition_penalty: f("repetition_penalty")?,
        };
        d.check()
            .map_err(|e| format!("generation_config.json: {e}"))?;
        Ok(d)
    }

    /// Whether a request that leaves every field out can use these defaults.
    pub fn check(&self) -> Result<(), String> {
        self.fill(&SamplingDefaults::default(), SamplingParams::default())
            .validate()
            .map_err(|e| format!("the model's default {}: {}", e.param, e.message))
    }

    pub fn is_empty(&self) -> bool {
        *self == SamplingDefaults::default()
    }

    /// `p` with every field the model sets and `explicit` does not, taken from the model.
    pub fn fill(&self, explicit: &SamplingDefaults, mut p: SamplingParams) -> SamplingParams {
        let pick = |e: Option<f32>, m: Option<f32>, d: f32| e.or(m).unwrap_or(d);
        p.temperature = pick(explicit.temperature, self.temperature, p.temperature);
        p.top_p = pick(explicit.top_p, self.top_p, p.top_p);
        p.top_k = explicit.top_k.or(self.top_k).unwrap_or(p.top_k);
        p.min_p = pick(explicit.min_p, self.min_p, p.min_p);
        p.repetition_penalty = pick(
            explicit.repetition_penalty,
            self.repetition_penalty,
            p.repetition_penalty,
        );
        p
    }
}

#[cfg(test)]
mod defaults_tests {
    use super::*;

    #[test]
    fn model_defaults_fill_what_the_user_left_out() {
        let m = SamplingDefaults::from_generation_config(&serde_json::json!({
            "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true, "eos_token_id": 2
        }))
        .unwrap();
        assert_eq!(
            m,
            SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                min_p: None,
                repetition_penalty: None
            }
        );
        let user = SamplingDefaults {
            top_p: Some(0.5),
            ..Default::default()
        };
        let p = m.fill(&user, SamplingParams::default());
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.6, 0.5, 20));
        assert_eq!(p.min_p, SamplingParams::default().min_p);
        assert!(
            SamplingDefaults::from_generation_config(&serde_json::Value::Null)
                .unwrap()
                .is_empty()
        );
        for bad in [
            serde_json::json!({"temperature": "hot"}),
            serde_json::json!({"top_k": 2.5}),
            serde_json::json!({"temperature": -1}),
            serde_json::json!({"top_p": 0}),
            serde_json::json!({"repetition_penalty": 0}),
        ] {
            let e = SamplingDefaults::from_generation_config(&bad).unwrap_err();
            assert!(e.contains("generation_config.json"), "{e}");
        }
    }
}
