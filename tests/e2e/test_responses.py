"""The OpenAI Responses API (`/v1/responses`) through the official `openai` SDK against a live
server on SmolLM2: text and function calls, streamed and not (the event order checked against
the Responses grammar), `previous_response_id` continuing a stored conversation from the
prompt cache, retrieval and deletion. Function calls are scripted with the `replay` test
sampler (tests/plugins/replay), as in test_builtins.py."""
import json

import openai
import pytest

from test_builtins import replay_dir, script, srv  # noqa: F401  (fixtures)

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def check_grammar(events):
    """The event order of the Responses grammar: created, in_progress, then items each opened
    and closed in turn (text: content part, deltas, done), then one terminal event."""
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    open_item = None
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_item is None, kinds
            open_item = e.item
        elif e.type == "response.output_item.done":
            assert open_item is not None and e.item.id == open_item.id, kinds
            open_item = None
        else:
            assert open_item is not None, f"{e.type} outside an item: {kinds}"
            assert e.item_id == open_item.id
    assert open_item is None


def test_text_streamed_equals_text_not_streamed(server):
    oa = client(server)
    kw = dict(model="whatever", input="What is the capital of France?", instructions="Answer briefly.",
              max_output_tokens=12, temperature=0)
    r = oa.responses.create(**kw)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens <= 12
    events = list(oa.responses.create(stream=True, **kw))
    check_grammar(events)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text
    # The second identical prompt came from the prompt cache.
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0


def test_function_calls_round_trip_with_previous_response_id(srv):  # noqa: F811
    oa = client(srv)
    sampler, n = script(srv, CALL)
    r = oa.responses.create(model="m", input="Weather in Paris?", tools=TOOLS, max_output_tokens=n,
                            extra_body={"plugins": {"sampler": sampler}})
    [call] = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert r.status == "completed"
    # Streamed: the call's item and its argument deltas.
    events = list(oa.responses.create(model="m", input="Weather in Paris?", tools=TOOLS, max_output_tokens=n,
                                      stream=True, extra_body={"plugins": {"sampler": sampler}}))
    check_grammar(events)
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [a.name for a in added] == ["get_weather"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    # The tool's result continues the stored response; the answer is scripted too.
    answer, m = script(srv, "It is sunny in Paris.")
    r2 = oa.responses.create(model="m", previous_response_id=r.id, tools=TOOLS, max_output_tokens=m,
                             input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
                             extra_body={"plugins": {"sampler": answer}})
    assert r2.output_text == "It is sunny in Paris." and r2.previous_response_id == r.id
    assert r2.usage.input_tokens > r.usage.input_tokens
    assert oa.responses.retrieve(r2.id).output_text == r2.output_text
    oa.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r2.id)
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model="m", previous_response_id=r2.id, input="again")
    assert "previous_response_id" in str(e.value)


def test_the_same_history_sent_whole_is_the_same_prompt(srv):  # noqa: F811
    """Codex sends the whole history each turn (`store: false`): the items it sends back
    build the same prompt as `previous_response_id` does."""
    oa = client(srv)
    sampler, n = script(srv, CALL)
    r = oa.responses.create(model="m", input="Weather in Paris?", tools=TOOLS, max_output_tokens=n,
                            extra_body={"plugins": {"sampler": sampler}})
    call = r.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    chained = oa.responses.create(model="m", previous_response_id=r.id, input=[result], tools=TOOLS,
                                  max_output_tokens=1, store=False)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               result]
    whole = oa.responses.create(model="m", input=history, tools=TOOLS, max_output_tokens=1, store=False)
    assert whole.usage.input_tokens == chained.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(whole.id)
