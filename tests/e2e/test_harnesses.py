"""The real agent harnesses against `host serve` on SmolLM2, through `host launch`: pi and
opencode (OpenAI chat completions), Codex CLI (the Responses API) and Claude Code (Anthropic
Messages, its ~12,000-token first prompt included), installed from npm at pinned versions by
scripts/test-fixtures.sh. Each harness runs non-interactively twice:

- scripted: the `harness-script` test sampler (tests/plugins/harness-script) writes a call of
  the harness's shell tool the first time and a final answer once the tool's result is in
  the prompt; the harness must run the tool, send its result back and print the answer;
- unscripted: SmolLM2's own reply (the script stands aside when the prompt says
  "unscripted"; the reply is printed, it is whatever the model says).

The server log must show the harness's route, each turn once (no retries)."""
import json
import os
import re
import subprocess

import httpx
import pytest

from conftest import ROOT, Server, build_wasm_plugin

ANSWER = "All done: the check passed."
# (API in the log, the shell tool's call, the non-interactive command line before the prompt)
HARNESSES = {
    "pi": ("chat", {"name": "bash", "arguments": {"command": "echo harness-check"}}, ["-p", "--no-session"]),
    "opencode": ("chat", {"name": "bash", "arguments": {"command": "echo harness-check", "description": "Run the check"}},
                 ["run"]),
    "codex": ("responses", {"name": "exec_command", "arguments": {"cmd": "echo harness-check"}},
              ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]),
    "claude": ("messages", {"name": "Bash", "arguments": {"command": "echo harness-check", "description": "Run the check"}},
               ["--allowedTools", "Bash", "-p"]),
}


def harness_bin():
    d = os.environ.get("HOST_HARNESS_BIN")
    if not d or not os.path.isdir(d):
        pytest.fail("HOST_HARNESS_BIN is not set or missing: run eval \"$(scripts/test-fixtures.sh)\" (it needs npm)")
    return d


@pytest.fixture(scope="module")
def script_dir(tmp_path_factory):
    return build_wasm_plugin("harness-script", "harness-script", tmp_path_factory.mktemp("harness-script"))


def tokens(server, text):
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def launch(name, url, home, prompt):
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               PATH=harness_bin() + os.pathsep + os.environ["PATH"], NO_COLOR="1", CI="1")
    binary = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
    cmd = [binary, "launch", name, "--url", url, "--", *HARNESSES[name][2], prompt]
    return subprocess.run(cmd, env=env, cwd=home / "work", capture_output=True, text=True, timeout=1200,
                          stdin=subprocess.DEVNULL)


def script_config(server, call, path):
    """A host.toml whose default sampler is the harness script: `call` first, ANSWER after
    the tool's result, SmolLM2's own words when the prompt says "unscripted"."""
    [eos] = tokens(server, "<|im_end|>")
    params = {
        "call": tokens(server, "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"),
        "answer": tokens(server, ANSWER),
        "tool_marker": tokens(server, "<|im_start|>tool"),
        "plain_markers": [tokens(server, "unscripted"), tokens(server, " unscripted")],
        "plain_limit": 24,
        "eos": eos,
    }
    inline = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in params.items()) + " }"  # arrays of ints: TOML too
    path.write_text(f'[default_plugins]\nsampler = {{ name = "harness-script", params = {inline} }}\n')
    return path


@pytest.mark.parametrize("name", list(HARNESSES))
def test_the_harness_round_trips_a_tool_call_and_replies_unscripted(name, server, script_dir, tmp_path):
    api, call, _ = HARNESSES[name]
    config = script_config(server, call, tmp_path / "host.toml")
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    # Claude Code's first prompt (~12,000 tokens) is past SmolLM2's 8,192-token context.
    s = Server("--plugins", str(script_dir), "--config", str(config), "--context-length", "32768")
    try:
        scripted = launch(name, s.url, home, "Run the check with your shell tool, then say what happened.")
        assert scripted.returncode == 0, f"{name} exit {scripted.returncode}\n{scripted.stdout}\n{scripted.stderr[-4000:]}"
        assert ANSWER in scripted.stdout, f"{name}:\n{scripted.stdout}\n{scripted.stderr[-4000:]}"
        turns = [line for line in s.log if "chat turn" in line]
        assert len(turns) >= 2 and all(f'api="{api}"' in t for t in turns), "".join(s.log[-40:])
        prompts = [int(re.search(r"prompt=(\d+)", t).group(1)) for t in turns]
        print(f"{name}: scripted turns' prompt tokens {prompts}")
        # A retried turn would repeat its prompt.
        assert len(set(prompts)) == len(prompts), f"{name} retried a turn: {prompts}"

        plain = launch(name, s.url, home, "unscripted: say hello to the user in one short sentence.")
        assert plain.returncode == 0, f"{name} exit {plain.returncode}\n{plain.stdout}\n{plain.stderr[-4000:]}"
        reply = plain.stdout.strip()
        print(f"{name}: unscripted SmolLM2 reply: {reply[-400:]!r}")
        assert reply, plain.stderr[-4000:]
        if name == "claude":
            # A new session's first prompt: all but its per-session parts come from the cache.
            last = [line for line in s.log if "generation (streamed)" in line][-1]
            prompt, cached = (int(re.search(rf"{k}=(\d+)", last).group(1)) for k in ("prompt", "cached"))
            print(f"claude: a new session's prompt {prompt} tokens, {cached} from the prompt cache")
            assert cached > prompt // 2, last
        requests = [line for line in s.log if "request method=POST" in line]
        assert all("status=200" in r for r in requests), "".join(requests)
    finally:
        s.stop()


def test_launch_starts_a_server_when_none_answers(server, script_dir, tmp_path):
    """`host launch` with serve arguments and no server on the port: it starts `host serve`,
    runs the harness against it (pi, the quickest), and stops it afterwards. The harness
    script drives the turns: SmolLM2 left to itself may answer pi with tool calls cut at the
    token limit, turn after turn (a CI run once spent 600 s so)."""
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    config = script_config(server, HARNESSES["pi"][1], tmp_path / "host.toml")
    model = os.path.join(os.environ["HOST_TEST_MODELS"], "smollm2-f32")
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               PATH=harness_bin() + os.pathsep + os.environ["PATH"], NO_COLOR="1")
    binary = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
    port = "18731"
    cmd = [binary, "launch", "pi", "--model", model, "--device", "cpu", "--port", port,
           "--plugins", str(script_dir), "--config", str(config),
           "--", *HARNESSES["pi"][2], "Run the check with your shell tool, then say what happened."]
    r = subprocess.run(cmd, env=env, cwd=home / "work", capture_output=True, text=True, timeout=600,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "starting host serve" in r.stderr and "serving smollm2-f32" in r.stderr, r.stderr
    assert ANSWER in r.stdout, r.stdout + r.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    # Without the harness installed, a clear error naming the npm package.
    r = subprocess.run([binary, "launch", "claude", "--url", "http://127.0.0.1:1"], capture_output=True, text=True,
                       env=dict(os.environ, PATH="/usr/bin:/bin"), timeout=60)
    assert r.returncode == 1 and "npm install -g @anthropic-ai/claude-code" in r.stderr, r.stderr
