"""Plugin authoring as a new author meets it: `host plugins new` skeletons in every language
build with the toolchains scripts/test-fixtures.sh installs and pass `host plugins check`,
then change real generations in a running server; `host plugins check` loads a file the way
the server does; `host plugins add-manifest` serves toolchains that cannot emit the manifest."""
import json
import os
import subprocess
import threading
import time

import httpx
import pytest

from conftest import ROOT, Server, build_wasm_plugin

BINARY = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
MOON = [{"role": "user", "content": "Tell me two facts about the Moon."}]
LANGS = ["rust", "c", "zig", "assemblyscript", "wat"]
SKELETONS = [(lang, kind) for lang in LANGS for kind in ["sampler", "stop"]] + \
            [("rust", kind) for kind in ["tool", "reasoning", "scheduler"]]


def host(*args, **kw):
    return subprocess.run([BINARY, *args], capture_output=True, text=True, timeout=120, **kw)


def toolchain_env(tmp):
    # No HOST and no `host` on PATH: each build.sh finds the binary that wrote it (issue 42).
    env = dict(os.environ, CARGO_TARGET_DIR=str(tmp / "target"), CARGO_NET_OFFLINE="true")
    env.pop("HOST", None)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not os.path.exists(os.path.join(p, "host")))
    if os.environ.get("HOST_ASC"):
        env["ASC"] = os.environ["HOST_ASC"]
    if os.environ.get("HOST_ZIG_DIR"):
        env.update(ZIG="python3 -m ziglang", PYTHONPATH=os.environ["HOST_ZIG_DIR"])
    return env


@pytest.fixture(scope="module")
def skeletons(tmp_path_factory):
    """Every skeleton, written by `host plugins new` and built by its own build.sh:
    {(lang, kind): (build result, path of the .wasm)}."""
    tmp = tmp_path_factory.mktemp("skeletons")
    env = toolchain_env(tmp)
    built = {}
    for lang, kind in SKELETONS:
        name = f"my-{lang}-{kind}"
        new = host("plugins", "new", name, "--kind", kind, "--lang", lang, "--dir", str(tmp / name))
        assert new.returncode == 0, new.stderr
        build = subprocess.run([str(tmp / name / "build.sh")], capture_output=True, text=True, env=env, timeout=600)
        built[(lang, kind)] = (build, tmp / name / f"{name}.wasm")
    return built


@pytest.mark.parametrize("lang,kind", SKELETONS)
def test_each_skeleton_builds_and_passes_check(skeletons, lang, kind):
    build, wasm = skeletons[(lang, kind)]
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    assert f"ok: my-{lang}-{kind} 0.1.0 (ABI v1), kinds: {kind}" in build.stdout, build.stdout
    assert "host_init: accepted" in build.stdout and wasm.exists()


def test_skeletons_refuse_what_they_cannot_write(tmp_path):
    r = host("plugins", "new", "t", "--kind", "tool", "--lang", "c", "--dir", str(tmp_path / "t"))
    assert r.returncode != 0 and "there is no C skeleton for a tool plugin" in r.stderr, r.stderr
    r = host("plugins", "new", "Bad Name", "--kind", "stop", "--lang", "wat", "--dir", str(tmp_path / "b"))
    assert r.returncode != 0 and "is invalid" in r.stderr, r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    r = host("plugins", "new", "x", "--kind", "stop", "--lang", "wat", "--dir", str(tmp_path / "full"))
    assert r.returncode != 0 and "not empty" in r.stderr and (tmp_path / "full" / "x").read_text() == "mine"


@pytest.fixture(scope="module")
def served(skeletons, tmp_path_factory):
    """A server over every skeleton that built, and the replay sampler (to script output)."""
    d = tmp_path_factory.mktemp("served")
    build_wasm_plugin("replay-sampler", "replay", d)
    for (build, wasm) in skeletons.values():
        if build.returncode == 0:
            (d / wasm.name).write_bytes(wasm.read_bytes())
    s = Server("--plugins", str(d), "--prompt-cache-bytes", "0")
    yield s
    s.stop()


def chat(server, plugins=None, messages=MOON, max_tokens=24, **kw):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}
    if plugins is not None:
        body["plugins"] = plugins
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("lang", LANGS)
def test_a_generated_sampler_changes_a_real_generation(served, lang):
    """The sampler skeleton decodes greedily at any temperature."""
    greedy = chat(served)["message"]["content"]
    sampled = {chat(served, temperature=1.5, seed=seed)["message"]["content"] for seed in (1, 2)}
    assert greedy not in sampled, "temperature 1.5 should stray from greedy"
    plugged = chat(served, {"sampler": {"name": f"my-{lang}-sampler"}}, temperature=1.5, seed=1)
    assert plugged["message"]["content"] == greedy


@pytest.mark.parametrize("lang", LANGS)
def test_a_generated_stop_rule_ends_the_reply_after_its_first_sentence(served, lang):
    plain = chat(served)["message"]["content"]
    assert plain.startswith("1. The Moon") and len(plain) > 10, plain
    stopped = chat(served, {"stop": [{"name": f"my-{lang}-stop"}]})
    assert (stopped["message"]["content"], stopped["finish_reason"]) == ("1.", "stop")


def script(server, text):
    """Replay-sampler params that make the model write `text`, then end its turn."""
    ids = lambda t: httpx.post(server.url + "/tokenize", json={"prompt": t}, timeout=30).json()["tokens"]
    return {"name": "replay", "params": {"tokens": ids(text) + ids("<|im_end|>")}}


def test_the_generated_rust_tool_adapter_and_reasoning_parser(served):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    text = 'Let me look. <call name="get_weather">{"city": "Oslo"}</call>'
    plugins = {"sampler": script(served, text), "tool": {"name": "my-rust-tool"}}
    reply = chat(served, plugins, max_tokens=60, tools=tools)
    call = reply["message"]["tool_calls"][0]["function"]
    assert (reply["message"]["content"], call["name"], json.loads(call["arguments"])) == \
        ("Let me look. ", "get_weather", {"city": "Oslo"}), reply
    assert reply["finish_reason"] == "tool_calls"
    plugins = {"sampler": script(served, "<think>Moons orbit planets.</think> The Moon orbits Earth."),
               "reasoning": {"name": "my-rust-reasoning"}}
    reply = chat(served, plugins, max_tokens=60)
    assert (reply["message"]["reasoning_content"], reply["message"]["content"]) == \
        ("Moons orbit planets.", "The Moon orbits Earth."), reply


def test_the_generated_rust_scheduler_serves_the_shortest_prompt_first(skeletons, tmp_path):
    build, wasm = skeletons[("rust", "scheduler")]
    assert build.returncode == 0
    (tmp_path / wasm.name).write_bytes(wasm.read_bytes())
    s = Server("--plugins", str(tmp_path), "--scheduler", "my-rust-scheduler", "--prompt-cache-bytes", "0",
               "--max-batch", "1")
    try:
        done = {}

        def go(key, messages, max_tokens, **extra):
            r = httpx.post(s.url + "/v1/chat/completions", timeout=300,
                           json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
            done[key] = (time.time(), r.status_code)
        essay = [{"role": "user", "content": "Summarize this: " + "The quick brown fox jumps over the lazy dog. " * 40}]
        # The first request cannot end early (end-of-sequence banned): it holds the slot for
        # seconds after the other two arrive, however fast the machine.
        threads = [threading.Thread(target=go, args=("first", MOON, 100), kwargs={"logit_bias": {"2": -100}})]
        threads[0].start()
        time.sleep(1.0)  # The first request holds the only slot ...
        threads.append(threading.Thread(target=go, args=("long", essay, 3)))
        threads[-1].start()
        time.sleep(0.5)  # ... while a long prompt and then a short one wait.
        threads.append(threading.Thread(target=go, args=("short", MOON, 3)))
        threads[-1].start()
        for t in threads:
            t.join(300)
        assert {k: v[1] for k, v in done.items()} == {"first": 200, "long": 200, "short": 200}
        assert done["short"][0] < done["long"][0], done
        status = {p["name"]: p for p in httpx.get(s.url + "/v1/plugins").json()["data"]}
        assert status["my-rust-scheduler"]["calls"] > 0 and status["my-rust-scheduler"]["faults"] == 0
    finally:
        s.stop()


def wat_plugin(path, body, manifest=True):
    head = '(@custom "host.plugin" "{\\"abi\\": 1, \\"name\\": \\"needs-config\\", \\"kinds\\": [\\"stop\\"]}")' \
        if manifest else ""
    path.with_suffix(".wat").write_text(f"""(module {head} (memory (export "memory") 1)
      (func (export "host_alloc") (param i32) (result i32) (i32.const 1024))
      (func (export "stop_check") (param i32 i32 i32) (result i32) (i32.const -1)) {body})""")
    r = host("plugins", "build-wat", str(path.with_suffix(".wat")), str(path))
    assert r.returncode == 0, r.stderr


# host_init accepts a config only when it is {"n":1} (7 bytes, the sixth a "1").
NEEDS_CONFIG = """(func (export "host_init") (param $p i32) (param $n i32) (result i32)
  (if (result i32) (i32.and (i32.eq (local.get $n) (i32.const 7)) (i32.eq (i32.load8_u offset=5 (local.get $p)) (i32.const 49)))
    (then (i32.const 0)) (else (i32.const 1))))"""


def test_plugins_check_loads_a_file_as_the_server_does(tmp_path):
    """A plugin that needs a config passes with a note, is checked with --config or its
    settings file (found by the plugin's name), and a module that cannot start fails."""
    wasm = tmp_path / "file-name.wasm"
    wat_plugin(wasm, NEEDS_CONFIG)
    r = host("plugins", "check", str(wasm))
    assert r.returncode == 0 and "note: plugin needs-config refused its config" in r.stdout, r.stdout + r.stderr
    r = host("plugins", "check", str(wasm), "--config", '{"n":1}')
    assert r.returncode == 0 and 'host_init: accepted {"n":1}' in r.stdout, r.stdout + r.stderr
    r = host("plugins", "check", str(wasm), "--config", '{"n":2}')
    assert r.returncode != 0 and "refused its config" in r.stderr, r.stderr
    assert host("plugins", "check", str(wasm), "--config", "{oops").returncode != 0
    (tmp_path / "needs-config.toml").write_text('config = { n = 1 }\ndeadline_ms = 20\n')
    r = host("plugins", "check", str(wasm))
    assert r.returncode == 0 and "deadline 20 ms" in r.stdout and "host_init: accepted" in r.stdout, r.stdout
    (tmp_path / "needs-config.toml").write_text('config = { n = 2 }\n')
    r = host("plugins", "check", str(wasm))
    assert r.returncode != 0 and "refused its config" in r.stderr, r.stderr
    spin = tmp_path / "spin.wasm"
    wat_plugin(spin, "(func $spin (loop $l (br $l))) (start $spin)")
    r = host("plugins", "check", str(spin))
    assert r.returncode != 0 and "exceeded its deadline in instantiation" in r.stderr, r.stderr


def test_add_manifest_gives_a_bare_module_its_manifest(tmp_path):
    """For toolchains that cannot emit custom sections (wabt's wat2wasm drops `@custom`)."""
    bare = tmp_path / "bare.wasm"
    wat_plugin(bare, "", manifest=False)
    r = host("plugins", "check", str(bare))
    assert r.returncode != 0 and "no `host.plugin` custom section" in r.stderr
    manifest = tmp_path / "m.json"
    manifest.write_text('{"abi": 1, "name": "bare", "version": "2.0.0", "kinds": ["stop"]}')
    r = host("plugins", "add-manifest", str(bare), str(manifest), "-o", str(tmp_path / "out.wasm"))
    assert r.returncode == 0, r.stderr
    r = host("plugins", "check", str(tmp_path / "out.wasm"))
    assert r.returncode == 0 and "ok: bare 2.0.0" in r.stdout, r.stdout + r.stderr
    manifest.write_text('{"abi": 1, "name": "bare", "kinds": ["frobnicate"]}')
    r = host("plugins", "add-manifest", str(bare), str(manifest))
    assert r.returncode != 0 and "m.json" in r.stderr, r.stderr
