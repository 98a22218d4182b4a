//! Built-in tool-call adapter: Hermes / Qwen2.5 <tool_call>{json}</tool_call> (see `tool-calls`).

plugin_sdk::export_tool_adapter!(
    tool_calls::Adapter<tool_calls::formats::Hermes>,
    r#"{"abi": 1, "name": "hermes", "version": "0.1.0", "kinds": ["tool"], "description": "tool calls in the Hermes / Qwen2.5 <tool_call>{json}</tool_call> format"}"#
);
