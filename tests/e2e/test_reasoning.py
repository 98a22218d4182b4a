"""Reasoning output: a thinking model's `<think>...</think>` split from its answer by the
built-in `think` reasoning parser (a plugin, ABI.md §5.5) and shown as each API shows it —
chat completions `message.reasoning_content` / `reasoning` (streamed as `delta.` fields),
Anthropic `thinking` blocks (`thinking_delta`), Responses `reasoning` items
(`response.reasoning_text.delta`) — never in the answer text. Outputs are scripted exactly with
the `replay` test sampler on SmolLM2, through the official SDKs.

Two servers: SmolLM2 as it is, with `--reasoning-parser think` (its template has no
thinking), and SmolLM2 under a Qwen3-style template that opens `<think>` in the prompt and
closes it when `enable_thinking` is false — where the parser is chosen from the template and
the reply starts inside the thinking."""
import json
import os

import anthropic
import httpx
import openai
import pytest

from conftest import Server, build_wasm_plugin
from test_builtins import tokens
from test_responses import check_grammar

THOUGHT = "The user asks for 2+2. That is 4."
ANSWER = "The answer is 4."
SCRIPTED = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
Q = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def replay_dir(tmp_path_factory):
    return build_wasm_plugin("replay-sampler", "replay", tmp_path_factory.mktemp("replay"))


@pytest.fixture(scope="module")
def srv(replay_dir):
    s = Server("--plugins", str(replay_dir), "--prompt-cache-bytes", "0", "--reasoning-parser", "think")
    yield s
    s.stop()


def replay(server, text):
    """The `plugins` field that makes the model write `text`, then end its turn."""
    [eos] = tokens(server, "<|im_end|>")
    return {"sampler": {"name": "replay", "params": {"tokens": tokens(server, text) + [eos]}}}


def clients(server):
    return (openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120))


def check_everywhere(server, plugins, thought, answer, thinking=None):
    """The scripted reply seen through chat completions, Anthropic Messages and Responses,
    streamed and not: `thought` as reasoning (none when empty), `answer` as the text."""
    oa, an = clients(server)
    body = {"plugins": plugins}
    kw = {"chat_template_kwargs": {"enable_thinking": thinking}} if thinking is not None else {}

    r = oa.chat.completions.create(model="m", messages=Q, max_tokens=64, extra_body={**body, **kw})
    m = r.choices[0].message
    assert m.content == answer
    assert getattr(m, "reasoning_content", None) == (thought or None) == getattr(m, "reasoning", None), m
    reasoning, content = "", ""
    for chunk in oa.chat.completions.create(model="m", messages=Q, max_tokens=64, stream=True, extra_body={**body, **kw}):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (thought, answer)

    extra = {"thinking": {"type": "enabled" if thinking else "disabled", "budget_tokens": 1024}} if thinking is not None else {}
    msg = an.messages.create(model="m", messages=Q, max_tokens=64, extra_body=body, **extra)
    kinds = [b.type for b in msg.content]
    assert kinds == (["thinking", "text"] if thought else ["text"]), msg.content
    assert msg.content[-1].text == answer and (not thought or msg.content[0].thinking == thought)
    with an.messages.stream(model="m", messages=Q, max_tokens=64, extra_body=body, **extra) as s:
        deltas = [e.delta for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thought
    assert "".join(d.text for d in deltas if d.type == "text_delta") == answer
    assert [b.type for b in final.content] == kinds

    rkw = {"reasoning": {"effort": "none"}} if thinking is False else {}
    resp = oa.responses.create(model="m", input="What is 2+2?", max_output_tokens=64, extra_body=body, **rkw)
    assert resp.output_text == answer
    items = [i.type for i in resp.output]
    assert items == (["reasoning", "message"] if thought else ["message"]), resp.output
    if thought:
        assert resp.output[0].content[0].text == thought
    events = list(oa.responses.create(model="m", input="What is 2+2?", max_output_tokens=64, stream=True,
                                      extra_body=body, **rkw))
    check_grammar(events)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    assert [i.type for i in events[-1].response.output] == items


def test_thinking_is_reasoning_in_every_api_streamed_and_not(srv):
    check_everywhere(srv, replay(srv, SCRIPTED), THOUGHT, ANSWER)


def test_thinking_then_a_tool_call(srv):
    """The reasoning parser runs ahead of the tool adapter: thinking, then a call."""
    oa, _ = clients(srv)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    r = oa.chat.completions.create(model="m", messages=Q, max_tokens=64, tools=tools,
                                   extra_body={"plugins": replay(srv, f"<think>I should add.</think>{call}")})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.reasoning_content == "I should add."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("add", {"a": 2, "b": 2})]
    assert not m.content


def test_the_parser_can_be_switched_off_and_completions_keep_the_text(srv):
    plugins = {**replay(srv, SCRIPTED), "reasoning": {"name": "none"}}
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 64, "plugins": plugins}, timeout=120)
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    assert m["content"] == SCRIPTED and "reasoning_content" not in m
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "2+2=", "max_tokens": 4, "plugins": plugins}, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + "/v1/completions", timeout=120,
                   json={"prompt": "2+2=", "max_tokens": 4, "plugins": {"reasoning": {"name": "think"}}})
    assert r.status_code == 400 and "chat replies" in r.json()["error"]["message"], r.text


QWEN3_STYLE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n<think>\n\n</think>\n\n"
    "{%- else %}\n<think>\n{% endif %}{%- endif %}"
)


def templated_server(replay_dir, tmp_path_factory, name, template):
    """SmolLM2 (its files linked) under chat template `template`, with the replay sampler."""
    base = os.path.join(os.environ["HOST_TEST_MODELS"], "smollm2-f32")
    model = tmp_path_factory.mktemp(name) / f"smollm2-{name}"
    model.mkdir()
    for f in os.listdir(base):
        if f != "tokenizer_config.json":
            os.symlink(os.path.join(base, f), model / f)
    config = json.load(open(os.path.join(base, "tokenizer_config.json")))
    config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return Server("--plugins", str(replay_dir), "--prompt-cache-bytes", "0", model=model)


@pytest.fixture(scope="module")
def thinking_srv(replay_dir, tmp_path_factory):
    """SmolLM2 under a template that opens `<think>` in the prompt (Qwen3-Thinking's way)."""
    s = templated_server(replay_dir, tmp_path_factory, "thinking", QWEN3_STYLE)
    yield s
    s.stop()


def test_a_template_that_opens_the_thinking(thinking_srv):
    """No `<think>` in the reply: the prompt opened it. The parser comes from the template."""
    check_everywhere(thinking_srv, replay(thinking_srv, f"{THOUGHT}\n</think>\n\n{ANSWER}"), THOUGHT, ANSWER, thinking=True)


def test_thinking_switched_off_through_the_template(thinking_srv):
    """`enable_thinking: false` (Anthropic `thinking: disabled`, Responses effort `none`):
    the template closes the thinking in the prompt; the reply is all answer."""
    check_everywhere(thinking_srv, replay(thinking_srv, ANSWER), "", ANSWER, thinking=False)


# A small harmony-style template of this file's own (GPT-OSS's real one is long): messages as
# harmony writes them, earlier thinking read from `thinking`, the reply opened with
# `<|start|>assistant`. It does not render tools, so the `harmony` adapter describes them.
HARMONY_STYLE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def harmony_srv(replay_dir, tmp_path_factory):
    """SmolLM2 under a harmony-style template: the server picks `harmony-channels` and
    `harmony` from its markers."""
    s = templated_server(replay_dir, tmp_path_factory, "harmony", HARMONY_STYLE)
    yield s
    s.stop()


def test_harmony_analysis_is_reasoning_and_final_is_the_answer(harmony_srv):
    reply = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
             f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")
    check_everywhere(harmony_srv, replay(harmony_srv, reply), THOUGHT, ANSWER)


def test_harmony_thinking_then_a_call_to_a_function(harmony_srv):
    """The analysis is reasoning; the commentary message to `functions.get_weather` is the
    call, in both APIs, streamed and not; a forced call opens the reply with its header."""
    oa, an = clients(harmony_srv)
    call = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
            '<|message|>{"city": "Paris"}<|call|>')
    body = {"plugins": replay(harmony_srv, f"<|channel|>analysis<|message|>Need the weather.<|end|>{call}")}
    r = oa.chat.completions.create(model="m", messages=Q, max_tokens=96, tools=WEATHER, extra_body=body)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.reasoning_content == "Need the weather.", m
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert not m.content
    calls, reasoning = {}, ""
    for chunk in oa.chat.completions.create(model="m", messages=Q, max_tokens=96, tools=WEATHER, stream=True, extra_body=body):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            for d in c.delta.tool_calls or []:
                calls[d.index] = calls.get(d.index, "") + ((d.function.arguments or "") if d.function else "")
    assert reasoning == "Need the weather." and [json.loads(a) for a in calls.values()] == [{"city": "Paris"}]
    tools = [{"name": "get_weather", "input_schema": WEATHER[0]["function"]["parameters"]}]
    msg = an.messages.create(model="m", messages=Q, max_tokens=96, tools=tools, extra_body=body)
    assert msg.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in msg.content] == [("thinking", None), ("tool_use", {"city": "Paris"})]
    # Forced: the prompt ends with the call's header; the model writes only the arguments.
    forced = {"plugins": replay(harmony_srv, '{"city": "Oslo"}')}
    r = oa.chat.completions.create(model="m", messages=Q, max_tokens=32, tools=WEATHER, extra_body=forced,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    m = r.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert not m.content and not getattr(m, "reasoning_content", None), m


def test_harmony_prompts_describe_tools_and_keep_earlier_thinking(harmony_srv):
    """The adapter describes the tools as harmony's TypeScript namespace (the template does
    not render them), and an earlier turn's reasoning reaches the template as `thinking`."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
                {"role": "user", "content": "Weather in Oslo?"}]
    r = httpx.post(harmony_srv.url + "/tokenize", json={"messages": messages, "tools": WEATHER}, timeout=30)
    assert r.status_code == 200, r.text
    prompt = httpx.post(harmony_srv.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]
    assert "namespace functions {" in prompt and "type get_weather = (_: {\ncity: string,\n}) => any;" in prompt, prompt
    assert "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hello.<|end|>" in prompt
    assert prompt.endswith("<|start|>assistant"), prompt
