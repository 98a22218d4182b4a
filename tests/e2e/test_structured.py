"""Structured output on SmolLM2 through the official openai SDK and raw HTTP: JSON schemas
(`response_format: json_schema`), `json_object`, regexes and grammars hold the output to
them, streamed and not, on chat and completions and the Responses API; what cannot be
compiled is a 400 that names the problem. The same prompts without the constraint are the
baseline: how often the model gets it right alone."""
import json
import re

import jsonschema
import pytest

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

# (prompt, schema): nested objects, arrays, enums, numbers with bounds, required and
# optional properties, strings with patterns and lengths, $ref, anyOf, nullable, const.
CASES = [
    ("Describe a person called Ana who is 31, as JSON.", PERSON),
    ("Give a user record with an id, an email and up to three tags, as JSON.",
     {"type": "object", "properties": {
         "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999}, "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"}},
                  "required": ["id", "email"]},
         "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
      "required": ["user", "tags"]}),
    ("What colour is the sky? Answer as JSON.",
     {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("Report today's weather in Paris as JSON.",
     {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100}},
      "required": ["temperature", "humidity"]}),
    ("List a shopping basket of fruit as JSON.",
     {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
         "type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
         "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"]}),
    ("Give a book title, and a subtitle if it has one, as JSON.",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "subtitle": {"type": "string", "maxLength": 60}},
      "required": ["title"]}),
    ("What is the postal code of the White House? JSON please.",
     {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}),
    ("Write a to-do item and whether it is done, as JSON.",
     {"type": "object", "properties": {"task": {"type": "string", "maxLength": 50}, "done": {"type": "boolean"}}, "required": ["task", "done"]}),
    ("When did the Apollo 11 landing happen? Give the date as JSON.",
     {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"]}),
    ("Give the API version (2) and the service name as JSON.",
     {"type": "object", "properties": {"version": {"const": 2}, "name": {"type": "string", "maxLength": 30}}, "required": ["version", "name"]}),
    ("How many legs does a spider have? Answer as JSON with a value.",
     {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}]}}, "required": ["value"]}),
    ("Describe a company with its name and its address (city and country), as JSON.",
     {"type": "object", "properties": {"company": {"type": "object", "properties": {
         "name": {"type": "string", "maxLength": 40},
         "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
                     "required": ["city", "country"]}}, "required": ["name", "address"]}}, "required": ["company"]}),
    ("How many planets have rings? JSON with a count.",
     {"type": "object", "properties": {"count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}}, "required": ["count"]}),
    ("Make up a short product code as JSON.",
     {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}, "required": ["code"]}),
    ("Give three test scores between 0 and 1 as JSON.",
     {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 4}},
      "required": ["scores"]}),
    ("Give a point on the plane as JSON.",
     {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number", "minimum": -100, "maximum": 100}, "y": {"type": "number", "minimum": -100, "maximum": 100}}, "required": ["x", "y"]}},
      "properties": {"point": {"$ref": "#/$defs/pt"}}, "required": ["point"]}),
    ("Give a first name and a middle name (or null) as JSON.",
     {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20}, "middle": {"type": ["string", "null"], "maxLength": 20}},
      "required": ["first", "middle"]}),
    ("Give a number a and a word b as JSON, nothing else.",
     {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999}, "b": {"type": "string", "pattern": "^[a-z]{1,12}$"}},
      "required": ["a", "b"], "additionalProperties": False}),
    ("Which days of the week are on the weekend? A JSON list.",
     {"type": "array", "items": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}, "minItems": 1, "maxItems": 3}),
    ("Rate this movie from 1 to 5 stars with a one-line review, as JSON.",
     {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "review": {"type": "string", "maxLength": 80}},
      "required": ["stars", "review"]}),
]


def valid(text, schema):
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def chat(openai_client, prompt, **kw):
    return openai_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=160, temperature=0, **kw)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_twenty_json_schemas_validate_every_time_and_the_model_alone_does_not(openai_client):
    from concurrent.futures import ThreadPoolExecutor
    assert len(CASES) == 20
    # The baseline, the model alone, runs as concurrent requests (the server batches them;
    # left to itself the model writes up to max_tokens, most of this test's time).
    with ThreadPoolExecutor(8) as pool:
        alone = list(pool.map(lambda case: chat(openai_client, case[0]).choices[0].message.content, CASES))
    baseline = sum(valid(text, schema) for text, (_, schema) in zip(alone, CASES))
    for _, schema in CASES:
        jsonschema.Draft202012Validator.check_schema(schema)
    # Constrained, concurrently too: rows of one batch, each under its own grammar.
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda case: chat(openai_client, case[0], response_format=schema_format(case[1])),
                                CASES))
    constrained = 0
    for (prompt, schema), r in zip(CASES, replies):
        text = r.choices[0].message.content
        assert valid(text, schema), f"{prompt!r}: {text!r} does not validate"
        assert r.choices[0].finish_reason == "stop", text
        constrained += 1
    print(f"json_schema: {constrained}/20 valid with the constraint, {baseline}/20 without")
    assert constrained == 20
    assert baseline < 20, "the model alone already gets every case right: the cases prove nothing"


def test_streamed_json_schemas_validate_and_equal_the_plain_reply(openai_client):
    from concurrent.futures import ThreadPoolExecutor

    def both(case):
        prompt, schema = case
        plain = chat(openai_client, prompt, response_format=schema_format(schema)).choices[0].message.content
        stream = chat(openai_client, prompt, response_format=schema_format(schema), stream=True)
        return plain, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with ThreadPoolExecutor(8) as pool:
        for (prompt, schema), (plain, text) in zip(CASES, pool.map(both, CASES)):
            assert valid(text, schema), f"{prompt!r}: {text!r}"
            assert text == plain


def test_json_object_always_gives_an_object(openai_client):
    # As OpenAI asks of json_object requests, the messages say JSON. (Asked for something
    # open-ended, "describe a cat", the 135M model writes keys until max_tokens: any object
    # is allowed, so the constraint cannot end it.)
    for prompt in ["Give your name and age as a JSON object.", "Return a JSON object with the capital of France.",
                   "What is 2+2? JSON."]:
        r = chat(openai_client, prompt, response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        assert isinstance(json.loads(text), dict), text


def test_completions_take_response_format_and_seeded_sampling_still_validates(http):
    for seed in range(4):
        body = {"prompt": "A person as JSON:", "max_tokens": 120, "temperature": 1.0, "seed": seed,
                "response_format": schema_format(PERSON)}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert valid(text, PERSON), text


def test_a_regex_and_a_grammar_hold_the_output_as_written(http):
    msg = [{"role": "user", "content": "Is the earth round? Explain briefly."}]
    rx = "(yes|no), because [a-z ]{1,40}\\."
    r = http.post("/v1/chat/completions", json={"messages": msg, "max_tokens": 60, "regex": rx})
    assert r.status_code == 200, r.text
    assert re.fullmatch(rx, r.json()["choices"][0]["message"]["content"]), r.text
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/\n'
    msg = [{"role": "user", "content": "What is 6 times 7?"}]
    r = http.post("/v1/chat/completions", json={"messages": msg, "max_tokens": 30, "grammar": lark})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", r.json()["choices"][0]["message"]["content"]), r.text
    gbnf = 'root ::= animal " says " sound\nanimal ::= "cat" | "dog"\nsound ::= "meow" | "woof"\n'
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "A dog speaks."}],
                                                "max_tokens": 20, "grammar": gbnf})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"(cat|dog) says (meow|woof)", r.json()["choices"][0]["message"]["content"]), r.text


def test_responses_text_format_holds_the_output_to_the_schema(openai_client):
    r = openai_client.responses.create(
        model="m", input="Describe a person called Bo who is 40, as JSON.", max_output_tokens=120, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert valid(r.output_text, PERSON), r.output_text


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"regex": "(unclosed"}, "regex", ""),
    ({"regex": 5}, "regex", "string"),
    ({"grammar": "start: undefined_rule\n"}, "grammar", "undefined_rule"),
    ({"regex": "a+", "grammar": "start: \"a\"\n"}, "regex", "one of"),
])
def test_what_cannot_be_compiled_is_a_400_that_names_it(http, body, param, words):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err
    # The server goes on serving.
    ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_anthropic_output_format_holds_the_text_to_the_schema_and_closes_its_objects(anthropic_client):
    open_person = {k: v for k, v in PERSON.items() if k != "additionalProperties"}
    for body in [{"output_config": {"format": {"type": "json_schema", "schema": open_person}}},
                 {"output_format": {"type": "json_schema", "schema": open_person}}]:
        r = anthropic_client.messages.create(
            model="m", max_tokens=120, extra_body={"temperature": 0, **body},
            messages=[{"role": "user", "content": "Describe a person called Cy who is 25, as JSON."}])
        text = r.content[0].text
        assert valid(text, PERSON), text
        assert r.stop_reason == "end_turn", r


def test_speculation_under_a_constraint_gives_the_plain_constrained_reply(http):
    # A prompt that repeats itself, so prompt lookup drafts (and the drafts meet the masks).
    schema = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6}},
              "required": ["names"]}
    text = "Names: Alice, Bob, Carol, Dave, Erin, Frank. Repeat the names above as JSON."
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 80, "temperature": 0,
            "response_format": schema_format(schema)}
    plain = http.post("/v1/chat/completions", json=body).json()
    spec = http.post("/v1/chat/completions", json={**body, "speculative": "prompt-lookup"}).json()
    assert valid(plain["choices"][0]["message"]["content"], schema), plain
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert spec["usage"]["speculative"]["drafted_tokens"] > 0, spec["usage"]


def test_llguidance_in_wasm_the_guidance_plugin_gives_the_native_constraints_replies(http):
    # The built-in `guidance` constraint plugin is llguidance compiled to Wasm behind the
    # plugin ABI; response_format runs the same crate natively. Same schema, same replies.
    nested = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "tags": {"type": "array", "items": {"enum": ["old", "big", "cold"]}, "maxItems": 2}},
              "required": ["city", "tags"], "additionalProperties": False}
    for prompt, schema in [(CASES[0][0], PERSON), ("Describe Oslo as JSON.", nested)]:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 60, "temperature": 0}
        native = http.post("/v1/chat/completions", json={**body, "response_format": schema_format(schema)})
        wasm = http.post("/v1/chat/completions", json={
            **body, "plugins": {"constraint": {"name": "guidance", "params": {"json_schema": schema}}}})
        assert wasm.status_code == 200, wasm.text
        text = wasm.json()["choices"][0]["message"]["content"]
        assert valid(text, schema), text
        assert text == native.json()["choices"][0]["message"]["content"]
    regex = http.post("/v1/completions", json={"prompt": "The year is", "max_tokens": 8, "temperature": 0,
                                               "plugins": {"constraint": {"name": "guidance", "params": {"regex": " 19[0-9]{2}\\."}}}})
    assert re.fullmatch(r" 19[0-9]{2}\.", regex.json()["choices"][0]["text"]), regex.text
    bad = http.post("/v1/chat/completions", json={**body, "plugins": {"constraint": {"name": "guidance", "params": {"regex": 3}}}})
    assert bad.status_code == 400 and "regex must be a string" in bad.text, bad.text


def test_a_constrained_request_leaves_concurrent_ones_unchanged(http):
    from concurrent.futures import ThreadPoolExecutor
    free = [{"messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0}
            for q in ["Name a fruit.", "Say hello in French.", "What is the sky's colour?"]]
    alone = [http.post("/v1/chat/completions", json=b).json()["choices"][0]["message"]["content"] for b in free]
    constrained = {"messages": [{"role": "user", "content": "Describe a person called Di who is 50, as JSON."}],
                   "max_tokens": 60, "temperature": 0, "response_format": schema_format(PERSON)}
    with ThreadPoolExecutor(4) as pool:
        held = pool.submit(http.post, "/v1/chat/completions", json=constrained)
        together = list(pool.map(lambda b: http.post("/v1/chat/completions", json=b).json(), free))
        held = held.result().json()
    assert [t["choices"][0]["message"]["content"] for t in together] == alone
    assert valid(held["choices"][0]["message"]["content"], PERSON), held


# Forced tool calls: the adapter's grammar (`tool_grammar`) holds the rest of the call to
# the tool's `parameters` and the format's closer, so the call parses and validates.
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit"], "additionalProperties": False}
CALL_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                                "parameters": {"type": "object", "properties": {
                                                    "timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
                                                    "required": ["timezone"]}}}]
CALL_PROMPTS = ["What will the weather be in Paris for the next three days?", "Is it cold in Oslo today, in fahrenheit?",
                "Tell me the time in Tokyo.", "Weather in Lima this week please."]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in CALL_TOOLS}


# (minicpm5's grammar is held to by the scripted forced calls of test_builtins.py: SmolLM2,
# free to name the function here, picks get_time for the weather and writes its pattern's
# letters until max_tokens.)
@pytest.mark.parametrize("adapter", ["hermes", "qwen3-coder", "llama3-json", "mistral", "harmony", "gemma"])
def test_forced_calls_in_every_adapter_format_parse_and_validate(http, adapter):
    calls = []
    for i, prompt in enumerate(CALL_PROMPTS):
        choice = "required" if i % 2 else {"type": "function", "function": {"name": "get_weather"}}
        # qwen3-coder's tags take ~35 tokens around the values (JSON formats ~15): room for both.
        body = {"messages": [{"role": "user", "content": prompt}], "tools": CALL_TOOLS, "tool_choice": choice,
                "max_tokens": 120, "temperature": 0, "plugins": {"tool": {"name": adapter}}}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]
        assert message["finish_reason"] == "tool_calls", (adapter, prompt, message)
        [call] = message["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[call["function"]["name"]])
        if isinstance(choice, dict):
            assert call["function"]["name"] == "get_weather"
        calls.append((call["function"]["name"], args))
    print(adapter, calls)


def test_a_forced_anthropic_tool_use_validates_against_its_input_schema_streamed(anthropic_client):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in CALL_TOOLS]
    # Greedy: sampled at Anthropic's default temperature (unseeded: its API has no seed) the
    # tiny model's string argument ran past max_tokens (60, then 200) in about one run in four.
    with anthropic_client.messages.stream(model="m", max_tokens=200, tools=tools, extra_body={"temperature": 0},
                                          tool_choice={"type": "any"},
                                          messages=[{"role": "user", "content": CALL_PROMPTS[1]}]) as st:
        final = st.get_final_message()
    [block] = final.content
    assert block.type == "tool_use" and final.stop_reason == "tool_use", final
    jsonschema.validate(block.input, SCHEMAS[block.name])


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_forced_call_gets_no_arguments_its_schema_does_not_name_unless_it_allows_them(http, api):
    # Greedy SmolLM2 under mistral's format picks get_time here and, left an open object
    # (`additionalProperties: true`), adds keys of its own; a schema that says nothing is
    # closed (as OpenAI's strict mode and vLLM's xgrammar have it), `strict: true` or not.
    def call(tools):
        body = {"messages": [{"role": "user", "content": CALL_PROMPTS[1]}], "max_tokens": 60, "temperature": 0,
                "plugins": {"tool": {"name": "mistral"}}}
        if api == "openai":
            r = http.post("/v1/chat/completions", json={**body, "tools": tools, "tool_choice": "required"})
            assert r.status_code == 200, r.text
            [c] = r.json()["choices"][0]["message"]["tool_calls"]
            return c["function"]["name"], json.loads(c["function"]["arguments"])
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"],
                  **({"strict": True} if t["function"].get("strict") else {})} for t in tools]
        r = http.post("/v1/messages", json={**body, "tools": tools, "tool_choice": {"type": "any"}})
        assert r.status_code == 200, r.text
        [c] = [b for b in r.json()["content"] if b["type"] == "tool_use"]
        return c["name"], c["input"]
    time_open = {**CALL_TOOLS[1]["function"], "parameters": {**SCHEMAS["get_time"], "additionalProperties": True}}
    name, args = call([CALL_TOOLS[0], {"type": "function", "function": time_open}])
    assert name == "get_time" and set(args) > {"timezone"}, (name, args)
    for strict in [False, True]:
        tools = [CALL_TOOLS[0], {"type": "function", "function": {**CALL_TOOLS[1]["function"], "strict": strict}}]
        name, args = call(tools)
        print("strict" if strict else "closed", name, args)
        assert set(args) <= set(SCHEMAS[name]["properties"]), (name, args)
        jsonschema.validate(args, SCHEMAS[name])


# Calls the model starts on its own (tool_choice auto): after an earlier turn with a call in
# it, SmolLM2 opens `<tool_call>` by itself but writes the tool's result instead of a call.
# The adapter's lazy grammar takes over from the trigger for `strict: true` tools (and for
# every tool with --constrain-tool-calls), so those calls parse and validate; replies that
# open no call stay free text.
UNFORCED = ["And the weather in Paris for the next three days?", "What time is it in Tokyo?",
            "Weather in Lima this week please.", "And in Berlin?", "What about the time in London?"]


def after_a_call(question):
    return [{"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Rome", "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21, "sky": "sunny"}'},
            {"role": "assistant", "content": "It is 21 degrees and sunny in Rome."},
            {"role": "user", "content": question}]


def unforced_replies(http, tools):
    out = []
    for q in UNFORCED:
        body = {"messages": after_a_call(q), "tools": tools, "max_tokens": 60, "temperature": 0,
                "plugins": {"tool": {"name": "hermes"}}}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0])
    return out


def assert_calls_hold(replies):
    calls = 0
    for choice in replies:
        message = choice["message"]
        assert "<tool_call>" not in (message.get("content") or ""), choice
        for call in message.get("tool_calls") or []:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
            calls += 1
    assert calls >= 3, replies


@pytest.fixture(scope="module")
def constraining_server():
    from conftest import Server
    s = Server("--constrain-tool-calls")
    yield s
    s.stop()


def test_calls_the_model_starts_hold_to_the_schema_of_strict_tools(http, openai_client):
    broken = [c["message"]["content"] for c in unforced_replies(http, CALL_TOOLS) if "<tool_call>" in (c["message"]["content"] or "")]
    print(f"baseline: {len(broken)}/{len(UNFORCED)} replies open a call that does not parse:", broken)
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in CALL_TOOLS]
    replies = unforced_replies(http, strict)
    print("strict:", [(c["finish_reason"], c["message"].get("tool_calls")) for c in replies])
    assert_calls_hold(replies)
    # Streamed, the same call.
    plain = next(c for c in replies if c["message"].get("tool_calls"))
    question = UNFORCED[replies.index(plain)]
    stream = openai_client.chat.completions.create(model="m", messages=after_a_call(question), tools=strict, max_tokens=60,
                                                   temperature=0, stream=True, extra_body={"plugins": {"tool": {"name": "hermes"}}})
    args, name = "", None
    for chunk in stream:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name = name or (d.function.name if d.function else None)
            args += (d.function.arguments or "") if d.function else ""
    assert (name, json.loads(args)) == (plain["message"]["tool_calls"][0]["function"]["name"],
                                        json.loads(plain["message"]["tool_calls"][0]["function"]["arguments"]))


def test_the_server_flag_holds_every_call_the_model_starts(constraining_server):
    # Not strict, but closed (with get_time open, greedy SmolLM2 adds keys until max_tokens:
    # the grammar allows them, and cannot make the model stop).
    closed = json.loads(json.dumps(CALL_TOOLS))
    closed[1]["function"]["parameters"]["additionalProperties"] = False
    import httpx
    with httpx.Client(base_url=constraining_server.url, timeout=120) as c:
        assert_calls_hold(unforced_replies(c, closed))
