//! The engine's queue policy: which waiting request runs next, which running one to pause,
//! which waiting ones to cancel. A [`Policy`] decides from a [`QueueView`] (the scheduler
//! plugin's JSON, ABI.md §5.4); without one the queue is first come, first served.

use serde::{Deserialize, Serialize};

/// One request as a policy sees it.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub id: String,
    pub priority: i64,
    pub prompt_tokens: usize,
    pub waited_ms: u64,
    pub generated_tokens: usize,
    pub client: Option<String>,
    pub hints: serde_json::Value,
    /// Positions of KV the request holds now (running or paused; 0 for one not started).
    pub kv_tokens: usize,
    /// Bytes of that KV.
    pub kv_bytes: usize,
}

/// The engine's slots: how many requests may run at once, and how many are free.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Slots {
    pub max: usize,
    pub free: usize,
}

/// The memory budget, in KV positions (0: no budget set): the whole, and what the running
/// requests' reservations (prompt + max_tokens each) leave of it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Memory {
    pub kv_budget_tokens: usize,
    pub kv_free_tokens: usize,
}

/// What a policy is shown.
#[derive(Debug, Clone, Serialize)]
pub struct QueueView {
    pub now_ms: u64,
    pub running: Vec<Entry>,
    pub waiting: Vec<Entry>,
    pub slots: Slots,
    pub memory: Memory,
}

/// What a policy decides. Unknown ids are ignored; waiting ids missing from `order` keep
/// their relative order after the listed ones.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Decision {
    pub order: Vec<String>,
    pub preempt: Vec<String>,
    pub cancel: Vec<String>,
}

/// A scheduling policy (the scheduler plugin, in the server).
pub trait Policy {
    /// The policy's name, for logs and cancellation messages.
    fn name(&self) -> String;
    fn decide(&mut self, view: &QueueView) -> anyhow::Result<Decision>;
}

/// The positions of `ids` in the order `decision` gives: listed ids first, in its order,
/// then the rest in their current order. Cancelled ids are left out.
pub fn reorder(ids: &[String], decision: &Decision) -> Vec<usize> {
    let mut out = Vec::with_capacity(ids.len());
    for wanted in &decision.order {
        if let Some(i) = ids.iter().position(|id| id == wanted) {
            if !out.contains(&i) && !decision.cancel.contains(wanted) {
                out.push(i);
            }
        }
    }
    for (i, id) in ids.iter().enumerate() {
        if !out.contains(&i) && !decision.cancel.contains(id) {
            out.push(i);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_first_then_the_rest_in_order_and_unknown_ignored() {
        let ids: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        let d = Decision {
            order: vec!["c".into(), "zz".into(), "a".into(), "c".into()],
            preempt: vec![],
            cancel: vec!["b".into()],
        };
        assert_eq!(reorder(&ids, &d), vec![2, 0, 3]);
        assert_eq!(reorder(&ids, &Decision::default()), vec![0, 1, 2, 3]);
    }
}
