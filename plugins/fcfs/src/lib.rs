//! Built-in scheduling policy (the default): first come, first served. Never preempts.

use sched_util::{sorted_by, Decision, Policy, Queue};

#[derive(Default)]
pub struct Fcfs;

impl Policy for Fcfs {
    fn decide(&self, queue: &Queue) -> Decision {
        Decision { order: sorted_by(&queue.waiting, |r| std::cmp::Reverse(r.waited_ms)), ..Default::default() }
    }
}

plugin_sdk::export_scheduler!(
    sched_util::Driver<Fcfs>,
    r#"{"abi": 1, "name": "fcfs", "version": "0.1.0", "kinds": ["scheduler"], "description": "first come, first served"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_waiting_first() {
        let q = sched_util::queue(&[], &[("a", 9, 10, 5, None), ("b", 0, 99, 50, None), ("c", 0, 1, 20, None)]);
        assert_eq!(Fcfs.decide(&q).order, ["b", "c", "a"]);
    }
}
