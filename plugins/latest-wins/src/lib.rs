//! Built-in scheduling policy: latest wins. A newer request from a client supersedes that
//! client's older requests still waiting in the queue (they are cancelled with a clear
//! error) — the behaviour an editor's autocomplete wants. Requests without a client id are
//! never cancelled; the rest is first come, first served.

use sched_util::{sorted_by, Decision, Policy, Queue};
use std::collections::HashMap;

#[derive(Default)]
pub struct LatestWins;

impl Policy for LatestWins {
    fn decide(&self, queue: &Queue) -> Decision {
        // The newest waiting request per client (least waited).
        let mut newest: HashMap<&str, (&str, u64)> = HashMap::new();
        for r in &queue.waiting {
            if let Some(client) = r.client.as_deref() {
                let e = newest.entry(client).or_insert((&r.id, r.waited_ms));
                if r.waited_ms < e.1 {
                    *e = (&r.id, r.waited_ms);
                }
            }
        }
        let superseded = |r: &sched_util::Request| {
            r.client.as_deref().is_some_and(|c| newest.get(c).is_some_and(|(id, _)| *id != r.id))
                && r.generated_tokens == 0
        };
        let cancel: Vec<String> = queue.waiting.iter().filter(|r| superseded(r)).map(|r| r.id.clone()).collect();
        let kept: Vec<sched_util::Request> = queue.waiting.iter().filter(|r| !superseded(r)).cloned().collect();
        Decision { order: sorted_by(&kept, |r| std::cmp::Reverse(r.waited_ms)), preempt: vec![], cancel }
    }
}

plugin_sdk::export_scheduler!(
    sched_util::Driver<LatestWins>,
    r#"{"abi": 1, "name": "latest-wins", "version": "0.1.0", "kinds": ["scheduler"], "description": "a newer request from the same client supersedes its queued older ones"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_queued_requests_of_a_client_are_cancelled() {
        let q = sched_util::queue(
            &[("run", 0, 1, 0, Some("ed"))],
            &[
                ("ed1", 0, 1, 300, Some("ed")),
                ("x", 0, 1, 200, None),
                ("ed2", 0, 1, 100, Some("ed")),
                ("ed3", 0, 1, 10, Some("ed")),
            ],
        );
        let d = LatestWins.decide(&q);
        assert_eq!(d.cancel, ["ed1", "ed2"]);
        assert_eq!(d.order, ["x", "ed3"]);
        assert!(d.preempt.is_empty());
    }
}
