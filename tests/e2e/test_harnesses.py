"""The real agent harnesses against `host serve` on SmolLM2, through `host launch`: pi and
opencode (OpenAI chat completions), Codex CLI (the Responses API) and Claude Code (Anthropic
Messages, its ~12,000-token first prompt included), installed from npm by
scripts/test-fixtures.sh at pinned versions and, for the harnesses with a newer release, at
the newest published one too. Each harness runs non-interactively twice:

- scripted: the `harness-script` test sampler (tests/plugins/harness-script) calls the
  harness's shell tool again and again, each call reading a log of ~880 tokens, so that the
  session outgrows the served window (`SESSION`); the harness must run each tool, send its
  result back, compact the conversation by itself before the server would refuse it (its
  own summariser's request reaches the server, and the script answers it with a summary),
  and print the answer the script gives once the summary is in the prompt (served by a tiny
  random Llama with SmolLM2's tokenizer and chat template: the script writes every reply, so
  SmolLM2's weights would only add minutes of prefill);
- unscripted: SmolLM2's own reply (the script stands aside when the prompt says
  "unscripted"; the reply is printed, it is whatever the model says).

The server log must show the harness's route, each turn once (no retries), and no refusal."""
import json
import os
import re
import subprocess

import httpx
import pytest

from conftest import ROOT, Server, build_wasm_plugin

ANSWER = "All done: the check passed."
SUMMARY = "Checkpoint: the logs were read in full and nothing failed."
SUMMARY_MARKER = " logs were read in full"
HELLO = "unscripted: say hello to the user in one short sentence."
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


# The harnesses whose newest published release is newer than the pinned one (as of
# 2026-12-06: Codex 0.171.0 and Claude Code 2.1.332; pi 0.73.1 and opencode 1.18.33 are both).
NEWER = ["codex", "claude"]
CASES = [(name, "pinned") for name in HARNESSES] + [(name, "newest") for name in NEWER]

# The words of each harness's own compaction requests (its summariser's instructions; Claude
# Code's for a model it does not know come from a forked agent on the session's own prompt).
COMPACTION = {
    "pi": ["context summarization assistant"],
    "opencode": ["anchored summary"],
    "codex": ["CHECKPOINT COMPACTION"],
    "claude": ["create a detailed summary", "tasked with summarizing conversations"],
}


# Each harness's served window, and the logs its session reads (count, lines of ~24 tokens):
# more than the window holds beside the harness's first prompt (pi ~1,450 tokens, Codex
# ~6,100, opencode ~7,500, Claude Code with its shell tool alone ~3,100; opencode and Claude
# Code get more than SmolLM2's own 8,192). pi and opencode compact by the last reply's token
# count, within the room `host launch` keeps for the tool results that follow (an eighth of
# the window); Codex counts them itself; Claude Code compacts once its count passes the window
# less its output less 13,000 tokens (5,432 of 24,576), and only where its fixed prompt is
# under that.
SESSION = {"pi": (8192, 8, 36), "codex": (8192, 3, 36), "opencode": (16384, 12, 36), "claude": (24576, 12, 90)}


def harness_bin(release="pinned"):
    var = "HOST_HARNESS_BIN" if release == "pinned" else "HOST_HARNESS_NEWEST_BIN"
    d = os.environ.get(var)
    if not d or not os.path.isdir(d):
        pytest.fail(f"{var} is not set or missing: run eval \"$(scripts/test-fixtures.sh)\" (it needs npm)")
    return d


@pytest.fixture(scope="module")
def script_dir(tmp_path_factory):
    return build_wasm_plugin("harness-script", "harness-script", tmp_path_factory.mktemp("harness-script"))


def tokens(server, text):
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def launch(name, url, home, prompt, release="pinned", extra=()):
    # PWD too: opencode's tools run where it says, not in the process's directory.
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), PWD=str(home / "work"),
               PATH=harness_bin(release) + os.pathsep + os.environ["PATH"], NO_COLOR="1", CI="1")
    binary = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
    prompts = [prompt] if isinstance(prompt, str) else prompt
    cmd = [binary, "launch", name, "--url", url, "--", *extra, *HARNESSES[name][2], *prompts]
    return subprocess.run(cmd, env=env, cwd=home / "work", capture_output=True, text=True, timeout=1200,
                          stdin=subprocess.DEVNULL)


def script_config(server, calls, path, compact=None, per_turn=0):
    """A host.toml whose default sampler is the harness script: the tool `calls` one after
    another, ANSWER after the last one's result, SmolLM2's own words when the prompt says
    "unscripted"; with `compact` (the words of the harness's compaction requests), SUMMARY
    for that request and ANSWER once the prompt holds it."""
    [eos] = tokens(server, "<|im_end|>")
    params = {
        "calls": [tokens(server, "<tool_call>\n" + json.dumps(call) + "\n</tool_call>") for call in calls],
        "answer": tokens(server, ANSWER),
        "tool_marker": tokens(server, "<|im_start|>tool"),
        "plain_markers": [tokens(server, "unscripted"), tokens(server, " unscripted")],
        "plain_limit": 24,
        "per_turn": per_turn,
        "user_marker": tokens(server, "<|im_start|>user"),
        "eos": eos,
    }
    if compact:
        params |= {
            "compact_markers": [tokens(server, p) for words in compact for p in (words, " " + words)],
            "summary": tokens(server, SUMMARY),
            "summary_marker": tokens(server, SUMMARY_MARKER),
        }
    inline = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in params.items()) + " }"  # arrays of ints: TOML too
    path.write_text(f'[default_plugins]\nsampler = {{ name = "harness-script", params = {inline} }}\n')
    return path


def running(call, command):
    """The shell tool's `call` running `command` instead."""
    args = dict(call["arguments"])
    args["cmd" if "cmd" in args else "command"] = command
    return {"name": call["name"], "arguments": args}


def write_logs(work, count, lines):
    """`count` log files of `lines` numbered lines each (about 24 tokens a line)."""
    for n in range(count):
        text = "".join(f"{i:04d} step {n}.{i} wrote value {(i * 7919 + n) % 10007} to the log and moved on\n"
                       for i in range(lines))
        (work / f"log-{n}.txt").write_text(text)


@pytest.mark.parametrize("name,release", CASES)
def test_a_harness_session_outgrows_the_window_compacts_and_replies_unscripted(name, release, server, script_dir,
                                                                              tmp_path):
    api, call, _ = HARNESSES[name]
    home = tmp_path / "home"
    work = home / "work"
    work.mkdir(parents=True)
    window, logs_count, lines = SESSION[name]
    write_logs(work, logs_count, lines)
    calls = [running(call, f"cat log-{n}.txt") for n in range(logs_count)]
    # pi looks at its window when a run ends, not between the steps of one: its session is a
    # run per log (`pi -p` takes several messages), the others' one run of every call.
    per_turn = 1 if name == "pi" else 0
    config = script_config(server, calls, tmp_path / "host.toml", compact=COMPACTION[name], per_turn=per_turn)
    served = ("--plugins", str(script_dir), "--config", str(config), "--context-length", str(window))
    # The scripted session on a tiny random Llama with SmolLM2's tokenizer and chat template:
    # the script writes every reply, so the model's weights only cost prefill time (minutes of
    # CI's on SmolLM2 at these lengths); SmolLM2 itself answers the unscripted prompts below.
    s = Server(*served, model=os.path.join(os.environ["HOST_TEST_MODELS"], "tiny-llama"))
    logs = []
    try:
        task = ([f"Read log-{n}.txt with your shell tool." for n in range(logs_count)] if per_turn else
                f"Read the logs log-0.txt to log-{logs_count - 1}.txt with your shell tool, one by one.")
        # Claude Code's session with its shell tool alone: with all of them its fixed prompt
        # (~12,000 tokens) is past the point it compacts at in any window SmolLM2 serves in
        # CI's time (see `SESSION`).
        scripted = launch(name, s.url, home, task, release, ["--tools", "Bash"] if name == "claude" else [])
        script = [line.split("scripted turn: ")[1].strip() for line in s.log if "scripted turn: " in line]
        turns = [line for line in s.log if "chat turn" in line]
        prompts = [int(re.search(r"prompt=(\d+)", t).group(1)) for t in turns]
        print(f"{name} ({release}): scripted turns {script}")
        print("".join(line for line in s.log if "chat turn" in line or "status=4" in line or "generation" in line))
        assert scripted.returncode == 0, f"{name} exit {scripted.returncode}\n{scripted.stdout}\n{scripted.stderr[-4000:]}"
        assert ANSWER in scripted.stdout, f"{name}:\n{scripted.stdout}\n{scripted.stderr[-4000:]}\n{script}"
        assert len(turns) >= 3, "".join(s.log[-40:])
        assert all(f'api="{api}"' in t for t in turns), "".join(s.log[-40:])
        # The session outgrew the window: its first prompt (with the tools; opencode's
        # title request comes first) and the logs do not fit in it.
        logs_tokens = sum(len(tokens(s, (work / f"log-{n}.txt").read_text())) for n in range(logs_count))
        first = next(p for t, p in zip(turns, prompts) if "tools=0" not in t)
        assert first + logs_tokens > window, (first, logs_tokens)
        # The harness compacted: its summariser's request came, then a turn on the summary.
        compacted = [i for i, m in enumerate(script) if m.startswith("summary")]
        assert compacted, script
        after = [m for m in script[compacted[0] + 1:] if m.startswith("answer")]
        assert after, script
        # The turn on the summary reuses the cached start it shares with the session's
        # (the harness's instructions and tools).
        resumed = int(re.search(r"prompt of (\d+)", after[0]).group(1))
        generation = next(line for line in s.log if "generation (streamed)" in line and f"prompt={resumed} " in line)
        cached = int(re.search(r"cached=(\d+)", generation).group(1))
        print(f"{name}: the turn after compaction: {resumed} prompt tokens, {cached} cached")
        assert cached >= first // 2, generation
        # A retried turn would repeat its prompt (the summariser's requests aside: pi sends a
        # pair, the history's and the cut turn's, Claude Code two, sometimes more than once).
        turn_prompts = [m for m in script if not m.startswith("summary")]
        assert len(set(turn_prompts)) == len(turn_prompts), f"{name} retried a turn: {script}"
    finally:
        s.stop()
        logs += s.log

    s = Server(*served)
    try:
        plain = launch(name, s.url, home, HELLO, release)
        assert plain.returncode == 0, f"{name} exit {plain.returncode}\n{plain.stdout}\n{plain.stderr[-4000:]}"
        reply = plain.stdout.strip()
        print(f"{name}: unscripted SmolLM2 reply: {reply[-400:]!r}")
        assert reply, plain.stderr[-4000:]
        if name == "claude":
            # A new session's first prompt (Claude Code's whole ~12,000 tokens, the scripted
            # session having had its shell tool only): all but its per-session parts come
            # from the cache.
            again = launch(name, s.url, home, HELLO, release)
            assert again.returncode == 0, f"{name} exit {again.returncode}\n{again.stdout}\n{again.stderr[-4000:]}"
            last = [line for line in s.log if "generation (streamed)" in line][-1]
            prompt, cached = (int(re.search(rf"{k}=(\d+)", last).group(1)) for k in ("prompt", "cached"))
            print(f"claude: a new session's prompt {prompt} tokens, {cached} from the prompt cache")
            assert cached > prompt // 2, last
    finally:
        s.stop()
        logs += s.log
    # Every request answered: each harness compacted before the server would refuse one.
    requests = [line for line in logs if "request method=POST" in line]
    assert all("status=200" in r for r in requests), "".join(requests)


def test_launch_starts_a_server_when_none_answers(server, script_dir, tmp_path):
    """`host launch` with serve arguments and no server on the port: it starts `host serve`,
    runs the harness against it (pi, the quickest), and stops it afterwards. The harness
    script drives the turns: SmolLM2 left to itself may answer pi with tool calls cut at the
    token limit, turn after turn (a CI run once spent 600 s so)."""
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    config = script_config(server, [HARNESSES["pi"][1]], tmp_path / "host.toml")
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

