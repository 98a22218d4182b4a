//! Built-in tool-call adapter: OpenAI's harmony messages to `functions.*` (GPT-OSS; see
//! `tool-calls`). Pair it with the `harmony-channels` reasoning parser, which takes the
//! analysis and final channels' headers off before the adapter sees the text.

plugin_sdk::export_tool_adapter!(
    tool_calls::Adapter<tool_calls::formats::Harmony>,
    r#"{"abi": 1, "name": "harmony", "version": "0.1.0", "kinds": ["tool"], "description": "tool calls in OpenAI's harmony format (GPT-OSS): <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}"}"#
);
