"""The OpenAI API through the official `openai` SDK (and raw HTTP where the SDK hides
the wire): chat and completions, streaming, stop strings, prompt cache, tools, logprobs."""
import json
import re

import openai
import pytest

Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model(openai_client):
    ids = [m.id for m in openai_client.models.list().data]
    assert ids == ["smollm2-f32"]


def test_chat_completion_greedy(openai_client):
    r = openai_client.chat.completions.create(model="smollm2", messages=Q, temperature=0, max_tokens=30)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 37 and r.usage.completion_tokens == 8


def test_streaming_chat_equals_non_streaming(openai_client):
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "Tell me a fun fact."}],
              temperature=0.9, seed=1234, max_tokens=40)
    whole = openai_client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(openai_client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [finishes[-1]] and finishes[-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []


def test_raw_stream_ends_with_finish_reason_then_done(http):
    body = {"messages": Q, "temperature": 0, "max_tokens": 30, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stop,expected", [("Par", "The capital of France is "), ("ital of", "The cap"), (["zzz", "France"], "The capital of ")])
def test_stop_strings_spanning_tokens_never_leak(openai_client, stop, expected):
    r = openai_client.chat.completions.create(model="m", messages=Q, temperature=0, max_tokens=30, stop=stop)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = openai_client.chat.completions.create(model="m", messages=Q, temperature=0, max_tokens=30, stop=stop, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == expected
    for s in ([stop] if isinstance(stop, str) else stop):
        assert not any(s in p for p in pieces)


def test_second_turn_reuses_the_cached_prompt(openai_client):
    first = [{"role": "user", "content": "Name a color of the sky."}]
    r1 = openai_client.chat.completions.create(model="m", messages=first, temperature=0, max_tokens=20)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And the color of grass?"}]
    r2 = openai_client.chat.completions.create(model="m", messages=second, temperature=0, max_tokens=20)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens, (cached, r1.usage)
    assert cached < r2.usage.prompt_tokens


def test_tool_definitions_reach_the_prompt(openai_client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    plain = openai_client.chat.completions.create(model="m", messages=Q, temperature=0, max_tokens=1)
    with_tools = openai_client.chat.completions.create(model="m", messages=Q, tools=tools, temperature=0, max_tokens=1)
    # SmolLM2's template ignores `tools`, so the server describes them in the system message.
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    none = openai_client.chat.completions.create(model="m", messages=Q, tools=tools, tool_choice="none", temperature=0, max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_completions_endpoint(openai_client):
    r = openai_client.completions.create(model="m", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.choices[0].text.strip().startswith("Paris")
    assert r.usage.prompt_tokens == 5
    s = list(openai_client.completions.create(model="m", prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text


def test_logprobs_in_openai_format(openai_client):
    r = openai_client.chat.completions.create(model="m", messages=Q, temperature=0, max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["The", " capital", " of"]
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the most likely


def test_errors_are_in_the_openai_shape(openai_client, http):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="m", messages=Q, temperature=5)
    assert "temperature" in str(e.value)
    r = http.post("/v1/chat/completions", json={"messages": [], "max_tokens": 5})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == "messages"
    r = http.post("/v1/chat/completions", json={"messages": Q, "n": 3})
    assert r.status_code == 400 and "`n` must be 1" in r.json()["error"]["message"]
    # Past SmolLM2's context length (8,192 tokens): both numbers in the message.
    r = http.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 8190})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    message = r.json()["error"]["message"]
    # In OpenAI's own words (clients parse them), with both numbers and what to do.
    assert message.startswith("This model's maximum context length is 8192 tokens. However, you requested "), message
    assert re.search(r"\(\d+ in the messages, 8190 in the completion\)\. Please reduce the length of the messages or completion\.", message), message
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 9000}]})
    assert r.status_code == 400 and "maximum context length is 8192 tokens" in r.json()["error"]["message"], r.text
    models = http.get("/v1/models").json()["data"]
    assert models[0]["max_model_len"] == 8192
    assert http.post("/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == 8192
    r = http.post("/v1/chat/completions", content=b"x" * (10 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_health_and_metrics(http):
    assert http.get("/health").json()["status"] == "ok"
    text = http.get("/metrics").text
    for name in ["host_requests_total{route=\"/v1/chat/completions\",status=\"200\"}", "host_time_to_first_token_seconds_bucket",
                 "host_inter_token_latency_seconds_count", "host_prompt_tokens_total", "host_generation_tokens_total",
                 "host_queue_depth", "host_prompt_cache_hits_total", "host_prompt_cache_bytes"]:
        assert name in text, name
