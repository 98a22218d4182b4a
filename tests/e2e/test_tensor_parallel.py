"""Tensor-parallel serving on the CPU: `host serve --tensor-parallel 3` (SmolLM2's 3 KV heads,
one process per rank, MLX's ring backend over loopback) answers like one rank — through the
prompt cache (a follow-up turn reuses the cached prefix on every rank) and speculative
decoding (rollbacks trim every rank's cache) and with concurrent requests decoded as one batch
(the batch's joins and leaves mirrored on every rank) — and a rank that dies stops the server
with a message naming it instead of hanging; pipeline stages of tensor-parallel shards (2 x 3)
answer the same way. On 2 ranks (a tiny model whose heads divide by
2), speculative rows — prompt lookup, a draft model, constrained and plugin-sampled — verify
inside the batch beside plain rows, rolling back by their own amounts on every rank, and
each answers what it answers alone."""
import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from conftest import Server

TURN1 = [{"role": "user", "content": "Name a planet."}]


def conversation(server):
    out = []
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                   json={"messages": TURN1, "max_tokens": 10, "temperature": 0}).json()
    first = r["choices"][0]["message"]["content"]
    out.append(first)
    turn2 = TURN1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And another one?"}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                   json={"messages": turn2, "max_tokens": 10, "temperature": 0}).json()
    out.append(r["choices"][0]["message"]["content"])
    out.append(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Repeat: red, green, blue, red, green, blue, red, green"}],
        "max_tokens": 10, "temperature": 0, "speculative": "prompt-lookup"}).json()
    out.append(r["choices"][0]["message"]["content"])
    # Four at once, of different lengths: rows of one batch, joining and leaving.
    prompts = ["Name a color.", "Count to five.", "Say hi.", "What is two plus two? Answer briefly."]

    def one(i):
        return httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": 6 + 3 * i,
            "temperature": 0}).json()["choices"][0]["message"]["content"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        out.extend(pool.map(one, range(4)))
    return out


def workers_of(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


@pytest.fixture(scope="module")
def one_rank():
    plain = Server("--prompt-cache-bytes", "256M")
    try:
        want = conversation(plain)
    finally:
        plain.stop()
    assert want[2] is True, "the follow-up turn should reuse the cached prefix"
    return want


# Pipeline stages of 8, 8, 7 and 7 of SmolLM2's 30 layers: the shorter stages skip the
# operations on rank 0's eighth layer's caches.
@pytest.mark.parametrize("split", [["--tensor-parallel", "3"], ["--pipeline-parallel", "4"]], ids=["tp3", "pp4"])
def test_split_ranks_serve_like_one_and_a_dead_rank_stops_the_server(one_rank, split):
    tp = Server(*split, "--prompt-cache-bytes", "256M")
    try:
        assert conversation(tp) == one_rank
        workers = workers_of(tp.proc.pid)
        assert len(workers) == int(split[1]) - 1, workers
        os.kill(workers[0], signal.SIGKILL)
        assert tp.proc.wait(timeout=30) == 1
        time.sleep(0.2)
        assert any("tensor-parallel rank" in line and "exited" in line for line in tp.log), tp.log[-5:]
    finally:
        tp.stop()


def test_pipeline_stages_of_tensor_parallel_shards_serve_like_one_rank():
    """`--pipeline-parallel 2 --tensor-parallel 3`: six ranks, two stages of three shards
    (a tiny Llama whose heads split three ways). Inside a stage the shards sum over a chain of
    neighbours (ranks 0-1-2 and 3-4-5, the middle shard passing partial sums down and the
    total up); rank 3 hands the hidden state to rank 2, which passes it down its stage; rank 0
    sends the ids to rank 5, which passes them down its. Answers equal one rank's, through the
    prompt cache, prompt lookup and a batch; a killed middle shard stops the server."""
    thirds = os.path.join(os.environ["HOST_TEST_MODELS"], "tiny-llama-thirds")
    plain = Server("--prompt-cache-bytes", "256M", model=thirds)
    try:
        want = conversation(plain)
    finally:
        plain.stop()
    split = Server("--pipeline-parallel", "2", "--tensor-parallel", "3", "--prompt-cache-bytes", "256M", model=thirds)
    try:
        assert conversation(split) == want
        assert any("pipeline parallel (2 stages) x tensor parallel (3 shards)" in line for line in split.log)
        workers = workers_of(split.proc.pid)
        assert len(workers) == 5, workers
        os.kill(sorted(workers)[0], signal.SIGKILL)
        assert split.proc.wait(timeout=30) == 1
        time.sleep(0.2)
        assert any("tensor-parallel rank" in line and "exited" in line for line in split.log), split.log[-5:]
    finally:
        split.stop()


def test_two_ranks_verify_speculative_rows_in_the_batch_and_each_answers_as_alone():
    tiny = os.path.join(os.environ["HOST_TEST_MODELS"], "tiny-qwen2")
    # The draft model is the target itself (on rank 0 only): its rows accept every draft while
    # prompt lookup's are mostly rejected by the random model, so rows keep different amounts.
    s = Server("--tensor-parallel", "2", "--draft-model", tiny, "--prompt-cache-bytes", "0",
               model=tiny, env={"HOST_DRAFT_COST": "off"})
    try:
        def metrics():
            text = httpx.get(s.url + "/metrics").text
            return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                    if line.startswith(("host_spec_", "host_batch_size_bucket"))}

        loop = "one two three four one two three four one two three four one two"
        asks = [
            (loop, "prompt-lookup", {}),
            ("red green blue red green blue red green blue red green", "prompt-lookup", {}),
            ("The quick brown fox", "draft", {}),
            (loop + " three", "prompt-lookup", {"regex": "[a-z ]{1,60}"}),
            ("a b c a b c a b c a b c a b", "prompt-lookup",
             {"plugins": {"sampler": {"name": "mirostat", "config": {"tau": 8.0}}}, "temperature": 1.0, "seed": 7}),
            ("Hello there, how are", "off", {}),
            (loop + " three four", "prompt-lookup", {"temperature": 0.8, "seed": 3}),
        ]

        def one(a, speculative=None):
            prompt, method, extra = a
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, **extra,
                    "speculative": speculative or method}
            r = httpx.post(s.url + "/v1/completions", timeout=300, json=body)
            assert r.status_code == 200, r.text
            return r.json()

        alone = [one(a, "off")["choices"][0]["text"] for a in asks]
        before = metrics()
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            together = list(pool.map(one, asks))
        after = metrics()
        assert [r["choices"][0]["text"] for r in together] == alone
        spec = [(a[0], r["usage"].get("speculative"), r["choices"][0]["text"]) for r, a in zip(together, asks)]
        assert all(u["drafted_tokens"] > 0 for (_, u, _), a in zip(spec, asks) if a[1] != "off"), spec
        assert after["host_spec_batch_verifications_total"] > before["host_spec_batch_verifications_total"]
        # Rollbacks happened: prompt lookup's drafts were partly rejected while the draft
        # model's were all accepted, in the same verifications.
        drafted, accepted = ('host_spec_drafter_%s_tokens_total{drafter="%s"}' % (k, d)
                             for k, d in [("drafted", "prompt-lookup"), ("accepted", "prompt-lookup")])
        assert after[drafted] - before[drafted] > after[accepted] - before[accepted]
        one_row, all_rows = 'host_batch_size_bucket{le="1"}', 'host_batch_size_bucket{le="+Inf"}'
        assert after[all_rows] - after[one_row] > before[all_rows] - before[one_row]
        assert s.alive()
    finally:
        s.stop()
