//! The Responses API's memory: finished responses kept for `previous_response_id` and
//! `GET /v1/responses/{id}`, bounded in count, age and bytes (the oldest go first), since a
//! server that keeps every conversation forever runs out of memory.

use crate::tokenizer::ChatMessage;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How many responses are kept at most.
pub const MAX_COUNT: usize = 1000;
/// How long a response is kept.
pub const MAX_AGE: Duration = Duration::from_secs(3600);
/// How many bytes of text (conversations and response bodies) are kept at most.
pub const MAX_BYTES: usize = 256 << 20;

/// One stored response: its body, and the conversation it ends (without its instructions,
/// which a following response does not inherit), its output included.
#[derive(Debug, Clone)]
pub struct Stored {
    pub response: Value,
    pub messages: Vec<ChatMessage>,
    at: Instant,
    bytes: usize,
}

#[derive(Debug, Default)]
pub struct ResponseStore {
    map: HashMap<String, Stored>,
    /// Ids, oldest first (some may have been deleted already).
    order: VecDeque<String>,
    bytes: usize,
}

impl ResponseStore {
    pub fn put(&mut self, id: String, response: Value, messages: Vec<ChatMessage>) {
        let bytes = response.to_string().len()
            + messages
                .iter()
                .map(|m| {
                    m.content.len()
                        + m.tool_calls
                            .as_ref()
                            .map_or(0, |c| serde_json::to_string(c).map_or(0, |j| j.len()))
                })
                .sum::<usize>();
        if let Some(old) = self.map.remove(&id) {
            self.bytes -= old.bytes;
        }
        self.bytes += bytes;
        self.map.insert(
            id.clone(),
            Stored {
                response,
                messages,
                at: Instant::now(),
                bytes,
            },
        );
        self.order.push_back(id);
        self.evict(Instant::now());
    }

    pub fn get(&mut self, id: &str) -> Option<&Stored> {
        self.evict(Instant::now());
        self.map.get(id)
    }

    /// Whether it was there.
    pub fn remove(&mut self, id: &str) -> bool {
        match self.map.remove(id) {
            Some(s) => {
                self.bytes -= s.bytes;
                true
            }
            None => false,
        }
    }

    fn evict(&mut self, now: Instant) {
        while let Some(id) = self.order.front() {
            let over = self.map.len() > MAX_COUNT || self.bytes > MAX_BYTES;
            let stale = match self.map.get(id) {
                None => true,
                Some(s) => over || now.duration_since(s.at) > MAX_AGE,
            };
            if !stale {
                break;
            }
            let id = self.order.pop_front().unwrap_or_default();
            self.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn kept_until_deleted_or_pushed_out() {
        let mut s = ResponseStore::default();
        s.put(
            "a".into(),
            json!({"id": "a"}),
            vec![ChatMessage::new("user", "hi")],
        );
        assert_eq!(s.get("a").unwrap().messages[0].content, "hi");
        assert!(s.remove("a"));
        assert!(!s.remove("a"));
        assert!(s.get("a").is_none());
        for i in 0..MAX_COUNT + 5 {
            s.put(format!("r{i}"), json!({}), Vec::new());
        }
        assert_eq!(s.map.len(), MAX_COUNT);
        assert!(s.get("r4").is_none() && s.get("r5").is_some());
        // Bytes: one big conversation pushes out what came before it.
        let big = "x".repeat(MAX_BYTES / 2 + 1);
        s.put(
            "big1".into(),
            json!({}),
            vec![ChatMessage::new("user", big.clone())],
        );
        s.put(
            "big2".into(),
            json!({}),
            vec![ChatMessage::new("user", big)],
        );
        assert!(s.get("big1").is_none() && s.get("big2").is_some());
        assert_eq!(s.map.len(), 1);
        // Age.
        s.evict(Instant::now() + MAX_AGE + Duration::from_secs(1));
        assert!(s.map.is_empty());
    }
}
