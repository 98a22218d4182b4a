"""A seeded, structure-aware fuzzer over every route that takes a body: valid OpenAI, Anthropic,
Responses and tokenizer requests, each field (at every depth) replaced by values of other
types and shapes, removed, or joined by unknown ones; 2,000+ cases, the same ones every run
(seed 22). Every answer must come within the timeout, none may be a 5xx, every error must be
in its API's shape without Rust's type names, and every 400 in the OpenAI shape must name the
field in `param`: the mutated field, one that holds it, or one inside it (or, for a rule over
several fields, one the message names)."""
import copy
import json
import os
import random
import re

import httpx
import pytest

from conftest import Server

Q = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
BASES = [
    ("/v1/chat/completions", {"model": "m", "messages": Q, "max_tokens": 1, "temperature": 0.5, "top_p": 0.9,
                              "stop": ["\n"], "tools": [TOOL], "tool_choice": "auto", "stream": False, "seed": 1,
                              "logprobs": False, "stream_options": {"include_usage": True}, "user": "u", "priority": 1}),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 1, "temperature": 0.5, "echo": False,
                         "logprobs": 1, "stop": "\n"}),
    ("/v1/messages", {"model": "m", "max_tokens": 1, "system": "Be brief.",
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                      "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                      "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"}, "temperature": 0.5,
                      "thinking": {"type": "disabled"}, "stop_sequences": ["\n"]}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": Q, "system": "Be brief."}),
    ("/v1/responses", {"model": "m", "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                       "instructions": "Be brief.", "max_output_tokens": 1, "store": False, "temperature": 0.5,
                       "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}),
    ("/tokenize", {"messages": Q, "tools": [TOOL]}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
]
# Values of every JSON type and a few hostile shapes.
VALUES = [None, True, 0, -1, 1.5, 10 ** 30, 1e308, "", "x", "\u0000\ud7ff", "a b c " * 50, [], [None], [1, "a"],
          {}, {"a": 1}, {"type": "nope"}, [[[[[[[[]]]]]]]], {"a": {"b": {"c": {"d": {}}}}}, "L" * 200_000]
# An error quotes at most a short prefix of what the client sent (issue 42: a 1 MB value was
# echoed whole by 24 fields).
MAX_MESSAGE = 2000


# Words of Rust's that an error message must not show a client.
RUST = re.compile(r"\b(f32|f64|u8|u32|u64|i64|usize|struct [A-Z]|enum [A-Z]|Option<|Vec<|Some\()")


def paths(v, at=()):
    """Every field path in a JSON value (object keys and list indexes)."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield at + (k,)
            yield from paths(x, at + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield at + (i,)
            yield from paths(x, at + (i,))


def get(v, path):
    for p in path:
        v = v[p]
    return v


def cases(seed=22, n=2100):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        route, base = rng.choice(BASES)
        body = copy.deepcopy(base)
        path = rng.choice(list(paths(body)))
        parent, key = get(body, path[:-1]), path[-1]
        op = rng.random()
        if op < 0.75:
            new = rng.choice(VALUES)
            if type(new) is type(parent[key]) and new == parent[key]:
                continue
            parent[key] = copy.deepcopy(new)
            kind = "replaced"
        elif op < 0.9:
            del parent[key]
            kind = "removed"
        else:
            if not isinstance(parent, dict):
                continue
            parent["zz_unknown_" + str(rng.randrange(100))] = rng.choice(VALUES)
            kind = "added"
        out.append((route, body, path, kind))
    return out


def dotted(path):
    """A field path as `param` writes it: `messages[0].content`."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else ("." if out else "") + p
    return out


def names_the_field(path, kind, param, message):
    """Whether a 400's `param` names the field a mutation touched."""
    if param is None:
        return False
    if kind == "added":
        return param.split(".")[-1].startswith("zz_unknown_") or dotted(path).startswith(param)
    at = dotted(path)
    related = lambda a, b: a == b or a.startswith(b + ".") or a.startswith(b + "[")
    return related(at, param) or related(param, at) or f"`{path[0]}`" in message


def shape_ok(route, r):
    try:
        v = r.json()
    except ValueError:
        return False
    if route.startswith("/v1/messages"):
        return v.get("type") == "error" and {"type", "message"} <= set(v.get("error", {}))
    return {"message", "type", "param", "code"} <= set(v.get("error", {}))


@pytest.fixture(scope="module")
def srv():
    # The tiny random Llama (SmolLM2's tokenizer and template): the same request handling,
    # a forward in milliseconds, so thousands of cases fit in CI.
    model = os.path.join(os.environ["HOST_TEST_MODELS"], "tiny-llama")
    s = Server("--prompt-cache-bytes", "0", "--default-max-tokens", "2", model=model)
    yield s
    s.stop()


def test_2000_structure_aware_mutations_get_no_5xx_and_errors_in_shape(srv):
    all_cases = cases()
    assert len(all_cases) >= 2000
    bad, unnamed, statuses = [], [], {}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for route, body, path, kind in all_cases:
            try:
                r = c.post(route, json=body)
            except httpx.TimeoutException:
                bad.append((route, path, kind, "timed out"))
                continue
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                bad.append((route, path, kind, r.status_code, r.text[:200]))
            elif r.status_code >= 400 and not shape_ok(route, r):
                bad.append((route, path, kind, "shape", r.text[:200]))
            elif r.status_code >= 400 and RUST.search(r.json()["error"]["message"]):
                bad.append((route, path, kind, "a Rust type in the message", r.text[:200]))
            elif r.status_code >= 400 and len(r.json()["error"]["message"]) > MAX_MESSAGE:
                bad.append((route, path, kind, "a long value echoed", r.text[:200]))
            elif r.status_code == 400 and not route.startswith("/v1/messages"):
                error = r.json()["error"]
                if not names_the_field(path, kind, error["param"], error["message"]):
                    unnamed.append((route, dotted(path), kind, error["param"], error["message"][:120]))
    print(f"{len(all_cases)} cases, statuses {dict(sorted(statuses.items()))}")
    assert srv.alive()
    assert not bad, bad[:10]
    assert not unnamed, unnamed[:10]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
