//! Built-in scheduling policy: priority with aging. A waiting request's effective priority
//! is its `priority` plus one per `aging_ms` waited, so low priorities are not starved;
//! higher goes first. With `preempt` (default on), a running request is paused when a
//! waiting one's own priority exceeds it (it resumes later where it stopped).
//! Config: `{"aging_ms": 1000, "preempt": true}`.

use sched_util::{number, Decision, Policy, Queue, Request};
use serde_json::Value;

pub struct Priority {
    aging_ms: f64,
    preempt: bool,
}

impl Default for Priority {
    fn default() -> Self {
        Priority { aging_ms: 1000.0, preempt: true }
    }
}

impl Priority {
    fn effective(&self, r: &Request) -> f64 {
        r.priority as f64 + r.waited_ms as f64 / self.aging_ms
    }
}

impl Policy for Priority {
    fn configure(&mut self, config: &Value) -> Result<(), String> {
        self.aging_ms = number(config, "priority", "aging_ms", 1000.0, |x| x > 0.0)?;
        self.preempt = match config.get("preempt") {
            None => true,
            Some(v) => v.as_bool().ok_or_else(|| format!("priority: bad `preempt`: {v}"))?,
        };
        Ok(())
    }

    fn decide(&self, queue: &Queue) -> Decision {
        let mut waiting: Vec<&Request> = queue.waiting.iter().collect();
        waiting.sort_by(|a, b| self.effective(b).total_cmp(&self.effective(a)));
        let best = queue.waiting.iter().map(|r| r.priority).max();
        let preempt = match best {
            Some(best) if self.preempt => {
                queue.running.iter().filter(|r| r.priority < best).map(|r| r.id.clone()).collect()
            }
            _ => vec![],
        };
        Decision { order: waiting.into_iter().map(|r| r.id.clone()).collect(), preempt, cancel: vec![] }
    }
}

plugin_sdk::export_scheduler!(
    sched_util::Driver<Priority>,
    r#"{"abi": 1, "name": "priority", "version": "0.1.0", "kinds": ["scheduler"], "description": "priority with aging; preempts lower-priority running requests"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn higher_priority_first_with_aging_and_preemption() {
        let p = Priority::default();
        let q = sched_util::queue(
            &[("r", 0, 10, 0, None)],
            &[("low", 0, 10, 500, None), ("high", 5, 10, 0, None), ("old", 0, 10, 9000, None)],
        );
        let d = p.decide(&q);
        assert_eq!(d.order, ["old", "high", "low"]);
        assert_eq!(d.preempt, ["r"]);
        let mut calm = Priority::default();
        calm.configure(&serde_json::json!({"preempt": false})).unwrap();
        assert!(calm.decide(&q).preempt.is_empty());
        assert!(calm.configure(&serde_json::json!({"aging_ms": 0})).unwrap_err().contains("aging_ms"));
    }
}
