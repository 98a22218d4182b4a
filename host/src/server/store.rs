//! The Responses API's store: responses kept for `previous_response_id` and
//! `GET`/`DELETE /v1/responses/{id}` (it lives in the server's state, apart from the API).

use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Responses kept for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`: at
/// most [`Store::MAX_RESPONSES`] and [`Store::MAX_BYTES`] of JSON, the oldest dropped first.
#[derive(Default)]
pub struct Store {
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    entries: HashMap<String, Stored>,
    order: VecDeque<String>,
    bytes: usize,
}

#[derive(Clone)]
pub struct Stored {
    pub response: Value,
    /// The conversation up to and including this response, as chat-template messages
    /// (without `instructions`).
    pub conversation: Vec<Value>,
    /// The request's input, as input items.
    pub input_items: Vec<Value>,
    bytes: usize,
}

impl Store {
    pub const MAX_RESPONSES: usize = 1024;
    pub const MAX_BYTES: usize = 64 << 20;

    pub fn put(&self, response: Value, conversation: Vec<Value>, input_items: Vec<Value>) {
        let id = response["id"].as_str().unwrap_or_default().to_string();
        let bytes = response.to_string().len()
            + conversation.iter().map(|m| m.to_string().len()).sum::<usize>()
            + input_items.iter().map(|m| m.to_string().len()).sum::<usize>();
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = s.entries.remove(&id) {
            s.bytes -= old.bytes;
            s.order.retain(|i| *i != id);
        }
        while !s.order.is_empty() && (s.order.len() >= Self::MAX_RESPONSES || s.bytes + bytes > Self::MAX_BYTES) {
            let oldest = s.order.pop_front().unwrap();
            if let Some(old) = s.entries.remove(&oldest) {
                s.bytes -= old.bytes;
            }
        }
        s.bytes += bytes;
        s.order.push_back(id.clone());
        s.entries.insert(id, Stored { response, conversation, input_items, bytes });
    }

    pub fn get(&self, id: &str) -> Option<Stored> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).entries.get(id).cloned()
    }

    pub fn delete(&self, id: &str) -> bool {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match s.entries.remove(id) {
            Some(old) => {
                s.bytes -= old.bytes;
                s.order.retain(|i| i != id);
                true
            }
            None => false,
        }
    }
}
