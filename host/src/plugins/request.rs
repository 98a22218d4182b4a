//! What a request (or the server's configuration) says about plugins: the `plugins`
//! extension field of every API and `default_plugins` in `host.toml`. The server and the
//! configuration read it; the registry resolves it (`PluginRegistry::select`).

use serde::Deserialize;
use serde_json::Value;

/// One plugin named in a request's `plugins` extension field.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginRef {
    pub name: String,
    #[serde(default)]
    pub config: Option<Value>,
    #[serde(default)]
    pub params: Option<Value>,
    /// On a plugin fault, carry on without the plugin (native sampling, or without that stop
    /// rule) instead of failing the request.
    #[serde(default)]
    pub fallback: bool,
}

/// The `plugins` extension field (both APIs): at most one sampler, any stop rules.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginsField {
    pub sampler: Option<PluginRef>,
    #[serde(default)]
    pub stop: Vec<PluginRef>,
    /// The tool-call adapter for requests with tools (default: the server's, chosen from
    /// the model's chat template).
    pub tool: Option<PluginRef>,
    /// The reasoning parser for chat replies (default: the server's, chosen from the
    /// model's chat template); `{"name": "none"}` leaves the thinking in the text.
    pub reasoning: Option<PluginRef>,
    /// A constraint plugin over the output (instead of `response_format`, `regex`, `grammar`).
    pub constraint: Option<PluginRef>,
}
