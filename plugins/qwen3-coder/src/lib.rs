//! Built-in tool-call adapter: Qwen3-Coder XML <function=...><parameter=...> (see `tool-calls`).

plugin_sdk::export_tool_adapter!(
    tool_calls::Adapter<tool_calls::formats::Qwen3Coder>,
    r#"{"abi": 1, "name": "qwen3-coder", "version": "0.1.0", "kinds": ["tool"], "description": "tool calls in the Qwen3-Coder XML <function=...><parameter=...> format"}"#
);
