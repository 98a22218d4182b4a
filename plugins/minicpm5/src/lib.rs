//! Built-in tool-call adapter: MiniCPM 5's XML <function name="..."><param name="..."> (see `tool-calls`).

plugin_sdk::export_tool_adapter!(
    tool_calls::Adapter<tool_calls::formats::MiniCpm5>,
    r#"{"abi": 1, "name": "minicpm5", "version": "0.1.0", "kinds": ["tool"], "description": "tool calls in MiniCPM 5's XML <function name=...><param name=...> format, CDATA values"}"#
);
