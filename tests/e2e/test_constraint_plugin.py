"""A constraint plugin (ABI.md §5.6) in a live server: examples/wat/lowercase.wat, loaded
from the plugins folder, holds SmolLM2's output to lower-case words on every route, streamed
and not, under speculation too; replacing the file changes the constraint without a
restart; a broken constraint plugin fails only its own request. The same prompts without
the plugin are the baseline."""
import hashlib
import json
import os
import re
import subprocess
import time

import httpx
import pytest

from conftest import ROOT, Server

BINARY = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
SOURCE = os.path.join(ROOT, "examples", "wat", "lowercase.wat")
WORDS = re.compile(r"^[a-z]+( [a-z]+)* ?$")
PROMPTS = ["What is the capital of France?", "Write one sentence about the sea.", "Name three colours."]
CONSTRAINT = {"constraint": {"name": "lowercase"}}

# A constraint plugin that traps in constraint_mask, built like any other.
TRAP = """(module (@custom "host.plugin" "{\\"abi\\": 1, \\"name\\": \\"mask-trap\\", \\"kinds\\": [\\"constraint\\"]}")
  (memory (export "memory") 16)
  (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "constraint_vocab") (param i32 i32) (result i32) (i32.const 0))
  (func (export "constraint_mask") (param i32 i32) (result i32) unreachable)
  (func (export "constraint_accept") (param i32) (result i32) (i32.const 0))
  (func (export "constraint_rollback") (param i32) (result i32) (i32.const 0)))"""


# A tool adapter (a user's, in WAT) whose forced-call grammar does not compile: the call
# goes unconstrained with a warning, the request does not fail.
OPENER = '<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
OPENER_LEN = len('<tool_call>\n{"name": "get_weather", "arguments": ')
BAD_GRAMMAR = f"""(module (@custom "host.plugin" "{{\\"abi\\": 1, \\"name\\": \\"bad-grammar\\", \\"kinds\\": [\\"tool\\"]}}")
  (memory (export "memory") 1)
  (data (i32.const 16) "{OPENER}")
  (data (i32.const 512) "start: ((")
  (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "tool_feed") (param i32 i32) (result i64) (i64.const 0))
  (func (export "tool_finish") (result i64) (i64.const 0))
  (func (export "tool_force") (param i32 i32) (result i64) (i64.const {(16 << 32) | OPENER_LEN}))
  (func (export "tool_grammar") (param i32 i32) (result i64) (i64.const {(512 << 32) | 9})))"""


def build(wat_text, out):
    src = out.with_suffix(".wat")
    src.write_text(wat_text)
    subprocess.run([BINARY, "plugins", "build-wat", str(src), str(out)], check=True)
    src.unlink()
    return out.read_bytes()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    folder = tmp_path_factory.mktemp("constraint-plugins")
    build(open(SOURCE).read(), folder / "lowercase.wasm")
    build(TRAP, folder / "mask-trap.wasm")
    build(BAD_GRAMMAR, folder / "bad-grammar.wasm")
    s = Server("--plugins", str(folder))
    yield s, folder
    s.stop()


def chat(url, content, **extra):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def text_of(r):
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_the_plugin_holds_every_reply_to_lower_case_words_against_the_baseline(live):
    s, _ = live
    free = [text_of(chat(s.url, p)) for p in PROMPTS]
    held = [text_of(chat(s.url, p, plugins=CONSTRAINT)) for p in PROMPTS]
    print("baseline:", free)
    print("constrained:", held)
    assert not any(WORDS.match(t) for t in free), "the baseline already writes lower-case words; the test shows nothing"
    assert all(WORDS.match(t) for t in held), held
    # Streamed: the same text.
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 24, "temperature": 0,
            "stream": True, "plugins": CONSTRAINT}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = [l[6:] for l in r.iter_lines() if l.startswith("data: ") and l != "data: [DONE]"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, lines) if c["choices"])
    assert streamed == held[0]


def test_completions_and_anthropic_take_the_plugin_too(live):
    s, _ = live
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 16,
                                                    "temperature": 0, "plugins": CONSTRAINT}, timeout=120)
    assert r.status_code == 200, r.text
    assert WORDS.match(r.json()["choices"][0]["text"]), r.json()
    r = httpx.post(s.url + "/v1/messages", json={"model": "m", "max_tokens": 16, "plugins": CONSTRAINT,
                                                 "messages": [{"role": "user", "content": PROMPTS[1]}]}, timeout=120)
    assert r.status_code == 200, r.text
    assert WORDS.match(r.json()["content"][0]["text"]), r.json()


def test_speculation_under_the_plugin_gives_the_plain_constrained_reply(live):
    s, _ = live
    text = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"
    body = {"prompt": text, "max_tokens": 32, "temperature": 0, "plugins": CONSTRAINT}
    plain = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()
    spec = httpx.post(s.url + "/v1/completions", json={**body, "speculative": "prompt-lookup"}, timeout=120).json()
    assert WORDS.match(plain["choices"][0]["text"]), plain
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["usage"]["speculative"]["drafted_tokens"] > 0, spec["usage"]


def test_replacing_the_file_changes_the_constraint_without_a_restart(live):
    s, folder = live
    target = folder / "lowercase.wasm"
    original = target.read_bytes()
    # Only a-m: the same module with its last letter changed.
    narrow = build(open(SOURCE).read().replace("(global $last i32 (i32.const 122))", "(global $last i32 (i32.const 109))"),
                   folder.parent / "narrow.wasm")
    try:
        for version, letters in [(narrow, "abcdefghijklm "), (original, "abcdefghijklmnopqrstuvwxyz ")]:
            target.write_bytes(version)
            want, start = hashlib.sha256(version).hexdigest(), time.time()
            while not any(p.get("sha256") == want and p["state"] != "refused"
                          for p in httpx.get(s.url + "/v1/plugins").json()["data"]):
                assert time.time() - start < 5, "the new version was not loaded within 5 s"
                time.sleep(0.05)
            out = [text_of(chat(s.url, p, plugins=CONSTRAINT)) for p in PROMPTS]
            print(letters.strip(), out)
            assert all(set(t) <= set(letters) and WORDS.match(t) for t in out), out
            if version is narrow:
                free = text_of(chat(s.url, PROMPTS[0])).lower()
                assert set(free) & set("nopqrstuvwxyz"), "the unconstrained reply uses letters past m, so the narrow one shows the new version"
    finally:
        target.write_bytes(original)


def test_a_broken_constraint_plugin_fails_only_its_request(live):
    s, _ = live
    r = chat(s.url, PROMPTS[0], plugins={"constraint": {"name": "mask-trap"}})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "plugin_error" and "mask-trap" in err["message"] and "constraint_mask" in err["message"], err
    # With a fallback the request carries on unconstrained.
    r = chat(s.url, PROMPTS[0], plugins={"constraint": {"name": "mask-trap", "fallback": True}})
    assert text_of(r) == text_of(chat(s.url, PROMPTS[0]))
    # The server keeps serving the plugin that works.
    assert WORDS.match(text_of(chat(s.url, PROMPTS[0], plugins=CONSTRAINT)))


@pytest.mark.parametrize("extra,param,words", [
    ({"plugins": CONSTRAINT, "response_format": {"type": "json_object"}}, "response_format", "one constraint"),
    ({"plugins": CONSTRAINT, "regex": "[a-z]+"}, "regex", "one constraint"),
    ({"plugins": {"constraint": {"name": "nope"}}}, "plugins", "loaded constraint plugins: guidance, lowercase, mask-trap"),
    ({"plugins": {"constraint": {"name": "mirostat"}}}, "plugins", "is not a constraint plugin"),
    ({"plugins": {"constraint": "lowercase"}}, "plugins", ""),
])
def test_bad_constraint_selections_are_400s_that_say_why(live, extra, param, words):
    s, _ = live
    r = chat(s.url, PROMPTS[0], **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.get("param") == param and words in err["message"], err


def test_a_tool_adapter_grammar_that_does_not_compile_leaves_the_forced_call_unconstrained(live):
    s, _ = live
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    before = len(s.log)
    r = chat(s.url, PROMPTS[0], tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
             plugins={"tool": {"name": "bad-grammar"}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    assert any("a forced tool call goes unconstrained" in line for line in s.log[before:]), "".join(s.log[before:])
