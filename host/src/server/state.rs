//! What every handler shares: the engine, the plugins, the limits and defaults resolved from
//! the configuration (`server::state` builds it), the Responses store.

use super::guard;
use super::metrics::Metrics;
use super::store::Store;
use crate::engine::handle::Engine;
use crate::engine::SpecConfig;
use crate::plugins::PluginRegistry;
use std::sync::{Arc, OnceLock};
use tokio::sync::watch;

/// Everything handlers share.
pub struct AppState {
    pub engine: Arc<Engine>,
    pub metrics: Metrics,
    pub model_id: String,
    pub api_key: Option<String>,
    pub default_max_tokens: usize,
    pub max_body_bytes: u64,
    /// Longest prompt + completion one request may have within the memory budget.
    pub max_sequence_tokens: usize,
    /// The context length requests are held to (the model's, or `context_length`).
    pub context_tokens: usize,
    pub created: u64,
    pub plugins: Option<Arc<PluginRegistry>>,
    /// Used when a request has no `plugins` field (`"plugins": {}` opts out).
    pub default_plugins: Option<crate::plugins::request::PluginsField>,
    /// Speculative decoding for requests that do not choose.
    pub speculative: SpecConfig,
    /// The tool-call adapter for requests with tools that do not name one (configured, or
    /// chosen from the chat template); `None`: tool calls stay in the text.
    pub tool_adapter: Option<String>,
    /// The default reasoning parser of chat turns (`reasoning_parser`, else the template's).
    pub reasoning_parser: Option<crate::plugins::request::PluginRef>,
    /// Which hosts and web origins may use the server.
    pub guard: guard::Policy,
    /// How long a request body may take to arrive.
    pub body_timeout: std::time::Duration,
    /// Responses kept for `previous_response_id` (`store`, the Responses API's default).
    pub responses: Store,
    /// Compiles requests' structured-output constraints.
    pub grammars: Arc<crate::structured::Grammars>,
    /// Every call the model starts is held to its tool's schema (`constrain_tool_calls`),
    /// not only `strict: true` tools' calls.
    pub constrain_tool_calls: bool,
    /// The built-in web page is served at `/` (`server::ui`).
    pub ui: bool,
    /// The memory budget in bytes (model and KV caches), as the console shows it.
    pub memory_budget: u64,
    /// The model's quantization in words (`server::ui::quantization`), read once at start.
    pub quantization: String,
    /// `GET /v1/plugins`'s body, kept current for `/v1/plugins/events` (see `plugin_feed`).
    pub plugin_feed: OnceLock<watch::Receiver<Arc<str>>>,
}

/// How often the plugin list is looked at for `/v1/plugins/events`.
const PLUGIN_FEED_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

impl AppState {
    /// The plugin list as JSON (`GET /v1/plugins`'s body).
    pub fn plugin_list(&self) -> String {
        let data = self.plugins.as_ref().map(|r| r.status()).unwrap_or_default();
        serde_json::json!({"object": "list", "data": data}).to_string()
    }

    /// A receiver of the plugin list, changed whenever anything in it changes — a file loaded,
    /// replaced, refused or removed, a fault, a quarantine starting or ending, a call counted.
    /// One task (started by the first subscriber, inside the runtime) looks at the registry
    /// every 250 ms and publishes a list that differs from the last: the changes come from the
    /// watcher thread, the engine thread and the clock, and one snapshot compared with the last
    /// sees them all, once for every subscriber.
    pub fn plugin_feed(self: &Arc<Self>) -> watch::Receiver<Arc<str>> {
        self.plugin_feed
            .get_or_init(|| {
                let (tx, rx) = watch::channel::<Arc<str>>(Arc::from(self.plugin_list()));
                let state = Arc::downgrade(self);
                tokio::spawn(async move {
                    let mut tick = tokio::time::interval(PLUGIN_FEED_EVERY);
                    loop {
                        tick.tick().await;
                        let Some(state) = state.upgrade() else { return };
                        let now = state.plugin_list();
                        tx.send_if_modified(|last| {
                            let changed = **last != *now;
                            if changed {
                                *last = Arc::from(now);
                            }
                            changed
                        });
                    }
                });
                rx
            })
            .clone()
    }
}

pub type Shared = Arc<AppState>;
