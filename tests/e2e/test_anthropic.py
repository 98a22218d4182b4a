"""The Anthropic Messages API through the official `anthropic` SDK and raw SSE."""
import json

import anthropic
import pytest

Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_message_greedy(anthropic_client):
    m = anthropic_client.messages.create(model="smollm2", max_tokens=30, messages=Q, extra_body={"temperature": 0})
    assert m.content[0].type == "text" and m.content[0].text == "The capital of France is Paris."
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == 8


def test_system_prompt_and_stop_sequences(anthropic_client):
    m = anthropic_client.messages.create(model="m", max_tokens=30, messages=Q, stop_sequences=["Paris"], extra_body={"temperature": 0})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert "Paris" not in m.content[0].text
    with_system = anthropic_client.messages.count_tokens(model="m", messages=Q, system="You answer in French.")
    without = anthropic_client.messages.count_tokens(model="m", messages=Q)
    assert with_system.input_tokens != without.input_tokens


def test_streaming_events_arrive_in_order(anthropic_client, http):
    with anthropic_client.messages.stream(model="m", max_tokens=30, messages=Q, extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "The capital of France is Paris." == final.content[0].text
    body = {"model": "m", "max_tokens": 30, "messages": Q, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as r:
        lines = list(r.iter_lines())
    events = [l[7:] for l in lines if l.startswith("event: ")]
    start = json.loads(next(l[6:] for l in lines if l.startswith("data: ")))
    usage = start["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == 37
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tools_and_tool_results(anthropic_client):
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    plain = anthropic_client.messages.count_tokens(model="m", messages=Q)
    with_tools = anthropic_client.messages.count_tokens(model="m", messages=Q, tools=tools)
    assert with_tools.input_tokens > plain.input_tokens + 20
    convo = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny, 21 C"}]},
    ]
    m = anthropic_client.messages.create(model="m", max_tokens=10, messages=convo, tools=tools, extra_body={"temperature": 0})
    assert m.content[0].text


def test_errors_are_in_the_anthropic_shape(anthropic_client, http):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="m", max_tokens=10, messages=Q, extra_body={"temperature": 1.5})
    assert "temperature" in str(e.value)
    r = http.post("/v1/messages", json={"model": "m", "messages": Q})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    r = http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
