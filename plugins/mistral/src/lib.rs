//! Built-in tool-call adapter: Mistral [TOOL_CALLS] (see `tool-calls`).

plugin_sdk::export_tool_adapter!(
    tool_calls::Adapter<tool_calls::formats::Mistral>,
    r#"{"abi": 1, "name": "mistral", "version": "0.1.0", "kinds": ["tool"], "description": "tool calls in the Mistral [TOOL_CALLS] format"}"#
);
