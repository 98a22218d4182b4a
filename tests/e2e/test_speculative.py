"""Speculative decoding served: a server with SmolLM2 and its layer-truncated draft
(`--draft-model`), driven through both SDKs and raw HTTP. Every speculative answer equals the
plain one (greedy and seeded sampling), streams never carry a rejected token, usage and
/metrics report acceptance, and the prompt cache stays valid after rollbacks."""
import os
import time

import pytest

from conftest import ROOT, Server, build_wasm_plugin

EDIT = open(os.path.join(ROOT, "bench", "edit_prompt.txt")).read()
Q = [{"role": "user", "content": EDIT}]


@pytest.fixture(scope="module")
def spec_server():
    draft = os.path.join(os.environ["HOST_TEST_MODELS"], "smollm2-draft8")
    # Every draft verified (HOST_DRAFT_COST=off): these tests are about what verification
    # does, and the cost rule may keep a loaded machine's steps plain (it has tests of its own).
    s = Server("--draft-model", draft, "--speculative", "off", "--prompt-cache-bytes", "256M",
               env={"HOST_DRAFT_COST": "off"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(spec_server):
    import openai

    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, speculative, max_tokens=48, **kw):
    return client.chat.completions.create(
        model="m", messages=Q, max_tokens=max_tokens, temperature=kw.pop("temperature", 0),
        extra_body={"speculative": speculative}, **kw)


def test_greedy_answers_are_identical_with_either_drafter_and_usage_reports_acceptance(client):
    plain = ask(client, "off")
    assert getattr(plain.usage, "speculative", None) is None
    for method in ["prompt-lookup", "draft", {"method": "prompt-lookup", "num_draft_tokens": 3}]:
        r = ask(client, method)
        assert r.choices[0].message.content == plain.choices[0].message.content, method
        spec = r.usage.speculative
        assert spec["drafted_tokens"] > 0 and spec["target_steps"] > 0, spec
        assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    r = ask(client, "prompt-lookup")
    # The edit workload repeats the file: prompt lookup decodes more than a token per step.
    assert r.usage.speculative["tokens_per_step"] > 1.2, r.usage.speculative


def test_seeded_sampling_is_identical_under_speculation(client):
    kw = dict(temperature=0.9, top_p=0.95, seed=21)
    plain = ask(client, "off", **kw).choices[0].message.content
    assert ask(client, "prompt-lookup", **kw).choices[0].message.content == plain
    assert ask(client, "draft", **kw).choices[0].message.content == plain


def test_streams_never_carry_a_rejected_token(client):
    plain = ask(client, "off", max_tokens=64).choices[0].message.content
    stream = client.chat.completions.create(
        model="m", messages=Q, max_tokens=64, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"speculative": "prompt-lookup"})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == plain
    assert usage.speculative["accepted_tokens"] > 0


def test_the_anthropic_api_takes_the_same_field(spec_server):
    import anthropic

    c = anthropic.Anthropic(base_url=spec_server.url, api_key="unused", max_retries=0, timeout=120)
    msg = [{"role": "user", "content": EDIT}]
    plain = c.messages.create(model="m", max_tokens=40, messages=msg, extra_body={"temperature": 0})
    spec = c.messages.create(model="m", max_tokens=40, messages=msg,
                             extra_body={"temperature": 0, "speculative": "prompt-lookup"})
    assert spec.content[0].text == plain.content[0].text
    assert spec.usage.speculative["drafted_tokens"] > 0


def test_the_prompt_cache_stays_valid_after_rollbacks(client):
    # A stop string ends the request inside a verified burst: the engine trims the extra
    # positions before caching, so the repeat reuses the prefix and answers the same.
    plain = ask(client, "off", max_tokens=64).choices[0].message.content
    stop = plain[len(plain) // 2:len(plain) // 2 + 6]
    first = ask(client, "prompt-lookup", max_tokens=64, stop=[stop])
    again = ask(client, "prompt-lookup", max_tokens=64, stop=[stop])
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == again.choices[0].message.content == plain[:plain.index(stop)]
    # A follow-up turn builds on the cached conversation.
    follow = client.chat.completions.create(
        model="m", max_tokens=16, temperature=0, extra_body={"speculative": "prompt-lookup"},
        messages=Q + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "Thanks. Now add a docstring to merge_configs."}])
    assert follow.usage.prompt_tokens_details.cached_tokens > 0
    assert follow.choices[0].message.content


def test_metrics_count_drafts_and_acceptance(spec_server, client):
    import httpx

    ask(client, "prompt-lookup", max_tokens=16)
    text = httpx.get(spec_server.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("host_spec_")}
    assert values["host_spec_drafted_tokens_total"] > 0
    assert 0 < values["host_spec_accepted_tokens_total"] <= values["host_spec_drafted_tokens_total"]
    assert values["host_spec_generation_tokens_total"] > values["host_spec_target_steps_total"] > 0


def test_speculative_and_plain_requests_share_the_batch_and_answer_as_alone(spec_server, client):
    # Five requests at once — prompt lookup, the draft model, plain, a seeded one with lookup
    # — are rows of one batch: each answers what it answers alone, the batch verified drafts
    # (rows rolling back by their own amounts), and /metrics counts both drafters.
    import concurrent.futures
    import httpx

    def metrics():
        text = httpx.get(spec_server.url + "/metrics").text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith(("host_spec_", "host_batch_size_bucket"))}

    names = ["merge_configs", "combine", "merge_all", "join_configs", "merged"]
    asks = [(EDIT.replace("merge_configs", n), m, kw) for n, m, kw in zip(
        names, ["prompt-lookup", "draft", "off", "prompt-lookup", "off"],
        [{}, {}, {}, dict(temperature=0.8, seed=5), dict(temperature=0.7, seed=9)])]

    def one(a):
        text, method, kw = a
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": text}], max_tokens=48,
            temperature=kw.get("temperature", 0), seed=kw.get("seed"), extra_body={"speculative": method})
        return r.choices[0].message.content, r.usage

    alone = [one((text, "off", kw))[0] for text, _, kw in asks]
    before = metrics()
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(one, asks))
    after = metrics()
    assert [t[0] for t in together] == alone
    assert all(t[1].speculative["drafted_tokens"] > 0 for t, a in zip(together, asks) if a[1] != "off")
    assert after["host_spec_batch_verifications_total"] > before["host_spec_batch_verifications_total"]
    assert after["host_spec_batch_draft_tokens_total"] > before["host_spec_batch_draft_tokens_total"]
    for drafter in ["prompt-lookup", "draft"]:
        key = f'host_spec_drafter_drafted_tokens_total{{drafter="{drafter}"}}'
        assert after[key] > before[key], drafter
    # Steps of more than one row: the speculative requests did not decode beside the batch.
    one_row = 'host_batch_size_bucket{le="1"}'
    all_rows = 'host_batch_size_bucket{le="+Inf"}'
    assert after[all_rows] - after[one_row] > before[all_rows] - before[one_row]


def draft_policy(version, budget):
    """A scheduling policy in WAT that keeps the queue as it is (`schedule` says `{}`) and
    gives every speculative row `budget` drafts per step (`schedule_drafts`, ABI.md §5.4)."""
    answer = '{"default": %d}' % budget
    quoted = answer.replace('"', '\\"')
    return f"""(module
      (@custom "host.plugin" "{{\\"abi\\": 1, \\"name\\": \\"drafts\\", \\"version\\": \\"{version}\\", \\"kinds\\": [\\"scheduler\\"]}}")
      (memory (export "memory") 2)
      (func (export "host_alloc") (param i32) (result i32) (i32.const 4096))
      (data (i32.const 1024) "{{}}")
      (data (i32.const 2048) "{quoted}")
      (func (export "schedule") (param i32 i32) (result i64) (i64.const 0x0000040000000002))
      (func (export "schedule_drafts") (param i32 i32) (result i64)
        (i64.or (i64.const 0x0000080000000000) (i64.const {len(answer)}))))"""


def test_a_draft_policy_plugin_sets_the_budgets_and_swaps_under_streaming_clients(tmp_path):
    # The policy caps every row at one draft a step (the built-in rule drafts up to 8 on this
    # workload); swapped for one that allows none while eight clients stream, no request
    # fails, every answer is still the plain one, and the requests after it draft nothing.
    import concurrent.futures
    import httpx
    import openai

    binary = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
    plugins = tmp_path / "plugins"
    plugins.mkdir()

    def install(version, budget):
        src = tmp_path / f"drafts-{version}.wat"
        src.write_text(draft_policy(version, budget))
        built = tmp_path / f"drafts-{version}.wasm"
        import subprocess
        subprocess.run([binary, "plugins", "build-wat", str(src), str(built)], check=True)
        os.replace(built, plugins / "drafts.wasm")

    install("1", 1)
    s = Server("--plugins", str(plugins), "--scheduler", "drafts", "--prompt-cache-bytes", "0")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        texts = [EDIT.replace("merge_configs", f"merge_{i}") for i in range(8)]

        def run(i, max_tokens=40):
            r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": texts[i]}],
                                          max_tokens=max_tokens, temperature=0,
                                          extra_body={"speculative": "prompt-lookup"})
            return r.choices[0].message.content, r.usage.speculative

        plain = [c.chat.completions.create(model="m", messages=[{"role": "user", "content": t}], max_tokens=40,
                                           temperature=0).choices[0].message.content for t in texts[:2]]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            capped = list(pool.map(run, range(2)))
        assert [t for t, _ in capped] == plain
        for _, spec in capped:
            # One draft at most per step: drafted tokens never outnumber the steps.
            assert 0 < spec["drafted_tokens"] <= spec["target_steps"], spec

        def version():
            status = {p["name"]: p for p in httpx.get(s.url + "/v1/plugins").json()["data"]}
            return status["drafts"]["version"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(run, i, 96) for i in range(8)]
            time.sleep(1.0)
            install("2", 0)
            deadline = time.time() + 30
            while version() != "2" and time.time() < deadline:
                time.sleep(0.1)
            assert version() == "2"
            answers = [f.result() for f in streams]
        assert all(text for text, _ in answers)
        after, spec = run(0)
        assert after == plain[0]
        assert spec["drafted_tokens"] == 0, spec
        status = {p["name"]: p for p in httpx.get(s.url + "/v1/plugins").json()["data"]}
        assert status["drafts"]["faults"] == 0
    finally:
        s.stop()


def test_a_draft_policy_written_with_the_rust_sdk_caps_the_budgets(tmp_path):
    # tests/plugins/draft-budget: `DraftScheduler` exported by `export_scheduler!(.., drafts)`,
    # one draft a step for each row likely to accept it, whatever the host's cost rule would
    # verify; the answers stay the plain ones.
    import concurrent.futures
    import httpx
    import openai

    plugins = build_wasm_plugin("draft-budget", "one-draft", tmp_path)
    s = Server("--plugins", str(plugins), "--scheduler", "one-draft", "--prompt-cache-bytes", "0")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        texts = [EDIT.replace("merge_configs", f"merge_{i}") for i in range(2)]

        def run(text, speculative):
            r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                          max_tokens=32, temperature=0, extra_body={"speculative": speculative})
            return r.choices[0].message.content, getattr(r.usage, "speculative", None)

        plain = [run(t, "off")[0] for t in texts]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            capped = list(pool.map(lambda t: run(t, "prompt-lookup"), texts))
        assert [t for t, _ in capped] == plain
        for _, spec in capped:
            assert 0 < spec["drafted_tokens"] <= spec["target_steps"], spec
        status = {p["name"]: p for p in httpx.get(s.url + "/v1/plugins").json()["data"]}
        assert status["one-draft"]["faults"] == 0 and status["one-draft"]["state"] == "ready", status
    finally:
        s.stop()
