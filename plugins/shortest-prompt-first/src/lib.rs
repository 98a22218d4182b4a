//! Built-in scheduling policy: shortest prompt first (cheap prefills jump ahead), except that
//! a request waiting longer than `max_wait_ms` goes first, oldest first, so long prompts are
//! not starved. Never preempts. Config: `{"max_wait_ms": 10000}`.

use sched_util::{number, sorted_by, Decision, Policy, Queue};
use serde_json::Value;

pub struct ShortestPromptFirst {
    max_wait_ms: u64,
}

impl Default for ShortestPromptFirst {
    fn default() -> Self {
        ShortestPromptFirst { max_wait_ms: 10_000 }
    }
}

impl Policy for ShortestPromptFirst {
    fn configure(&mut self, config: &Value) -> Result<(), String> {
        self.max_wait_ms = number(config, "shortest-prompt-first", "max_wait_ms", 10_000.0, |x| x >= 0.0)? as u64;
        Ok(())
    }

    fn decide(&self, queue: &Queue) -> Decision {
        let order = sorted_by(&queue.waiting, |r| {
            let starved = r.waited_ms > self.max_wait_ms;
            (!starved, if starved { u64::MAX - r.waited_ms } else { r.prompt_tokens })
        });
        Decision { order, ..Default::default() }
    }
}

plugin_sdk::export_scheduler!(
    sched_util::Driver<ShortestPromptFirst>,
    r#"{"abi": 1, "name": "shortest-prompt-first", "version": "0.1.0", "kinds": ["scheduler"], "description": "shortest prompt first, with a starvation bound"}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_prompts_first_unless_starved() {
        let q = sched_util::queue(
            &[],
            &[("long", 0, 900, 10, None), ("short", 0, 5, 0, None), ("starved", 0, 5000, 20_000, None)],
        );
        assert_eq!(ShortestPromptFirst::default().decide(&q).order, ["starved", "short", "long"]);
    }
}
