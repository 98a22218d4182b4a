"""Speculative decoding served: a server with SmolLM2 and its layer-truncated draft
(`--draft-model`), driven through both SDKs and raw HTTP. Every speculative answer equals the
plain one (greedy and seeded sampling), streams never carry a rejected token, usage and
/metrics report acceptance, and the prompt cache stays valid after rollbacks."""
import os

import pytest

from conftest import ROOT, Server

EDIT = open(os.path.join(ROOT, "bench", "edit_prompt.txt")).read()
Q = [{"role": "user", "content": EDIT}]


@pytest.fixture(scope="module")
def spec_server():
    draft = os.path.join(os.environ["HOST_TEST_MODELS"], "smollm2-draft8")
    s = Server("--draft-model", draft, "--speculative", "off", "--prompt-cache-bytes", "256M")
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
