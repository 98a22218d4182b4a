"""Wasm plugins (ABI v1) in a live server: the example plugins change real generations, and
hostile plugins fail only their own request (or are refused at load) while the server keeps
serving."""
import json
import os
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from conftest import ROOT, Server

Q = [{"role": "user", "content": "What is the capital of France?"}]
ALLOC = """
  (memory (export "memory") 2)
  (global $heap (mut i32) (i32.const 65536))
  (func (export "host_alloc") (param $size i32) (result i32)
    (local $ptr i32)
    (local.set $ptr (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (i32.and (i32.add (local.get $size) (i32.const 7)) (i32.const -8))))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow (i32.add (i32.div_u (i32.sub (global.get $heap) (i32.mul (memory.size) (i32.const 65536))) (i32.const 65536)) (i32.const 1))))))
    (local.get $ptr))
"""


def manifest(name, kinds='["sampler"]', abi=1):
    return '(@custom "host.plugin" "{\\"abi\\": %d, \\"name\\": \\"%s\\", \\"kinds\\": %s}")' % (abi, name, kinds.replace('"', '\\"'))


def sampler(name, body, extra=""):
    return f"""(module {manifest(name)} {ALLOC} {extra}
      (func (export "sampler_sample") (param $pos i32) (param $cand i32) (param $n i32) (result i32) {body}))"""


HOSTILE = {
    # Runs forever: the per-call deadline stops it.
    "spin": sampler("spin", "(loop $l (br $l)) (i32.const 0)"),
    # Grows memory without bound: the 64 MiB cap stops it.
    "hog": sampler("hog", "(loop $l (drop (memory.grow (i32.const 16))) (br $l)) (i32.const 0)"),
    # Reads far outside its memory.
    "oob": sampler("oob", "(i32.load (i32.const 0x7ffffff0))"),
    # Traps in each entry point.
    "trap-init": sampler("trap-init", "(i32.const 0)", '(func (export "host_init") (param i32 i32) (result i32) unreachable)'),
    "trap-begin": sampler("trap-begin", "(i32.const 0)", '(func (export "host_begin") (param i32 i32 i64) (result i32) unreachable)'),
    "trap-accept": sampler("trap-accept", "(i32.const 0)", '(func (export "sampler_accept") (param i32 i32) (result i32) unreachable)'),
    "trap-sample": sampler("trap-sample", "unreachable"),
    "bad-token": sampler("bad-token", "(i32.const 99999999)"),
    "trap-stop": f"""(module {manifest("trap-stop", '["stop"]')} {ALLOC}
      (func (export "stop_check") (param i32 i32 i32) (result i32) unreachable))""",
    # A stop rule that traps at its fourth token: after a stream has started.
    "late-trap": f"""(module {manifest("late-trap", '["stop"]')} {ALLOC} (global $n (mut i32) (i32.const 0))
      (func (export "stop_check") (param i32 i32 i32) (result i32)
        (global.set $n (i32.add (global.get $n) (i32.const 1)))
        (if (i32.gt_u (global.get $n) (i32.const 3)) (then unreachable)) (i32.const -1)))""",
    "refuse-config": sampler("refuse-config", "(i32.const 0)", '(func (export "host_init") (param i32 i32) (result i32) (i32.const 3))'),
    # A tool adapter that returns garbage, memory it does not have, or too much.
    "bad-tool": f"""(module {manifest("bad-tool", '["tool"]')} {ALLOC} (data (i32.const 1024) "garbage")
      (func (export "tool_feed") (param i32 i32) (result i64) (i64.const 0x0000040000000007))
      (func (export "tool_finish") (result i64) (i64.const 0)))""",
    "oob-tool": f"""(module {manifest("oob-tool", '["tool"]')} {ALLOC}
      (func (export "tool_feed") (param i32 i32) (result i64) (i64.const 0x7ffffff000000010))
      (func (export "tool_finish") (result i64) (i64.const 0)))""",
    "huge-tool": f"""(module {manifest("huge-tool", '["tool"]')} {ALLOC}
      (func (export "tool_feed") (param i32 i32) (result i64) (i64.const 0x000004007fffffff))
      (func (export "tool_finish") (result i64) (i64.const 0)))""",
    # A tool adapter that traps while the prompt is built (tool_render).
    "trap-render": f"""(module {manifest("trap-render", '["tool"]')} {ALLOC}
      (func (export "tool_feed") (param i32 i32) (result i64) (i64.const 0))
      (func (export "tool_finish") (result i64) (i64.const 0))
      (func (export "tool_render") (param i32 i32) (result i64) unreachable))""",
    # A scheduling policy that traps on every decision.
    "trap-sched": f"""(module {manifest("trap-sched", '["scheduler"]')} {ALLOC}
      (func (export "schedule") (param i32 i32) (result i64) unreachable))""",
    # Refused at load:
    "wrong-abi": f"(module {manifest('wrong-abi', abi=9)} {ALLOC})",
    "wasi": f"""(module (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i32 i32 i32) (result i32)))
      {manifest("wasi")} {ALLOC} (func (export "sampler_sample") (param i32 i32 i32) (result i32) (i32.const 0)))""",
    "no-manifest": f"(module {ALLOC})",
    "missing-export": f"(module {manifest('missing-export')} {ALLOC})",
    # A start function that never returns; initial memory over the 64 MiB cap.
    "spin-start": sampler("spin-start", "(i32.const 0)", "(func $spin (loop $l (br $l))) (start $spin)"),
    "big-memory": f"""(module {manifest("big-memory")} (memory (export "memory") 2048)
      (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
      (func (export "sampler_sample") (param i32 i32 i32) (result i32) (i32.const 0)))""",
}
REFUSED = {"wrong-abi": "ABI v9", "wasi": "wasi_snapshot_preview1.fd_write", "no-manifest": "no `host.plugin` custom section",
           "missing-export": "lacks the export `sampler_sample`",
           "spin-start": "exceeded its deadline in instantiation", "big-memory": "exceeded its memory limit of 64 MiB"}


@pytest.fixture(scope="module")
def plugins_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugins")
    binary = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
    sources = {name: os.path.join(ROOT, "examples", "wat", f"{name}.wat") for name in ["scripted", "first-sentence"]}
    for name, text in HOSTILE.items():
        path = d / f"{name}.wat"
        path.write_text(text)
        sources[name] = str(path)
    for name, src in sources.items():
        subprocess.run([binary, "plugins", "build-wat", src, str(d / f"{name}.wasm")], check=True)
    # A plugin written in Rust with plugin-sdk (plugins/top-n-sigma, also built in: this file
    # overrides the built-in one of the same name).
    subprocess.run(["cargo", "build", "--quiet", "--release", "--target", "wasm32-unknown-unknown", "-p", "top-n-sigma"],
                   cwd=ROOT, check=True)
    wasm = os.path.join(ROOT, "target", "wasm32-unknown-unknown", "release", "top_n_sigma.wasm")
    (d / "top-n-sigma.wasm").write_bytes(open(wasm, "rb").read())
    # A plugin written in C against plugin-sdk/include/plugin.h (needs clang and lld).
    if shutil.which("clang") and shutil.which("wasm-ld"):
        subprocess.run([os.path.join(ROOT, "examples", "c", "build.sh"), str(d / "scripted-c.wasm")], check=True)
    elif os.environ.get("CI"):
        pytest.fail("clang and lld are needed to build examples/c under CI")
    # The same plugin in Zig (Zig from PyPI; scripts/test-fixtures.sh installs it).
    zig_dir = os.environ.get("HOST_ZIG_DIR")
    if zig_dir and os.path.isdir(zig_dir):
        env = dict(os.environ, PYTHONPATH=zig_dir, ZIG="python3 -m ziglang")
        subprocess.run([os.path.join(ROOT, "examples", "zig", "build.sh"), str(d / "scripted-zig.wasm")], check=True, env=env)
    elif os.environ.get("CI"):
        pytest.fail("Zig is needed to build examples/zig under CI (scripts/test-fixtures.sh installs it)")
    # And in AssemblyScript (from npm; scripts/test-fixtures.sh installs it).
    asc = os.environ.get("HOST_ASC")
    if asc and os.path.exists(asc):
        env = dict(os.environ, ASC=asc, HOST=binary)
        subprocess.run([os.path.join(ROOT, "examples", "assemblyscript", "build.sh"), str(d / "scripted-as.wasm")],
                       check=True, env=env)
    elif os.environ.get("CI"):
        pytest.fail("AssemblyScript is needed to build examples/assemblyscript under CI (scripts/test-fixtures.sh installs it)")
    return d


@pytest.fixture(scope="module")
def plugged(plugins_dir):
    # No prompt cache: every request prefills from scratch, so greedy outputs compare exactly.
    s = Server("--plugins", str(plugins_dir), "--prompt-cache-bytes", "0")
    yield s
    s.stop()


def chat(server, plugins, stream=False, messages=Q, max_tokens=6, timeout=60, **kw):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "plugins": plugins, "stream": stream, **kw}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=timeout)


def test_a_scripted_sampler_forces_its_tokens_in_both_apis(plugged):
    r = chat(plugged, {"sampler": {"name": "scripted"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " Paris. Paris. Paris."
    streamed = chat(plugged, {"sampler": {"name": "scripted"}}, stream=True).text
    assert '"content":" Paris"' in streamed and streamed.rstrip().endswith("[DONE]")
    m = httpx.post(plugged.url + "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": Q,
                                                        "plugins": {"sampler": {"name": "scripted"}}}, timeout=60)
    assert m.json()["content"][0]["text"] == " Paris. Paris."


@pytest.mark.parametrize("language", ["c", "zig", "as"])
def test_the_same_sampler_written_in_c_zig_and_assemblyscript(plugged, plugins_dir, language):
    if not (plugins_dir / f"scripted-{language}.wasm").exists():
        pytest.skip(f"no {language} toolchain")
    r = chat(plugged, {"sampler": {"name": f"scripted-{language}"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " Paris. Paris. Paris."


def test_the_example_samplers_read_a_prompt_longer_than_one_accept_call(plugins_dir):
    """The host hands a sampler the prompt in calls of at most 4,096 tokens (ABI.md §5.1):
    the examples in every language still count generated tokens right on a longer prompt."""
    s = Server("--plugins", str(plugins_dir))  # With the prompt cache: one long prefill in all.
    try:
        def prompt(words):
            text = "Repeat after me. " + "the cat sat on the mat " * 700 + "cat " * words + "\nWhat is the capital of France?"
            return [{"role": "user", "content": text}]
        count = lambda m: httpx.post(s.url + "/tokenize", json={"messages": m}, timeout=120).json()["count"]
        # An odd number of tokens past the first 4,096: a sampler that took the first call
        # for the whole prompt would be off by one (and force "." first).
        long = next(m for m in (prompt(w) for w in range(4)) if count(m) > 4096 and (count(m) - 4096) % 2 == 1)
        for name in ["scripted", "scripted-c", "scripted-zig", "scripted-as"]:
            if not (plugins_dir / f"{name}.wasm").exists():
                continue
            # The first one prefills ~4,200 tokens on the CPU in a debug build: about a minute.
            r = chat(s, {"sampler": {"name": name}}, messages=long, max_tokens=4, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == " Paris. Paris.", name
    finally:
        s.stop()


def test_a_stop_rule_plugin_ends_generation(plugged):
    moon = [{"role": "user", "content": "Tell me two facts about the Moon."}]
    plain = chat(plugged, {}, messages=moon, max_tokens=60).json()["choices"][0]["message"]["content"]
    assert plain.startswith("1. The Moon is")
    r = chat(plugged, {"stop": [{"name": "first-sentence"}]}, messages=moon, max_tokens=60).json()
    assert r["choices"][0]["message"]["content"] == "1."
    assert r["choices"][0]["finish_reason"] == "stop"
    m = httpx.post(plugged.url + "/v1/messages", json={"model": "m", "max_tokens": 60, "messages": moon, "temperature": 0,
                                                        "plugins": {"stop": [{"name": "first-sentence"}]}}, timeout=60).json()
    assert m["content"][0]["text"] == "1." and m["stop_reason"] == "stop_sequence"


def test_a_rust_sdk_sampler_with_config_and_seeded_randomness(plugged):
    # A tiny sigma band keeps only the best candidate: greedy decoding.
    r = chat(plugged, {"sampler": {"name": "top-n-sigma", "config": {"n": 0.0001}}}, max_tokens=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    story = [{"role": "user", "content": "Write a short story about a robot."}]
    wide = {"sampler": {"name": "top-n-sigma", "config": {"n": 3.0, "temperature": 1.5}}}
    a = chat(plugged, wide, messages=story, max_tokens=24, seed=11).json()["choices"][0]["message"]["content"]
    b = chat(plugged, wide, messages=story, max_tokens=24, seed=11).json()["choices"][0]["message"]["content"]
    c = chat(plugged, wide, messages=story, max_tokens=24, seed=12).json()["choices"][0]["message"]["content"]
    assert a == b and a != c
    r = chat(plugged, {"sampler": {"name": "top-n-sigma", "config": {"n": -1}}})
    assert r.status_code == 400 and "top-n-sigma" in r.json()["error"]["message"]


def test_unknown_or_wrong_kind_plugins_are_400(plugged):
    r = chat(plugged, {"sampler": {"name": "nope"}})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "unknown sampler plugin \"nope\"; loaded sampler plugins: " in message
    # Only samplers are offered (no stop rules, tool adapters or schedulers).
    offered = message.split("loaded sampler plugins: ")[1].split(", ")
    assert "scripted" in offered and not {"first-sentence", "hermes", "fcfs", "think"} & set(offered), offered
    r = chat(plugged, {"sampler": {"name": "first-sentence"}})
    assert r.status_code == 400 and "is not a sampler plugin (it is a stop plugin)" in r.json()["error"]["message"]
    # A plugin whose file was refused: the request is told so, with the reason.
    r = chat(plugged, {"sampler": {"name": "spin-start"}})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "spin-start.wasm was refused" in message and "deadline" in message, message
    r = chat(plugged, {"sampler": {"name": "refuse-config"}})
    assert r.status_code == 400 and "refused its config" in r.json()["error"]["message"]
    r = chat(plugged, {"sampler": {"nam": "x"}})
    assert r.status_code == 400


@pytest.mark.parametrize("name,reason", [
    ("spin", "exceeded its deadline in sampler_sample"), ("hog", "memory limit"), ("oob", "out of bounds"),
    ("trap-init", "host_init"), ("trap-begin", "host_begin"), ("trap-accept", "sampler_accept"),
    ("trap-sample", "trapped in sampler_sample"), ("bad-token", "outside the vocabulary"),
])
def test_a_hostile_sampler_fails_only_its_request(plugged, name, reason):
    start = time.time()
    r = chat(plugged, {"sampler": {"name": name}})
    assert r.status_code == 500, r.text
    msg = r.json()["error"]["message"]
    assert name in msg and reason in msg, msg
    assert time.time() - start < 10
    ok = chat(plugged, {})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"].startswith("The capital")


def test_a_request_can_allow_falling_back_to_native_paths(plugged):
    greedy = "The capital of France is Paris."
    for name in ["spin", "trap-sample", "trap-init", "trap-accept"]:
        r = chat(plugged, {"sampler": {"name": name, "fallback": True}}, max_tokens=30)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["choices"][0]["message"]["content"] == greedy, name
    r = chat(plugged, {"stop": [{"name": "trap-stop", "fallback": True}]}, max_tokens=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == greedy
    # A refused config is the client's error, fallback or not.
    assert chat(plugged, {"sampler": {"name": "refuse-config", "fallback": True}}).status_code == 400


def test_a_hostile_stop_rule_fails_only_its_request_even_when_streaming(plugged):
    r = chat(plugged, {"stop": [{"name": "trap-stop"}]})
    assert r.status_code == 500 and "trap-stop" in r.json()["error"]["message"]
    assert chat(plugged, {}).status_code == 200


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("name,reason", [
    ("bad-tool", "bad tool event"), ("oob-tool", "outside its memory"), ("huge-tool", "more than the 1048576"),
])
def test_a_hostile_tool_adapter_fails_only_its_request_or_falls_back_to_text(plugged, name, reason):
    r = chat(plugged, {"tool": {"name": name}}, tools=TOOLS)
    assert r.status_code == 500, r.text
    msg = r.json()["error"]["message"]
    assert name in msg and reason in msg and "tool_feed" in msg, msg
    r = chat(plugged, {"tool": {"name": name, "fallback": True}}, tools=TOOLS, max_tokens=12)
    assert r.status_code == 200, r.text
    # The text passes through untouched, the piece the adapter failed on included.
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert chat(plugged, {}).status_code == 200


def test_a_tool_adapter_faulting_while_the_prompt_is_built_is_left_out_when_the_request_allows(plugged):
    r = chat(plugged, {"tool": {"name": "trap-render"}}, tools=TOOLS)
    assert r.status_code == 500 and "trapped in tool_render" in r.json()["error"]["message"], r.text
    r = chat(plugged, {"tool": {"name": "trap-render", "fallback": True}}, tools=TOOLS)
    assert r.status_code == 200, r.text


def test_a_trapping_scheduler_leaves_the_queue_first_come_first_served(plugins_dir):
    s = Server("--plugins", str(plugins_dir), "--scheduler", "trap-sched", "--prompt-cache-bytes", "0")
    try:
        results = []

        def go():
            results.append(chat(s, {}, max_tokens=8).status_code)
        threads = [threading.Thread(target=go) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == [200] * 4
        status = {p["name"]: p for p in httpx.get(s.url + "/v1/plugins").json()["data"]}
        assert status["trap-sched"]["faults"] >= 1
        assert any("scheduling policy failed, serving first come first served" in line for line in s.log)
    finally:
        s.stop()


def test_broken_modules_are_refused_at_load_with_their_reason(plugged):
    status = {p["name"]: p for p in httpx.get(plugged.url + "/v1/plugins").json()["data"]}
    for name, reason in REFUSED.items():
        assert status[name]["state"] == "refused", status[name]
        assert reason in status[name]["error"], status[name]["error"]
    assert status["scripted"]["state"] == "ready" and len(status["scripted"]["sha256"]) == 64


def test_a_plugin_that_keeps_faulting_is_quarantined(plugged):
    """Three faults in a row quarantine a plugin file: requests for it get a 503 with
    Retry-After (or run without it when they allow a fallback) instead of running it."""
    for _ in range(4):
        r = chat(plugged, {"sampler": {"name": "trap-sample"}})
        if r.status_code == 503:
            break
        assert r.status_code == 500, r.text
    assert r.status_code == 503 and r.json()["error"]["code"] == "plugin_quarantined", r.text
    assert 1 <= int(r.headers["retry-after"]) <= 30 and "trapped in sampler_sample" in r.json()["error"]["message"]
    status = {p["name"]: p for p in httpx.get(plugged.url + "/v1/plugins").json()["data"]}
    assert status["trap-sample"]["state"] == "quarantined" and "quarantined for" in status["trap-sample"]["error"]
    faults = status["trap-sample"]["faults"]
    r = chat(plugged, {"sampler": {"name": "trap-sample", "fallback": True}}, max_tokens=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    status = {p["name"]: p for p in httpx.get(plugged.url + "/v1/plugins").json()["data"]}
    assert status["trap-sample"]["faults"] == faults, "a quarantined plugin does not run"


def test_a_fault_after_the_stream_started_is_an_error_event_with_its_code(plugged):
    r = chat(plugged, {"stop": [{"name": "late-trap"}]}, stream=True, max_tokens=20)
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert any(e.get("choices") for e in events), events[:2]
    error = events[-1]["error"]
    assert error["code"] == "plugin_error" and error["type"] == "server_error" and "late-trap" in error["message"], error
    # The Responses API: response.failed carries the same code.
    # Greedy: a sampled reply can end (EOS) before the stop rule's fourth call, where it traps.
    body = {"input": "What is the capital of France?", "max_output_tokens": 20, "stream": True, "temperature": 0,
            "plugins": {"stop": [{"name": "late-trap"}]}}
    text = httpx.post(plugged.url + "/v1/responses", json=body, timeout=60).text
    failed = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and "response.failed" in line]
    assert failed and failed[0]["response"]["error"]["code"] == "plugin_error", text[-500:]


def test_hot_reload_under_load(tmp_path, plugins_dir):
    """16 clients stream continuously while the scripted sampler is replaced 50 times,
    alternating good versions and broken ones: no request fails, each good version is served
    within 1 s of its write, each broken one is refused with its reason and the previous
    version keeps serving."""
    source = open(os.path.join(ROOT, "examples", "wat", "scripted.wat")).read()
    binary = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
    versions = {}
    for tag, script in {"v1": r"\82\1b\00\00\1e\00\00\00", "v2": r"\1e\00\00\00\1e\00\00\00"}.items():
        wat = tmp_path / f"{tag}.wat"
        wat.write_text(source.replace(r"\82\1b\00\00\1e\00\00\00", script))
        subprocess.run([binary, "plugins", "build-wat", str(wat), str(tmp_path / f"{tag}.wasm")], check=True)
        versions[tag] = (tmp_path / f"{tag}.wasm").read_bytes()
    texts = {"v1": " Paris.", "v2": ".."}
    broken = [b"\x00asm\x01\x00\x00\x00garbage", (plugins_dir / "wrong-abi.wasm").read_bytes(), b"not wasm at all"]
    live = tmp_path / "live"
    live.mkdir()
    target = live / "scripted.wasm"
    target.write_bytes(versions["v1"])
    s = Server("--plugins", str(live))
    import hashlib
    import threading

    def status():
        return {p["source"]: p for p in httpx.get(s.url + "/v1/plugins").json()["data"] if p["state"] != "refused"}, \
               [p for p in httpx.get(s.url + "/v1/plugins").json()["data"] if p["state"] == "refused"]

    stop = threading.Event()
    results, failures = [], []

    def client():
        with httpx.Client(base_url=s.url, timeout=60) as c:
            while not stop.is_set():
                body = {"messages": Q, "max_tokens": 2, "stream": True, "plugins": {"sampler": {"name": "scripted"}}}
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = [l for l in r.iter_lines() if l.startswith("data: ")]
                if r.status_code != 200 or lines[-1] != "data: [DONE]":
                    failures.append((r.status_code, lines[-3:]))
                    continue
                import json as _json
                text = "".join(_json.loads(l[6:])["choices"][0]["delta"].get("content") or ""
                               for l in lines[:-1] if _json.loads(l[6:])["choices"])
                results.append(text)

    threads = [threading.Thread(target=client) for _ in range(16)]
    try:
        for t in threads:
            t.start()
        current = "v1"
        for i in range(50):
            if i % 2 == 0:
                tag = "v2" if current == "v1" else "v1"
                target.write_bytes(versions[tag])
                want = hashlib.sha256(versions[tag]).hexdigest()
                start = time.time()
                while True:
                    ready, _ = status()
                    if ready.get(str(target), {}).get("sha256") == want:
                        break
                    assert time.time() - start < 1.0, f"version {tag} not served within 1 s"
                    time.sleep(0.02)
                current = tag
                # A stream started after the swap is sampled by the new version (waiting for
                # one makes "both versions served" a fact, not luck of timing under load).
                seen = len(results)
                while texts[tag] not in results[seen:]:
                    assert not failures, failures[:3]
                    assert time.time() - start < 30.0, f"no stream sampled by version {tag} within 30 s"
                    time.sleep(0.02)
            else:
                bad = broken[(i // 2) % len(broken)]
                target.write_bytes(bad)
                start = time.time()
                while True:
                    ready, refused = status()
                    if any(r["source"] == str(target) and r["error"] for r in refused):
                        break
                    assert time.time() - start < 1.0, "broken version not reported within 1 s"
                    time.sleep(0.02)
                # The previous good version keeps serving.
                assert ready[str(target)]["sha256"] == hashlib.sha256(versions[current]).hexdigest()
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 2, "plugins": {"sampler": {"name": "scripted"}}}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == texts[current]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        s.stop()
    assert not failures, failures[:3]
    # Every streamed output came from one of the good versions, and both were served.
    assert len(results) >= 16 and set(results) == set(texts.values()), (len(results), set(results))


def test_server_default_plugins_from_the_config_file(tmp_path, plugins_dir):
    config = tmp_path / "host.toml"
    config.write_text('prompt_cache_bytes = 0\n[default_plugins]\nsampler = { name = "scripted" }\n')
    s = Server("--plugins", str(plugins_dir), "--config", str(config))
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 2, "temperature": 0}, timeout=60)
        assert r.json()["choices"][0]["message"]["content"] == " Paris."
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 30, "temperature": 0, "plugins": {}}, timeout=60)
        assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    finally:
        s.stop()


def test_one_file_per_name_settings_by_name_and_the_way_back_from_quarantine(tmp_path, plugins_dir):
    """In a live folder: a second file declaring a taken name is refused (and deleting it
    changes nothing else); NAME.toml is matched by the plugin's name, not the file's, and
    reloads the plugin when it changes; a quarantined plugin comes back when its time is up
    (quarantine_secs) and at once when its file is replaced. The folder is given as a
    relative path, as the README's `--plugins plugins/` (issue 42: files present at start
    could then be neither replaced nor deleted)."""
    live = tmp_path / "live"
    live.mkdir()
    scripted = (plugins_dir / "scripted.wasm").read_bytes()
    (live / "scripted.wasm").write_bytes(scripted)
    (live / "zz-copy.wasm").write_bytes(scripted)
    (live / "tns_file.wasm").write_bytes((plugins_dir / "top-n-sigma.wasm").read_bytes())
    (live / "top-n-sigma.toml").write_text("config = { n = 0.0001 }\n")
    (live / "trap-sample.wasm").write_bytes((plugins_dir / "trap-sample.wasm").read_bytes())
    (live / "trap-sample.toml").write_text("quarantine_secs = 2\n")
    s = Server("--plugins", "live", "--prompt-cache-bytes", "0", cwd=tmp_path)

    def status():
        return [p for p in httpx.get(s.url + "/v1/plugins").json()["data"] if not p["source"].startswith("builtin:")]

    def until(predicate, limit=3):
        start = time.time()
        while not predicate():
            assert time.time() - start < limit, status()
            time.sleep(0.05)

    try:
        refused = [p for p in status() if p["state"] == "refused"]
        assert [(p["name"], p["source"].endswith("zz-copy.wasm")) for p in refused] == [("scripted", True)], refused
        assert "already provides" in refused[0]["error"] and "scripted.wasm" in refused[0]["error"]
        (live / "zz-copy.wasm").unlink()
        until(lambda: not any(p["state"] == "refused" for p in status()))
        assert chat(s, {"sampler": {"name": "scripted"}}).json()["choices"][0]["message"]["content"] == " Paris. Paris. Paris."
        # top-n-sigma.toml belongs to tns_file.wasm (whose plugin is top-n-sigma).
        r = chat(s, {"sampler": {"name": "top-n-sigma"}}, max_tokens=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
        (live / "top-n-sigma.toml").write_text("config = { n = -1 }\n")
        until(lambda: chat(s, {"sampler": {"name": "top-n-sigma"}}).status_code == 400)
        # Quarantined after three faults, back after its two seconds.
        for _ in range(3):
            assert chat(s, {"sampler": {"name": "trap-sample"}}).status_code == 500
        assert chat(s, {"sampler": {"name": "trap-sample"}}).status_code == 503
        until(lambda: chat(s, {"sampler": {"name": "trap-sample"}}).status_code == 500, limit=5)
        # Quarantined again; replacing the file brings it back at once.
        for _ in range(3):
            chat(s, {"sampler": {"name": "trap-sample"}})
        assert chat(s, {"sampler": {"name": "trap-sample"}}).status_code == 503
        (live / "trap-sample.wasm").write_bytes((plugins_dir / "trap-sample.wasm").read_bytes() + b"")
        os.utime(live / "trap-sample.wasm")
        until(lambda: chat(s, {"sampler": {"name": "trap-sample"}}).status_code == 500, limit=1.5)
    finally:
        s.stop()


def test_a_settings_file_gives_defaults_and_reloads_with_its_plugin(tmp_path, plugins_dir):
    live = tmp_path / "live"
    live.mkdir()
    (live / "top-n-sigma.wasm").write_bytes((plugins_dir / "top-n-sigma.wasm").read_bytes())
    settings = live / "top-n-sigma.toml"
    settings.write_text("deadline_ms = 200\nconfig = { n = 0.0001 }\n")
    s = Server("--plugins", str(live), "--prompt-cache-bytes", "0")

    def ask():
        return httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 30, "temperature": 0,
                                                                 "plugins": {"sampler": {"name": "top-n-sigma"}}}, timeout=60)

    def until(predicate):
        start = time.time()
        while not predicate():
            assert time.time() - start < 2, "settings change not applied"
            time.sleep(0.05)

    try:
        r = ask()
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
        settings.write_text("config = { n = -1 }\n")  # The plugin refuses this config.
        until(lambda: ask().status_code == 400)
        assert "refused its config" in ask().json()["error"]["message"]
        settings.write_text("dedline_ms = 3\n")  # A typo: refused, the previous version keeps serving.
        until(lambda: any(p["state"] == "refused" and "unknown field" in (p["error"] or "")
                          for p in httpx.get(s.url + "/v1/plugins").json()["data"]))
        assert ask().status_code == 400
    finally:
        s.stop()


def test_a_plugin_sampler_under_speculation_gives_the_same_tokens(plugged):
    # Sample and match runs the plugin at each drafted position, in order, and it only ever
    # sees committed tokens: its (seeded) output is unchanged by prompt lookup.
    edit = [{"role": "user", "content": open(os.path.join(ROOT, "bench", "edit_prompt.txt")).read()}]
    wide = {"sampler": {"name": "top-n-sigma", "config": {"n": 1.0, "temperature": 0.7}}}
    plain = chat(plugged, wide, messages=edit, max_tokens=40, seed=5).json()
    spec = chat(plugged, wide, messages=edit, max_tokens=40, seed=5, speculative="prompt-lookup").json()
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert spec["usage"]["speculative"]["drafted_tokens"] > 0, spec["usage"]
