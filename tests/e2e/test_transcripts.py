"""Golden transcripts (issue 43): what each API writes on the wire, byte for byte after ids and
times are normalised, for a scripted reply (the `replay` test sampler on SmolLM2, so the
model's numerics cannot move it): plain text, a tool call with its argument deltas, reasoning,
a failure before the stream and one inside it; chat completions, completions, Anthropic
Messages and Responses, streamed and not. They pin the server's output while its handlers
move; a change to them is a change of behaviour, made on purpose:

    HOST_UPDATE_GOLDEN=1 pytest tests/e2e/test_transcripts.py

rewrites tests/e2e/golden/ (review the diff)."""
import json
import os
import re

import httpx
import pytest

from conftest import Server, build_wasm_plugin
from test_builtins import tokens

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
Q = [{"role": "user", "content": "What is 2+2?"}]
TEXT = "The answer is 4."
THINKING = "<think>\nThe user asks for 2+2.\n</think>\n\nThe answer is 4."
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
OPENAI_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers.",
                                                  "parameters": {"type": "object", "properties": {
                                                      "a": {"type": "number"}, "b": {"type": "number"}}}}}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "Adds two numbers",
                    "input_schema": OPENAI_TOOLS[0]["function"]["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "Adds two numbers.",
                    "parameters": OPENAI_TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    plugins = build_wasm_plugin("replay-sampler", "replay", tmp_path_factory.mktemp("replay"))
    s = Server("--plugins", str(plugins), "--prompt-cache-bytes", "0", "--reasoning-parser", "think")
    yield s
    s.stop()


def replay(server, text, end=True):
    """The `plugins` field that makes the model write `text` (then end its turn)."""
    ids = tokens(server, text) + (tokens(server, "<|im_end|>") if end else [])
    return {"sampler": {"name": "replay", "params": {"tokens": ids}}}


# Ids, times and measured speeds differ from run to run; everything else must not.
NORMALISE = [
    (re.compile(r'"(id|item_id|call_id|tool_use_id|response_id|previous_response_id)":\s*"[^"]*"'), r'"\1":"<id>"'),
    (re.compile(r'"(created|created_at|completed_at)":\s*[0-9.]+'), r'"\1":0'),
    (re.compile(r'"system_fingerprint":\s*"[^"]*"'), '"system_fingerprint":"<fp>"'),
]


def normalise(text):
    for pattern, replacement in NORMALISE:
        text = pattern.sub(replacement, text)
    return text


def transcript(server, path, body):
    """The status line, content type and body of one request, as the wire carried them."""
    with httpx.Client(timeout=120) as c, c.stream("POST", server.url + path, json=body) as r:
        raw = b"".join(r.iter_raw()).decode()
    kind = r.headers.get("content-type", "")
    return f"{r.status_code} {kind}\n\n{normalise(raw)}"


def check(name, got):
    path = os.path.join(GOLDEN, name + ".txt")
    if os.environ.get("HOST_UPDATE_GOLDEN") == "1":
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(got)
        return
    assert os.path.exists(path), f"no golden transcript {path}: run with HOST_UPDATE_GOLDEN=1 and review it"
    with open(path) as f:
        want = f.read()
    assert got == want, f"{name}: the wire output changed (HOST_UPDATE_GOLDEN=1 rewrites it)\n--- got\n{got}"


def bodies(server):
    """Per API, the request body for each case (None: the case does not apply)."""
    text, thinking, call = replay(server, TEXT), replay(server, THINKING), replay(server, CALL)
    # A token id past the vocabulary, chosen after two good tokens: the engine fails the
    # request with the stream already open.
    broken = replay(server, "The answer", end=False)
    broken["sampler"]["params"]["tokens"].append(10**6)
    bad = {"temperature": "hot"}  # refused before any stream opens
    chat = {"messages": Q, "max_tokens": 64}
    messages = {"model": "m", "messages": Q, "max_tokens": 64}
    responses = {"model": "m", "input": "What is 2+2?", "max_output_tokens": 64}
    completions = {"prompt": "2+2 is", "max_tokens": 64}
    return {
        "chat": ("/v1/chat/completions", {
            "text": {**chat, "plugins": text},
            "tool_call": {**chat, "tools": OPENAI_TOOLS, "plugins": call},
            "reasoning": {**chat, "plugins": thinking},
            "failure_before": {**chat, **bad},
            "failure_inside": {**chat, "plugins": broken},
        }),
        "completions": ("/v1/completions", {
            "text": {**completions, "plugins": text},
            "tool_call": None,
            "reasoning": None,
            "failure_before": {**completions, **bad},
            "failure_inside": {**completions, "plugins": broken},
        }),
        "messages": ("/v1/messages", {
            "text": {**messages, "plugins": text},
            "tool_call": {**messages, "tools": ANTHROPIC_TOOLS, "plugins": call},
            "reasoning": {**messages, "plugins": thinking},
            "failure_before": {**messages, **bad},
            "failure_inside": {**messages, "plugins": broken},
        }),
        "responses": ("/v1/responses", {
            "text": {**responses, "plugins": text},
            "tool_call": {**responses, "tools": RESPONSES_TOOLS, "plugins": call},
            "reasoning": {**responses, "plugins": thinking},
            "failure_before": {**responses, **bad},
            "failure_inside": {**responses, "plugins": broken},
        }),
    }


@pytest.mark.parametrize("api", ["chat", "completions", "messages", "responses"])
def test_each_api_writes_its_golden_transcripts(srv, api):
    path, cases = bodies(srv)[api]
    for case, body in cases.items():
        if body is None:
            continue
        for stream in (False, True):
            check(f"{api}-{case}-{'stream' if stream else 'whole'}", transcript(srv, path, {**body, "stream": stream}))
