//! Built-in tool-call adapter: Llama 3.x JSON calls, optionally after <|python_tag|> (see `tool-calls`).

plugin_sdk::export_tool_adapter!(
    tool_calls::Adapter<tool_calls::formats::Llama3Json>,
    r#"{"abi": 1, "name": "llama3-json", "version": "0.1.0", "kinds": ["tool"], "description": "tool calls in the Llama 3.x JSON calls, optionally after <|python_tag|> format"}"#
);
