//! Built-in tool-call adapter: Gemma 4's <|tool_call>call:NAME{key:value}<tool_call|> (see `tool-calls`).

plugin_sdk::export_tool_adapter!(
    tool_calls::Adapter<tool_calls::formats::Gemma4>,
    r#"{"abi": 1, "name": "gemma4", "version": "0.1.0", "kinds": ["tool"], "description": "tool calls in Gemma 4's <|tool_call>call:NAME{key:value}<tool_call|> format, strings between <|\"|> tokens"}"#
);
