//! The scheduler ABI's JSON (ABI.md §5.4) as types, and a driver that turns a policy
//! function into a [`plugin_sdk::Scheduler`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One request in the queue, as the host describes it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Request {
    pub id: String,
    pub priority: i64,
    pub prompt_tokens: u64,
    pub waited_ms: u64,
    pub generated_tokens: u64,
    pub client: Option<String>,
    pub hints: Value,
    /// KV positions and bytes the request holds (running or paused).
    pub kv_tokens: u64,
    pub kv_bytes: u64,
}

/// The host's slots: requests that may run at once, and those free now.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Slots {
    pub max: u64,
    pub free: u64,
}

/// The memory budget in KV positions (0: none set) and what running requests leave of it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Memory {
    pub kv_budget_tokens: u64,
    pub kv_free_tokens: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Queue {
    pub now_ms: u64,
    pub running: Vec<Request>,
    pub waiting: Vec<Request>,
    pub slots: Slots,
    pub memory: Memory,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Decision {
    pub order: Vec<String>,
    pub preempt: Vec<String>,
    pub cancel: Vec<String>,
}

/// A scheduling policy: its config and the decision for a queue.
pub trait Policy: Default {
    fn configure(&mut self, _config: &Value) -> Result<(), String> {
        Ok(())
    }
    fn decide(&self, queue: &Queue) -> Decision;
}

/// A [`Policy`] as a [`plugin_sdk::Scheduler`]: parses the queue, serializes the decision.
#[derive(Default)]
pub struct Driver<P: Policy>(pub P);

impl<P: Policy> plugin_sdk::Scheduler for Driver<P> {
    fn init(&mut self, config: &str) -> Result<(), String> {
        let config: Value = plugin_util::parse("scheduler", "config", config)?;
        self.0.configure(&config)
    }

    fn schedule(&mut self, queue: &str) -> String {
        match serde_json::from_str::<Queue>(queue) {
            Ok(queue) => serde_json::to_string(&self.0.decide(&queue)).unwrap_or_default(),
            Err(e) => {
                plugin_sdk::log(0, &format!("unreadable queue: {e}"));
                String::new()
            }
        }
    }
}

/// The ids of `requests` sorted by `key` (stable: ties keep queue order).
pub fn sorted_by<K: Ord>(requests: &[Request], key: impl Fn(&Request) -> K) -> Vec<String> {
    let mut v: Vec<&Request> = requests.iter().collect();
    v.sort_by_key(|r| key(r));
    v.into_iter().map(|r| r.id.clone()).collect()
}

/// A number field of a config object, with a default and a check.
pub fn number(config: &Value, policy: &str, key: &str, default: f64, ok: impl Fn(f64) -> bool) -> Result<f64, String> {
    match config.get(key) {
        None => Ok(default),
        Some(v) => v.as_f64().filter(|x| ok(*x)).ok_or_else(|| format!("{policy}: bad `{key}`: {v}")),
    }
}

/// Builds a queue from `(id, priority, prompt_tokens, waited_ms, client)` rows. For tests.
pub fn queue(
    running: &[(&str, i64, u64, u64, Option<&str>)],
    waiting: &[(&str, i64, u64, u64, Option<&str>)],
) -> Queue {
    let rows = |rows: &[(&str, i64, u64, u64, Option<&str>)]| {
        rows.iter()
            .map(|(id, priority, prompt_tokens, waited_ms, client)| Request {
                id: id.to_string(),
                priority: *priority,
                prompt_tokens: *prompt_tokens,
                waited_ms: *waited_ms,
                client: client.map(str::to_string),
                ..Default::default()
            })
            .collect()
    };
    let max = running.len().max(1) as u64;
    Queue {
        now_ms: 0,
        running: rows(running),
        waiting: rows(waiting),
        slots: Slots { max, free: 0 },
        ..Default::default()
    }
}
