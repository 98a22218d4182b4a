//! Built-in scheduling policy: fair share. Each client (`user` / `metadata.user_id`; requests
//! without one are one client together) gets an equal share of the host's slots. Waiting
//! requests are ordered round-robin over clients, fewest running first (oldest first within
//! a client and on ties); when no slot is free and the client next in line runs at least two
//! requests fewer than the client running the most, that client's request with the most
//! generated tokens is paused for it (it keeps its KV and resumes where it stopped).
//! Config: `{"preempt": true}`.

use sched_util::{Decision, Policy, Queue, Request};
use serde_json::Value;
use std::collections::HashMap;

pub struct Fair {
    preempt: bool,
}

impl Default for Fair {
    fn default() -> Self {
        Fair { preempt: true }
    }
}

fn client(r: &Request) -> &str {
    r.client.as_deref().unwrap_or("")
}

impl Policy for Fair {
    fn configure(&mut self, config: &Value) -> Result<(), String> {
        self.preempt = match config.get("preempt") {
            None => true,
            Some(v) => v.as_bool().ok_or_else(|| format!("fair: bad `preempt`: {v}"))?,
        };
        Ok(())
    }

    fn decide(&self, queue: &Queue) -> Decision {
        let mut running: HashMap<&str, usize> = HashMap::new();
        for r in &queue.running {
            *running.entry(client(r)).or_default() += 1;
        }
        // Round robin: the next request is the oldest of the client with the fewest running
        // plus already ordered.
        let mut counts = running.clone();
        let mut left: Vec<&Request> = queue.waiting.iter().collect();
        left.sort_by_key(|r| std::cmp::Reverse(r.waited_ms));
        let mut order = Vec::with_capacity(left.len());
        while !left.is_empty() {
            let next =
                (0..left.len()).min_by_key(|&i| counts.get(client(left[i])).copied().unwrap_or(0)).expect("not empty");
            let r = left.remove(next);
            *counts.entry(client(r)).or_default() += 1;
            order.push(r);
        }
        let mut preempt = Vec::new();
        if let (true, 0, Some(first)) = (self.preempt, queue.slots.free, order.first()) {
            let mine = running.get(client(first)).copied().unwrap_or(0);
            let busiest = running.iter().max_by_key(|(c, n)| (**n, std::cmp::Reverse(**c))).map(|(c, n)| (*c, *n));
            if let Some((busy, _)) = busiest.filter(|&(c, n)| c != client(first) && n >= mine + 2) {
                let victim = queue.running.iter().filter(|r| client(r) == busy).max_by_key(|r| r.generated_tokens);
                preempt.extend(victim.map(|r| r.id.clone()));
            }
        }
        Decision { order: order.into_iter().map(|r| r.id.clone()).collect(), preempt, cancel: vec![] }
    }
}

plugin_sdk::export_scheduler!(
    sched_util::Driver<Fair>,
    r#"{"abi": 1, "name": "fair", "version": "0.1.0", "kinds": ["scheduler"], "description": "an equal share of the slots per client: round robin, preempting the busiest client"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_take_turns_and_the_busiest_yields_a_slot_when_none_is_free() {
        let q = sched_util::queue(
            &[("a1", 0, 10, 0, Some("a")), ("a2", 0, 10, 0, Some("a")), ("a3", 0, 10, 0, Some("a"))],
            &[
                ("a4", 0, 10, 900, Some("a")),
                ("b1", 0, 10, 500, Some("b")),
                ("b2", 0, 10, 400, Some("b")),
                ("c1", 0, 10, 100, Some("c")),
                ("n1", 0, 10, 50, None),
            ],
        );
        let d = Fair::default().decide(&q);
        assert_eq!(d.order, ["b1", "c1", "n1", "b2", "a4"]);
        // No slot is free (the test queue's slots are its running requests) and "b" runs
        // none while "a" runs three: one of a's is paused.
        assert_eq!(d.preempt.len(), 1);
        assert!(d.preempt[0].starts_with('a'));
        let mut free = q.clone();
        free.slots.free = 2;
        assert!(Fair::default().decide(&free).preempt.is_empty(), "free slots: nothing to pause");
        let mut calm = Fair::default();
        calm.configure(&serde_json::json!({"preempt": false})).unwrap();
        assert!(calm.decide(&q).preempt.is_empty());
        assert!(calm.configure(&serde_json::json!({"preempt": 1})).unwrap_err().contains("preempt"));
    }

    #[test]
    fn a_client_one_request_behind_is_not_worth_a_pause() {
        let q = sched_util::queue(
            &[("a1", 0, 1, 0, Some("a")), ("b1", 0, 1, 0, Some("b"))],
            &[("b2", 0, 1, 10, Some("b"))],
        );
        let d = Fair::default().decide(&q);
        assert_eq!(d.order, ["b2"]);
        assert!(d.preempt.is_empty());
    }
}
