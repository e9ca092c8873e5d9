//! Stop strings, found across token boundaries.
//!
//! The checker keeps back the longest suffix of the text that could still be the start of a
//! stop string, so nothing of a stop string is ever emitted:
//!
//! ```text
//!   stop "</s>"     pushes: "Hi <"   "/s"     ">more"
//!   emitted:                "Hi "    ""       ""  (stopped)
//!   held back:              "<"      "</s"    -
//! ```
//!
//! When several stop strings occur, generation stops at the one that is complete first (the
//! earliest end; on a tie the longest, i.e. the earliest start), which is what checking after
//! every character would do. So the result does not depend on how the text was split.

/// Finds stop strings across token boundaries. Holds back the longest suffix of the text that
/// could still begin a stop string; the stop string itself (and anything after it) is never
/// emitted.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stops: Vec<String>,
    held: String,
    /// The stop string found (its index in `stops`).
    matched: Option<usize>,
}

impl StopChecker {
    /// Empty stop strings are ignored ([`SamplingParams::validate`](super::SamplingParams::validate)
    /// rejects them).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// Whether a stop string was found.
    pub fn stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that was found.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Adds new text; returns the text now safe to emit and whether a stop string was found
    /// (then the emitted text ends right before it, and later pushes emit nothing).
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        if self.stopped() {
            return (String::new(), true);
        }
        if self.stops.is_empty() {
            return (delta.to_string(), false);
        }
        self.held.push_str(delta);
        // NOTE: no stop string lies entirely inside what was held before (the previous push
        // would have found it) nor starts in what was emitted (the held suffix would then have
        // been longer), so searching `held` finds exactly the new occurrences.
        let mut first: Option<(usize, usize, usize)> = None; // (end, start, which)
        for (i, s) in self.stops.iter().enumerate() {
            if let Some(start) = self.held.find(s.as_str()) {
                let found = (start + s.len(), start, i);
                if first.is_none_or(|f| found < f) {
                    first = Some(found);
                }
            }
        }
        if let Some((_, start, which)) = first {
            self.held.truncate(start);
            self.matched = Some(which);
            return (std::mem::take(&mut self.held), true);
        }
        let keep = self.partial_suffix_len();
        let emit = self.held.len() - keep;
        let out: String = self.held.drain(..emit).collect();
        (out, false)
    }

    /// Adds text that may not stop generation (output before `min_tokens`, as vLLM does):
    /// returns it with whatever was held back; stop strings are looked for in later text only.
    pub fn push_unchecked(&mut self, delta: &str) -> String {
        let mut out = std::mem::take(&mut self.held);
        out.push_str(delta);
        out
    }

    /// At the end of generation (length or EOS): releases what was held back.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a stop string (it
    /// always starts on a character boundary, so `held` can be split there).
    fn partial_suffix_len(&self) -> usize {
        let held = self.held.as_str();
        let mut best = 0;
        for s in &self.stops {
            let longest = (s.len() - 1).min(held.len());
            for k in (best + 1..=longest).rev() {
                if s.is_char_boundary(k)
                    && held.is_char_boundary(held.len() - k)
                    && held.ends_with(&s[..k])
                {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn checker(stops: &[&str]) -> StopChecker {
        StopChecker::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// Runs the pushes; returns (everything emitted including the flush, stopped, pushes' outputs).
    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool, Vec<String>) {
        let mut c = checker(stops);
        let mut outs = Vec::new();
        let mut stopped = false;
        for d in deltas {
            let (out, s) = c.push(d);
            outs.push(out);
            stopped = s;
        }
        let mut all = outs.concat();
        all.push_str(&c.flush());
        (all, stopped, outs)
    }

    #[test]
    fn stop_split_across_deltas() {
        let (all, stopped, outs) = run(&["bc"], &["ab", "c", "d"]);
        assert_eq!(outs, ["a", "", ""]);
        assert_eq!(all, "a");
        assert!(stopped);
    }

    #[test]
    fn held_text_is_released_when_it_cannot_be_a_stop() {
        let (all, stopped, outs) = run(&["</s>"], &["Hi <", "/s", "x>", " ok"]);
        assert_eq!(outs, ["Hi ", "", "</sx>", " ok"]);
        assert_eq!(all, "Hi </sx> ok");
        assert!(!stopped);
    }

    #[test]
    fn flush_returns_held_text() {
        let mut c = checker(&["STOP"]);
        assert_eq!(c.push("the ST"), ("the ".to_string(), false));
        assert_eq!(c.push("O"), (String::new(), false));
        assert_eq!(c.flush(), "STO");
        assert_eq!(c.flush(), "");
    }

    #[test]
    fn stop_at_the_very_start() {
        let (all, stopped, outs) = run(&["\n\n"], &["\n", "\nmore"]);
        assert_eq!(outs, ["", ""]);
        assert_eq!(all, "");
        assert!(stopped);
        let (all, stopped, _) = run(&["Q:"], &["Q: next"]);
        assert_eq!(all, "");
        assert!(stopped);
    }

    #[test]
    fn several_stops() {
        // The one complete first wins; on the same end, the longest.
        assert_eq!(run(&["xyz", "b"], &["ab", "xyz"]).0, "a");
        assert_eq!(run(&["cd", "abcdef"], &["abcdef"]).0, "ab");
        assert_eq!(run(&["cd", "abcdef"], &["abc", "def"]).0, "ab");
        assert_eq!(run(&["d", "bcd"], &["abcde"]).0, "a");
        assert_eq!(run(&["END", "STOP"], &["one S", "TOP two END"]).0, "one ");
        // The stop string found is told (Anthropic's `stop_sequence`, vLLM's `stop_reason`).
        let mut c = checker(&["END", "STOP"]);
        assert_eq!(c.matched(), None);
        c.push("one S");
        assert_eq!(c.matched(), None);
        c.push("TOP two END");
        assert_eq!(c.matched(), Some("STOP"));
        // After stopping, nothing more is emitted.
        let mut c = checker(&["x"]);
        assert_eq!(c.push("ax"), ("a".to_string(), true));
        assert_eq!(c.push("more"), (String::new(), true));
        assert!(c.stopped());
        assert_eq!(c.flush(), "");
    }

    #[test]
    fn multibyte_stops_and_text() {
        let (all, stopped, outs) = run(&["日本"], &["こんにちは日", "本語"]);
        assert_eq!(outs, ["こんにちは", ""]);
        assert_eq!(all, "こんにちは");
        assert!(stopped);
        // A held prefix that is not a stop after all.
        assert_eq!(run(&["é!"], &["caf", "é", "?"]).0, "café?");
    }

    #[test]
    fn no_stops_passes_everything_through() {
        let mut c = StopChecker::new(&[String::new()]);
        assert_eq!(c.push("abc"), ("abc".to_string(), false));
        assert_eq!(c.flush(), "");
    }

    /// What checking after every character gives: cut at the start of the stop string that is
    /// complete first.
    fn reference(text: &str, stops: &[String]) -> (String, bool) {
        let ends = text
            .char_indices()
            .map(|(i, c)| i + c.len_utf8())
            .collect::<Vec<_>>();
        for e in ends {
            let prefix = &text[..e];
            let longest = stops
                .iter()
                .filter(|s| !s.is_empty() && prefix.ends_with(s.as_str()))
                .map(|s| s.len())
                .max();
            if let Some(len) = longest {
                return (text[..e - len].to_string(), true);
            }
        }
        (text.to_string(), false)
    }

    fn text_and_splits() -> impl Strategy<Value = (String, Vec<usize>)> {
        "[abcé日 ]{0,40}".prop_flat_map(|text| {
            let n = text.chars().count();
            (Just(text), proptest::collection::vec(0..=n, 0..8))
        })
    }

    /// Splits `text` at the given character positions.
    fn split(text: &str, cuts: &[usize]) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        let mut cuts = cuts.to_vec();
        cuts.push(0);
        cuts.push(chars.len());
        cuts.sort_unstable();
        cuts.windows(2)
            .map(|w| chars[w[0]..w[1]].iter().collect())
            .collect()
    }

    proptest! {
        #[test]
        fn emitted_plus_flush_is_text_cut_at_first_stop(
            (text, cuts) in text_and_splits(),
            stops in proptest::collection::vec("[abcé日 ]{1,4}", 1..4),
        ) {
            let deltas = split(&text, &cuts);
            let mut c = StopChecker::new(&stops);
            let mut emitted = String::new();
            let mut stopped = false;
            for d in &deltas {
                let (out, s) = c.push(d);
                // Emitted text is final: always a prefix of the expected result.
                emitted.push_str(&out);
                stopped = s;
                if s { break; }
            }
            let (want, want_stopped) = reference(&text, &stops);
            prop_assert!(want.starts_with(&emitted));
            emitted.push_str(&c.flush());
            prop_assert_eq!(&emitted, &want);
            prop_assert_eq!(stopped, want_stopped);
            for s in &stops {
                prop_assert!(!emitted.contains(s.as_str()));
            }
        }

        #[test]
        fn one_stop_cuts_at_its_first_occurrence(
            (text, cuts) in text_and_splits(),
            stop in "[abcé日 ]{1,3}",
        ) {
            let deltas = split(&text, &cuts);
            let mut c = StopChecker::new(std::slice::from_ref(&stop));
            let mut emitted = String::new();
            for d in &deltas {
                emitted.push_str(&c.push(d).0);
            }
            emitted.push_str(&c.flush());
            let want = text.find(stop.as_str()).map_or(text.as_str(), |i| &text[..i]);
            prop_assert_eq!(emitted, want);
        }
    }
}
