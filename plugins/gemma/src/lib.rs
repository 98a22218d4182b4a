//! Built-in tool-call adapter: Gemma tool_code blocks of Python calls (see `tool-calls`).

plugin_sdk::export_tool_adapter!(
    tool_calls::Adapter<tool_calls::formats::Gemma>,
    r#"{"abi": 1, "name": "gemma", "version": "0.1.0", "kinds": ["tool"], "description": "tool calls in the Gemma tool_code blocks of Python calls format"}"#
);
