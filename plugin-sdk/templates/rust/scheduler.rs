//! @NAME@: a scheduling-policy plugin for host (ABI v1, plugin-sdk/ABI.md §5.4).
//! This skeleton serves the shortest waiting prompt first (ties in arrival order). Use it
//! with `host serve --scheduler @NAME@` (or `scheduler = "@NAME@"` in host.toml).

use plugin_sdk::Scheduler;
use serde_json::{json, Value};

#[derive(Default)]
pub struct Plugin;

impl Scheduler for Plugin {
    /// The queue (JSON: `running`, `waiting`, `slots`, `memory`) in; the decision out:
    /// `{"order": [ids], "preempt": [ids], "cancel": [ids]}`, each optional.
    fn schedule(&mut self, queue: &str) -> String {
        let queue: Value = serde_json::from_str(queue).unwrap_or_default();
        let mut waiting: Vec<&Value> = queue["waiting"].as_array().map(|w| w.iter().collect()).unwrap_or_default();
        waiting.sort_by_key(|e| e["prompt_tokens"].as_u64().unwrap_or(0));
        json!({"order": waiting.iter().map(|e| &e["id"]).collect::<Vec<_>>()}).to_string()
    }
}

plugin_sdk::export_scheduler!(Plugin, r#"@MANIFEST@"#);
