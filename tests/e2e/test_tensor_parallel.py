"""Tensor-parallel serving on the CPU: `host serve --tensor-parallel 3` (SmolLM2's 3 KV heads,
one process per rank, MLX's ring backend over loopback) answers like one rank — through the
prompt cache (a follow-up turn reuses the cached prefix on every rank) and speculative
decoding (rollbacks trim every rank's cache) and with concurrent requests decoded as one batch
(the batch's joins and leaves mirrored on every rank) — and a rank that dies stops the server
with a message naming it instead of hanging."""
import concurrent.futures
import os
import signal
import time

import httpx

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


def test_three_ranks_serve_like_one_and_a_dead_rank_stops_the_server():
    plain = Server("--prompt-cache-bytes", "256M")
    try:
        want = conversation(plain)
    finally:
        plain.stop()
    assert want[2] is True, "the follow-up turn should reuse the cached prefix"
    tp = Server("--tensor-parallel", "3", "--prompt-cache-bytes", "256M")
    try:
        assert conversation(tp) == want
        workers = workers_of(tp.proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        assert tp.proc.wait(timeout=30) == 1
        time.sleep(0.2)
        assert any("tensor-parallel rank" in line and "exited" in line for line in tp.log), tp.log[-5:]
    finally:
        tp.stop()
