"""Built-in plugins in a live server, with no --plugins flag needed: every built-in loads;
each tool adapter turns its format into tool calls in both APIs, streamed and not; the
samplers and stop rules change real generations; the scheduling policies order, pause and
cancel real requests. Outputs are scripted exactly with the `replay` test sampler
(tests/plugins/replay), which emits token ids given in its params."""
import json
import os
import re
import subprocess
import threading
import time

import anthropic
import httpx
import openai
import pytest

from conftest import ROOT, Server, build_wasm_plugin

Q = [{"role": "user", "content": "What is the capital of France?"}]
BUILTINS = {"mirostat": "sampler", "dry": "sampler", "xtc": "sampler", "typical-p": "sampler", "top-n-sigma": "sampler",
            "regex-stop": "stop", "max-sentences": "stop", "hermes": "tool", "qwen3-coder": "tool", "llama3-json": "tool",
            "mistral": "tool", "gemma": "tool", "fcfs": "scheduler", "priority": "scheduler",
            "shortest-prompt-first": "scheduler", "latest-wins": "scheduler", "fair": "scheduler", "think": "reasoning",
            "harmony": "tool", "harmony-channels": "reasoning", "guidance": "constraint", "minicpm5": "tool",
            "gemma4": "tool"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
ARGS = {"city": "Paris", "days": 3}
# The same call written in each adapter's format, after some prose where the format allows it.
FORMATS = {
    "hermes": ("Let me check. ", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'),
    "qwen3-coder": ("Let me check. ", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    "llama3-json": ("", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'),
    "mistral": ("Let me check. ", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'),
    "gemma": ("Let me check. ", '```tool_code\nget_weather(city="Paris", days=3)\n```'),
    "harmony": ("Let me check. ", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris", "days": 3}<|call|>'),
    "minicpm5": ("Let me check. ", '<function name="get_weather"><param name="city">Paris</param>'
                 '<param name="days">3</param></function>'),
    "gemma4": ("Let me check. ", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'),
}


@pytest.fixture(scope="module")
def replay_dir(tmp_path_factory):
    return build_wasm_plugin("replay-sampler", "replay", tmp_path_factory.mktemp("replay"))


@pytest.fixture(scope="module")
def srv(replay_dir):
    s = Server("--plugins", str(replay_dir), "--prompt-cache-bytes", "0")
    yield s
    s.stop()


def tokens(server, text):
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def script(server, text):
    """Replay params that make the model write `text`, then end its turn."""
    eos = tokens(server, "<|im_end|>")
    assert len(eos) == 1
    ids = tokens(server, text)
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == text
    return {"name": "replay", "params": {"tokens": ids + eos}}, len(ids) + 4


def chat(server, plugins=None, messages=Q, max_tokens=8, **kw):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}
    if plugins is not None:
        body["plugins"] = plugins
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_builtin_is_loaded_without_a_plugins_folder():
    s = Server("--prompt-cache-bytes", "0")
    try:
        listed = {p["name"]: p for p in httpx.get(s.url + "/v1/plugins").json()["data"]}
    finally:
        s.stop()
    for name, kind in BUILTINS.items():
        assert listed[name]["kinds"] == [kind], listed[name]
        assert listed[name]["source"] == f"builtin:{name}" and listed[name]["state"] == "ready", listed[name]


def test_earlier_calls_are_written_in_the_adapters_own_format(srv):
    """SmolLM2's template ignores tools: an assistant turn's earlier call reaches the prompt
    as the adapter writes calls (`tool_render_calls`), ahead of its result — Hermes for the
    server's default adapter, Gemma's tool_code under `--tool-adapter gemma`."""
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "cold"}]

    def prompt(server):
        r = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=30)
        assert r.status_code == 200, r.text
        return httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]

    hermes = prompt(srv)
    call = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    assert call in hermes and hermes.index(call) < hermes.index("cold"), hermes
    s = Server("--prompt-cache-bytes", "0", "--tool-adapter", "gemma")
    try:
        gemma = prompt(s)
    finally:
        s.stop()
    call = 'Checking.\n```tool_code\nget_weather(city="Oslo", days=2)\n```'
    assert call in gemma and gemma.index(call) < gemma.index("cold") and "<tool_call>" not in gemma, gemma


def test_hostile_tool_definitions_and_plugin_configs_are_400s_that_leave_the_builtins_healthy():
    """A 1 MB tool name, a schema of 20,000 properties, a 1 MB regex-stop pattern: each
    refused with a 400 naming the field before any plugin sees it (they used to fault the
    built-in tool adapters and regex-stop, 500s that marked them unhealthy for everyone)."""
    s = Server("--prompt-cache-bytes", "0")
    try:
        huge_name = [{"type": "function", "function": {"name": "f" * (1 << 20), "parameters": {"type": "object"}}}]
        props = {f"p{i}": {"type": "string"} for i in range(20_000)}
        wide = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}]
        for tools, param in [(huge_name, "tools[0].function.name"), (wide, "tools[0].function.parameters")]:
            r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 2, "tools": tools}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
            anthropic_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in tools]
            for route in ["/v1/messages", "/v1/messages/count_tokens"]:
                r = httpx.post(s.url + route, timeout=60,
                               json={"model": "m", "max_tokens": 2, "messages": Q, "tools": anthropic_tools})
                assert r.status_code == 400 and r.json()["type"] == "error", r.text[:300]
        stop = {"stop": [{"name": "regex-stop", "config": {"pattern": "a" * (1 << 20)}}]}
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 2, "plugins": stop}, timeout=60)
        assert r.status_code == 400 and "at most" in r.json()["error"]["message"], r.text[:300]
        listed = httpx.get(s.url + "/v1/plugins", timeout=30).json()["data"]
        assert all(p["state"] == "ready" and p["faults"] == 0 for p in listed), [p for p in listed if p["faults"]]
    finally:
        s.stop()


@pytest.mark.parametrize("adapter", list(FORMATS))
def test_each_tool_adapter_gives_tool_calls_in_both_apis_streamed_and_not(srv, adapter):
    prose, call = FORMATS[adapter]
    sampler, max_tokens = script(srv, prose + call)
    plugins = {"sampler": sampler, "tool": {"name": adapter}}
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    kw = dict(model="m", messages=Q, tools=TOOLS, max_tokens=max_tokens, temperature=0, extra_body={"plugins": plugins})
    r = oa.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert (choice.message.content or "") == prose
    [tc] = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather" and tc.id
    assert json.loads(tc.function.arguments) == ARGS
    # Streamed: the SDK reassembles the argument deltas.
    content, calls, finish, arg_deltas = "", {}, None, 0
    for chunk in oa.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or d.id
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
                arg_deltas += bool(d.function and d.function.arguments)
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == prose
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == ARGS
    # JSON formats stream the arguments while the model writes them; the others send them
    # when the call is complete.
    if adapter in ("hermes", "llama3-json", "mistral"):
        assert arg_deltas > 3, arg_deltas
    else:
        assert arg_deltas == 1, arg_deltas
    # Anthropic: tool_use blocks, stop_reason tool_use, streamed with input_json deltas.
    an = anthropic.Anthropic(base_url=srv.url, api_key="x")
    akw = dict(model="m", max_tokens=max_tokens, messages=Q, tools=ANTHROPIC_TOOLS, extra_body={"plugins": plugins})
    for message in [an.messages.create(**akw), an.messages.stream(**akw).__enter__().get_final_message()]:
        assert message.stop_reason == "tool_use", message
        uses = [b for b in message.content if b.type == "tool_use"]
        texts = "".join(b.text for b in message.content if b.type == "text")
        assert texts == prose
        assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input == ARGS
        assert uses[0].id.startswith("toolu_")


# What a model writes after each adapter's forced opening of a call to get_weather.
FORCED_REST = {
    "hermes": '{"city": "Paris", "days": 3}}\n</tool_call>',
    "qwen3-coder": "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "llama3-json": '{"city": "Paris", "days": 3}}',
    "mistral": '{"city": "Paris", "days": 3}}]',
    "gemma": 'city="Paris", days=3)\n```',
    "harmony": '{"city": "Paris", "days": 3}',
    "minicpm5": '<param name="city">Paris</param><param name="days">3</param></function>',
    "gemma4": 'city:<|"|>Paris<|"|>,days:3}<tool_call|>',
}


@pytest.mark.parametrize("adapter", list(FORMATS))
def test_a_forced_tool_choice_opens_the_reply_with_the_call_in_both_apis(srv, adapter):
    # The adapter's opening of the call sits at the end of the prompt; the (scripted) model
    # writes only the rest, and the client gets the call, not the text, in both APIs.
    sampler, max_tokens = script(srv, FORCED_REST[adapter])
    plugins = {"sampler": sampler, "tool": {"name": adapter}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    auto = chat(srv, plugins, tools=TOOLS, max_tokens=max_tokens)
    r = chat(srv, plugins, tools=TOOLS, max_tokens=max_tokens, tool_choice=named)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", r
    assert choice["message"]["content"] is None, r
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGS
    assert r["usage"]["prompt_tokens"] > auto["usage"]["prompt_tokens"], "the opener is part of the prompt"
    assert r["usage"]["completion_tokens"] == auto["usage"]["completion_tokens"]
    an = anthropic.Anthropic(base_url=srv.url, api_key="x")
    message = an.messages.create(model="m", max_tokens=max_tokens, messages=Q, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"plugins": plugins})
    assert message.stop_reason == "tool_use", message
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", ARGS)]
    # Streamed, the call is block 0 too (no empty text block before it).
    with an.messages.stream(model="m", max_tokens=max_tokens, messages=Q, tools=ANTHROPIC_TOOLS,
                            tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"plugins": plugins}) as st:
        final = st.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", ARGS)]
    if adapter == "hermes":  # count_tokens builds the prompt with the server's adapter, this one
        counted = an.messages.count_tokens(model="m", messages=Q, tools=ANTHROPIC_TOOLS,
                                           tool_choice={"type": "tool", "name": "get_weather"})
        usage = message.usage
        assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_tool_choice_required_lets_the_model_name_the_function_and_streams_the_call(srv):
    # Among several tools the model writes the name; with one, "required" calls that one.
    sampler, max_tokens = script(srv, 'get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>')
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    stream = oa.chat.completions.create(model="m", messages=Q, tools=TOOLS + [clock], tool_choice="required", stream=True,
                                        max_tokens=max_tokens, temperature=0, extra_body={"plugins": {"sampler": sampler}})
    chunks = list(stream)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == ARGS
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    sampler, max_tokens = script(srv, FORCED_REST["hermes"])
    r = chat(srv, {"sampler": sampler}, tools=TOOLS, max_tokens=max_tokens, tool_choice="required")
    [call] = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGS


def test_an_empty_streamed_anthropic_reply_is_one_empty_text_block(srv):
    sampler, max_tokens = script(srv, "")
    an = anthropic.Anthropic(base_url=srv.url, api_key="x")
    with an.messages.stream(model="m", max_tokens=max_tokens, messages=Q, extra_body={"plugins": {"sampler": sampler}}) as st:
        final = st.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", "")]
    plain = an.messages.create(model="m", max_tokens=max_tokens, messages=Q, extra_body={"plugins": {"sampler": sampler}})
    assert [(b.type, b.text) for b in plain.content] == [("text", "")]


def test_parallel_tool_calls_false_ends_the_reply_before_a_second_call(srv):
    two = FORMATS["hermes"][1] + "\n" + FORMATS["hermes"][1].replace("Paris", "Rome")
    sampler, max_tokens = script(srv, two)
    both = chat(srv, {"sampler": sampler}, tools=TOOLS, max_tokens=max_tokens)
    assert [json.loads(c["function"]["arguments"])["city"] for c in both["choices"][0]["message"]["tool_calls"]] == ["Paris", "Rome"]
    one = chat(srv, {"sampler": sampler}, tools=TOOLS, max_tokens=max_tokens, parallel_tool_calls=False)
    [call] = one["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == ARGS and one["choices"][0]["finish_reason"] == "tool_calls"
    assert one["usage"]["completion_tokens"] < both["usage"]["completion_tokens"], "generation stopped early"
    an = anthropic.Anthropic(base_url=srv.url, api_key="x")
    akw = dict(model="m", max_tokens=max_tokens, messages=Q, tools=ANTHROPIC_TOOLS, extra_body={"plugins": {"sampler": sampler}})
    message = an.messages.create(tool_choice={"type": "auto", "disable_parallel_tool_use": True}, **akw)
    assert [b.input["city"] for b in message.content if b.type == "tool_use"] == ["Paris"]
    assert message.stop_reason == "tool_use"
    assert len([b for b in an.messages.create(**akw).content if b.type == "tool_use"]) == 2


def test_the_real_model_completes_a_forced_call(srv):
    # SmolLM2 itself, greedy: forced to call get_weather, it writes the arguments.
    r = chat(srv, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
             max_tokens=40, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"]), dict), call


def test_the_adapter_is_chosen_from_the_chat_template_and_tool_choice_none_turns_it_off(srv):
    # SmolLM2's template ignores tools, so the server describes them in the Hermes format and
    # parses that format back.
    sampler, max_tokens = script(srv, FORMATS["hermes"][1])
    r = chat(srv, {"sampler": sampler}, tools=TOOLS, max_tokens=max_tokens)
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert r["choices"][0]["message"]["content"] is None
    assert json.loads(r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == ARGS
    # Without tools (or with tool_choice none) the same text is just text.
    for extra in [{}, {"tools": TOOLS, "tool_choice": "none"}]:
        r = chat(srv, {"sampler": sampler}, max_tokens=max_tokens, **extra)
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["choices"][0]["message"]["content"] == FORMATS["hermes"][1]
    # A call the model botched stays text.
    sampler, max_tokens = script(srv, "<tool_call>{not json}</tool_call>")
    r = chat(srv, {"sampler": sampler}, tools=TOOLS, max_tokens=max_tokens)
    assert r["choices"][0]["message"]["content"] == "<tool_call>{not json}</tool_call>"
    assert r["choices"][0]["finish_reason"] == "stop" and not r["choices"][0]["message"].get("tool_calls")


def test_a_regex_stop_ends_output_at_the_match(srv):
    plain = chat(srv, max_tokens=30)["choices"][0]["message"]["content"]
    assert plain == "The capital of France is Paris."
    r = chat(srv, {"stop": [{"name": "regex-stop", "config": {"pattern": "P[a-z]+s"}}]}, max_tokens=30)
    assert r["choices"][0]["message"]["content"] == "The capital of France is "
    assert r["choices"][0]["finish_reason"] == "stop"
    r = chat(srv, {"stop": [{"name": "regex-stop", "config": {"pattern": "P[a-z]+s", "keep_match": True}}]}, max_tokens=30)
    assert r["choices"][0]["message"]["content"] == "The capital of France is Paris"
    bad = httpx.post(srv.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 5, "plugins": {
        "stop": [{"name": "regex-stop", "config": {"pattern": "("}}]}})
    assert bad.status_code == 400 and "regex-stop" in bad.json()["error"]["message"], bad.text


def test_max_sentences_stops_after_n_sentences(srv):
    moon = [{"role": "user", "content": "Tell me about the Moon in a few sentences."}]
    plain = chat(srv, messages=moon, max_tokens=120)["choices"][0]["message"]["content"]
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", plain)]
    assert len(ends) >= 2, plain
    r = chat(srv, {"stop": [{"name": "max-sentences", "config": {"n": 2}}]}, messages=moon, max_tokens=120)
    assert r["choices"][0]["message"]["content"] == plain[:ends[1]]


def test_builtin_samplers_change_generations_reproducibly(srv):
    story = [{"role": "user", "content": "Write a short story about a robot."}]
    greedy = chat(srv, messages=story, max_tokens=24)["choices"][0]["message"]["content"]

    def run(name, config, seed=5, temperature=1.0):
        return chat(srv, {"sampler": {"name": name, "config": config}}, messages=story, max_tokens=24,
                    seed=seed, temperature=temperature)["choices"][0]["message"]["content"]

    # Mirostat: a tiny target surprise truncates to the best token (greedy); a large one
    # samples, reproducibly for a seed.
    assert run("mirostat", {"tau": 0.001}) == greedy
    wide = run("mirostat", {"tau": 8.0})
    assert wide == run("mirostat", {"tau": 8.0}) and wide != greedy
    # Top-n-sigma (built in here, no override): a tiny band is greedy.
    assert run("top-n-sigma", {"n": 0.0001}) == greedy
    # Typical-p with a tiny mass keeps one token per step: the seed no longer matters, while
    # native sampling at temperature 1 differs by seed.
    native = {seed: chat(srv, messages=story, max_tokens=24, temperature=1.0, seed=seed)["choices"][0]["message"]["content"]
              for seed in (1, 2)}
    assert native[1] != native[2]
    assert run("typical-p", {"p": 1e-6}, seed=1) == run("typical-p", {"p": 1e-6}, seed=2)
    # XTC always on, greedy after it: the top choice is excluded whenever another clears the
    # threshold, so the text leaves the greedy path.
    xtc = run("xtc", {"threshold": 0.05, "probability": 1.0}, temperature=0)
    assert xtc != greedy and xtc == run("xtc", {"threshold": 0.05, "probability": 1.0}, temperature=0)


def test_dry_breaks_verbatim_repetition(srv):
    def complete(plugins=None):
        body = {"prompt": "1 2 3 4 1 2 3 4 1 2 3 4 1 2 3 4", "max_tokens": 24, "temperature": 0}
        if plugins:
            body["plugins"] = plugins
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    plain = complete()
    dry = complete({"sampler": {"name": "dry", "config": {"multiplier": 3.0, "base": 2.0, "allowed_length": 2}}})
    # Greedy decoding loops on the pattern; DRY penalizes every token that would extend it.
    assert plain.startswith(" 1 2 3 4 1 2 3 4"), plain
    assert "1 2 3 4" not in dry, dry


LONG = [{"role": "user", "content": "Write a long essay about the history of Rome."}]


def timed(server, results, key, **body):
    def go():
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, "temperature": 0, **body}, timeout=300)
        results[key] = (time.time(), r.status_code, r.json())
    t = threading.Thread(target=go)
    t.start()
    return t


def start_long(server, results, max_tokens, **kw):
    """Starts a long streamed request; returns once its first text arrived."""
    first = threading.Event()

    def go():
        text = ""
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=300, json={
                "messages": LONG, "temperature": 0, "max_tokens": max_tokens, "stream": True, **kw}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"]
                    text += delta[0]["delta"].get("content") or "" if delta else ""
                    if text:
                        first.set()
        results["long"] = (time.time(), 200, text)
    t = threading.Thread(target=go)
    t.start()
    assert first.wait(60)
    return t


def race(server, long_tokens):
    """A long streamed request runs; a priority-0 request queues, then a priority-10 one.
    Returns {key: (finish time, status, body or text)} for "long", "low" and "high"."""
    results = {}
    long = start_long(server, results, long_tokens)
    low = timed(server, results, "low", max_tokens=5, priority=0)
    time.sleep(0.3)
    high = timed(server, results, "high", max_tokens=5, priority=10)
    for t in (long, low, high):
        t.join(300)
    assert all(results[k][1] == 200 for k in ("low", "high")), results
    return results


# The ordering tests give the server one slot (`--max-batch 1`): with free slots every
# request starts at once, and a policy decides only who takes a scarce one.
def test_the_priority_policy_serves_high_priority_first_and_pauses_the_running_request():
    s = Server("--scheduler", "priority", "--prompt-cache-bytes", "0", "--max-batch", "1")
    try:
        alone = chat(s, messages=LONG, max_tokens=120)["choices"][0]["message"]["content"]
        results = race(s, 120)
        # The high-priority request finished first: before the one queued ahead of it, and
        # before the running one, which it paused.
        assert results["high"][0] < results["low"][0]
        assert results["high"][0] < results["long"][0]
        # The paused request resumed where it stopped: its text is what it generates alone.
        assert results["long"][2] == alone
        assert any("paused for a waiting request" in line for line in s.log)
    finally:
        s.stop()


@pytest.mark.parametrize("prompt_cache,constrained", [("256M", False), ("0", False), ("256M", True)])
def test_the_priority_policy_drops_the_running_request_when_memory_is_short_and_it_recomputes_the_same_text(
        prompt_cache, constrained):
    # A budget below SmolLM2's context (~5,600 tokens of KV beside the weights), so that
    # `max_model_len` is the memory budget's.
    s = Server("--scheduler", "priority", "--memory-budget", "800M", "--prompt-cache-bytes", prompt_cache)
    try:
        t = httpx.post(s.url + "/tokenize", json={"messages": LONG}, timeout=30).json()
        # The running request alone may reach nearly the whole budget, so no other fits beside
        # it with its KV kept. It ends early at a stop string taken from its own greedy text.
        # Constrained, it decodes alone (taking forced runs) until it is dropped, and resumes
        # as a batch row.
        extra = {"regex": "[^#]*"} if constrained else {}
        long_max = t["max_model_len"] - t["count"] - 8
        probe = chat(s, messages=LONG, max_tokens=40, **extra)["choices"][0]["message"]["content"]
        stop = " ".join(probe.split()[-3:])
        body = {"max_tokens": long_max, "stop": [stop], **extra}
        alone = chat(s, messages=LONG, **body)["choices"][0]["message"]["content"]
        assert alone and stop not in alone
        results = race_one(s, body)
        # The high-priority request ran while the long one waited without its KV...
        assert results["high"][0] < results["long"][0]
        assert any("dropped for a waiting request (memory is short)" in line for line in s.log)
        assert not any("paused for a waiting request" in line for line in s.log)
        # ...which came back from the prompt cache, or, with none, was computed again from
        # its tokens (prompt and generated): either way its text is what it generates alone.
        resumed = [re.search(r"from_prompt_cache=(\d+) recomputed=(\d+)", line)
                   for line in s.log if "resumed a dropped request" in line]
        assert len(resumed) == 1 and resumed[0], s.log[-20:]
        cached, recomputed = int(resumed[0][1]), int(resumed[0][2])
        if prompt_cache == "0":
            assert cached == 0 and recomputed >= t["count"], (cached, recomputed)
        else:
            assert cached >= t["count"] and recomputed == 0, (cached, recomputed)
        assert results["long"][2] == alone
        m = httpx.get(s.url + "/metrics", timeout=30).text
        assert re.search(r"^host_preemptions_total [1-9]", m, re.M), m
    finally:
        s.stop()


def race_one(server, long_body):
    """A long streamed request runs; a priority-10 request arrives. {key: (time, status, text)}."""
    results = {}
    long = start_long(server, results, **long_body)
    high = timed(server, results, "high", max_tokens=5, priority=10)
    for t in (long, high):
        t.join(300)
    assert results["high"][1] == 200, results
    return results


def test_the_priority_policy_does_not_pause_a_request_decoding_alone_when_memory_is_short():
    # As above, but the running request decodes alone (speculation beside the batch, as on a
    # model whose sliding or recurrent layers the batch cannot roll back row by row, here by
    # HOST_SPEC_ROWS=0): its state cannot be dropped and recomputed, and keeping it beside the
    # next could outgrow the budget.
    s = Server("--scheduler", "priority", "--prompt-cache-bytes", "0", "--memory-budget", "800M",
               env={"HOST_SPEC_ROWS": "0"})
    try:
        t = httpx.post(s.url + "/tokenize", json={"messages": LONG}, timeout=30).json()
        # The running request alone may reach the whole budget, so no other fits beside it.
        long_max = t["max_model_len"] - t["count"]
        stop = threading.Event()
        first = threading.Event()

        def long():
            with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=300, json={
                    "messages": LONG, "temperature": 0, "max_tokens": long_max, "stream": True,
                    "speculative": "prompt-lookup"}) as r:
                for line in r.iter_lines():
                    first.set()
                    if stop.is_set():
                        break  # closing the stream cancels the request
        runner = threading.Thread(target=long)
        runner.start()
        assert first.wait(60)
        results = {}
        high = timed(s, results, "high", max_tokens=5, priority=10)
        deadline = time.time() + 30
        while not any("not paused" in line for line in s.log) and time.time() < deadline:
            time.sleep(0.1)
        assert "high" not in results, "the high-priority request ran beside the long one"
        stop.set()
        runner.join(60)
        high.join(120)
        assert results["high"][1] == 200
        assert any("not paused" in line and "memory budget" in line for line in s.log)
        assert not any("paused for a waiting request" in line or "dropped" in line for line in s.log)
    finally:
        s.stop()


def test_fcfs_the_default_serves_in_arrival_order_whatever_the_priority():
    s = Server("--prompt-cache-bytes", "0", "--max-batch", "1")
    try:
        results = race(s, 60)
        assert results["long"][0] < results["low"][0] < results["high"][0]
        assert not any("paused" in line for line in s.log)
    finally:
        s.stop()


def test_latest_wins_cancels_a_clients_older_queued_requests():
    s = Server("--scheduler", "latest-wins", "--prompt-cache-bytes", "0", "--max-batch", "1")
    try:
        results = {}
        long = start_long(s, results, 80)
        threads = []
        for i in range(3):
            threads.append(timed(s, results, f"ed{i}", max_tokens=3, user="editor"))
            time.sleep(0.2)
        other = timed(s, results, "other", max_tokens=3, user="someone-else")
        for t in [long, other, *threads]:
            t.join(300)
        assert results["ed2"][1] == 200 and results["other"][1] == 200
        for k in ("ed0", "ed1"):
            status, body = results[k][1], results[k][2]
            assert status == 409 and body["error"]["code"] == "cancelled_by_scheduler", body
            assert "latest-wins" in body["error"]["message"]
    finally:
        s.stop()


def test_fair_gives_a_second_client_a_slot_by_pausing_the_busiest_client():
    """Issue 19: two slots, both taken by client "a"; client "b" arrives and gets one of them
    (a's request with the most tokens is paused and resumes with its solo output)."""
    s = Server("--scheduler", "fair", "--prompt-cache-bytes", "0", "--max-batch", "2")
    try:
        alone = chat(s, messages=LONG, max_tokens=60)["choices"][0]["message"]["content"]
        results = {}
        a1 = start_long(s, results, 60, user="a")
        a2 = timed(s, results, "a2", max_tokens=60, messages=LONG, user="a")
        time.sleep(1.0)
        b = timed(s, results, "b", max_tokens=5, user="b")
        for t in (a1, a2, b):
            t.join(300)
        assert results["b"][1] == 200 and results["a2"][1] == 200
        assert results["b"][0] < results["long"][0] and results["b"][0] < results["a2"][0]
        assert any("paused for a waiting request" in line and "fair" in line for line in s.log)
        assert results["long"][2] == alone
        assert results["a2"][2]["choices"][0]["message"]["content"] == alone
    finally:
        s.stop()


def test_a_policy_replaced_while_eight_streams_run_takes_over_and_loses_no_request(tmp_path):
    """Issue 19: with two slots and eight streamed requests, the fcfs policy's file version is
    dropped into the plugins folder mid-run; the next decision uses it, and every request
    finishes with the output it gets alone."""
    subprocess.run(["cargo", "build", "--quiet", "--release", "--target", "wasm32-unknown-unknown", "-p", "fcfs"],
                   cwd=ROOT, check=True)
    wasm = open(os.path.join(ROOT, "target", "wasm32-unknown-unknown", "release", "fcfs.wasm"), "rb").read()
    s = Server("--plugins", str(tmp_path), "--scheduler", "fcfs", "--prompt-cache-bytes", "0", "--max-batch", "2")
    try:
        prompts = [f"Name {i + 2} animals." for i in range(8)]
        alone = [chat(s, messages=[{"role": "user", "content": p}], max_tokens=24)["choices"][0]["message"]["content"]
                 for p in prompts]
        results = {}

        def go(i):
            text = ""
            with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=300, json={
                    "messages": [{"role": "user", "content": prompts[i]}], "temperature": 0, "max_tokens": 24,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"]
                        text += delta[0]["delta"].get("content") or "" if delta else ""
            results[i] = (r.status_code, text)
        threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        (tmp_path / "fcfs.wasm").write_bytes(wasm)
        for t in threads:
            t.join(300)
        assert [results[i] for i in range(8)] == [(200, a) for a in alone]
        calls = {p["source"]: p["calls"] for p in httpx.get(s.url + "/v1/plugins").json()["data"] if p["name"] == "fcfs"}
        assert calls.get(str(tmp_path / "fcfs.wasm"), 0) > 0, calls
        assert sum("scheduling policy instance started" in line for line in s.log) >= 2
    finally:
        s.stop()


def test_unknown_scheduler_or_adapter_is_refused_at_start():
    for args, want in [(["--scheduler", "nope"], 'plugin "nope" (from scheduler) is not loaded'),
                       (["--scheduler", "hermes"], 'is not a scheduler plugin'),
                       (["--tool-adapter", "mirostat"], 'is not a tool plugin')]:
        with pytest.raises(RuntimeError) as e:
            Server(*args)
        assert want in str(e.value), e.value


def test_shortest_prompt_first_serves_the_short_prompt_ahead_of_an_earlier_long_one():
    s = Server("--scheduler", "shortest-prompt-first", "--prompt-cache-bytes", "0", "--max-batch", "1")
    try:
        results = {}
        long = start_long(s, results, 60)
        essay = [{"role": "user", "content": "Summarize this: " + "The quick brown fox jumps over the lazy dog. " * 40}]
        big = timed(s, results, "big", max_tokens=3, messages=essay)
        time.sleep(0.3)
        small = timed(s, results, "small", max_tokens=3)
        for t in (long, big, small):
            t.join(300)
        assert results["big"][1] == 200 and results["small"][1] == 200
        assert results["small"][0] < results["big"][0]
    finally:
        s.stop()


def test_a_plugin_file_overrides_a_builtin_until_it_is_removed(tmp_path):
    subprocess.run(["cargo", "build", "--quiet", "--release", "--target", "wasm32-unknown-unknown", "-p", "top-n-sigma"],
                   cwd=ROOT, check=True)
    wasm = open(os.path.join(ROOT, "target", "wasm32-unknown-unknown", "release", "top_n_sigma.wasm"), "rb").read()
    s = Server("--plugins", str(tmp_path), "--prompt-cache-bytes", "0")

    def entries():
        data = httpx.get(s.url + "/v1/plugins").json()["data"]
        return sorted((p["source"], p["state"]) for p in data if p["name"] == "top-n-sigma")

    def wait_for(want):
        deadline = time.time() + 5
        while entries() != want and time.time() < deadline:
            time.sleep(0.05)
        assert entries() == want

    try:
        assert entries() == [("builtin:top-n-sigma", "ready")]
        path = tmp_path / "top-n-sigma.wasm"
        path.write_bytes(wasm)
        wait_for(sorted([("builtin:top-n-sigma", "overridden"), (str(path), "ready")]))
        time.sleep(1.0)
        # One write, one load: loading (reading) the file must not count as a change.
        assert sum("plugin loaded" in line and "top-n-sigma" in line for line in s.log) == 1, s.log[-5:]
        assert chat(s, {"sampler": {"name": "top-n-sigma", "config": {"n": 0.0001}}}, max_tokens=30)[
            "choices"][0]["message"]["content"] == "The capital of France is Paris."
        calls = {p["source"]: p["calls"] for p in httpx.get(s.url + "/v1/plugins").json()["data"] if p["name"] == "top-n-sigma"}
        assert calls[str(path)] > 0 and calls["builtin:top-n-sigma"] == 0, calls
        path.unlink()
        wait_for([("builtin:top-n-sigma", "ready")])
    finally:
        s.stop()
