"""Admission, cancellation, auth, load and hostile input, each against its own server."""
import concurrent.futures
import json
import random
import re
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

from conftest import Server

Q = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]


@pytest.fixture
def fresh(request):
    servers = []

    def start(*args):
        s = Server(*args)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def test_api_key_is_required_when_configured(fresh):
    s = fresh("--api-key", "sekrit")
    r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(s.url + "/v1/messages", json={"messages": Q, "max_tokens": 2}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert httpx.get(s.url + "/health").status_code == 200
    ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit").chat.completions.create(model="m", messages=Q, max_tokens=2)
    assert ok.choices[0].message.content
    r = httpx.post(s.url + "/v1/messages", json={"model": "m", "messages": Q, "max_tokens": 2}, headers={"x-api-key": "sekrit"}, timeout=60)
    assert r.status_code == 200


def test_requests_beyond_the_queue_limit_get_429(fresh):
    # Two rows and one waiting place: of eight at once, at least five are refused (a burst
    # into free rows is not counted against the limit, issue 42).
    s = fresh("--queue-limit", "1", "--max-batch", "2")
    body = {"messages": LONG, "max_tokens": 60, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120), range(8)))
    statuses = [r.status_code for r in codes]
    assert 429 in statuses and 200 in statuses, statuses
    busy = next(r for r in codes if r.status_code == 429).json()["error"]
    assert busy["type"] == "rate_limit_error" and "retry" in busy["message"]


def test_a_disconnected_client_stops_its_generation(server, http):
    body = {"messages": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # Leave mid-stream.
    start = time.time()
    r = http.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200
    # 400 tokens would take well over 10 s here; a cancelled job frees the engine at once.
    assert time.time() - start < 8, time.time() - start


def test_load_16_concurrent_streaming_clients(fresh):
    s = fresh("--prompt-cache-bytes", "64M")
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=600)
    prompts = [f"Count from {i} to {i + 5}." for i in range(16)]

    def run(prompt):
        chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                temperature=0, max_tokens=16, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    expected = {p: run(p) for p in prompts}  # Sequential reference (greedy is deterministic).
    baseline = s.rss_bytes()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for _ in range(3):
            results = list(pool.map(run, prompts))
            assert results == [expected[p] for p in prompts]
    grown = s.rss_bytes() - baseline
    assert grown < 150 << 20, f"memory grew by {grown / 1e6:.0f} MB"


def test_concurrent_clients_with_their_own_sampling_settings_decode_together_and_get_their_solo_outputs(fresh):
    """Issue 19: sixteen streaming clients, each with its own sampling settings (greedy,
    seeded with top-p/top-k/min-p, penalties, a logit bias) and prompt length, run as one
    batch and get what they get alone: every greedy row exactly, and nearly every sampled row
    (a batched forward sums in another order than a one-row forward, so logits differ in the
    last bits, and a sample drawn at temperature ~1 where two tokens' cumulative probabilities
    meet can go the other way: seen once in many runs); memory returns to where it was."""
    s = fresh("--prompt-cache-bytes", "0")
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=600)
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9, seed=5),
        dict(temperature=1.0, seed=7, extra_body={"top_k": 20}),
        dict(temperature=0, frequency_penalty=0.8),
        dict(temperature=0.7, seed=3, presence_penalty=0.5, logit_bias={"28": -4}),
        dict(temperature=0.9, seed=11, extra_body={"min_p": 0.1, "repetition_penalty": 1.2}),
        dict(temperature=0),
        dict(temperature=1.1, seed=2),
    ]
    settings = kinds + [{**k, "seed": k["seed"] + 100} if "seed" in k else k for k in kinds]
    prompts = ["Hi.", "Name three colors.", "Write one sentence about the sea and the sky at night.",
               "Count from 1 to 9.", "What is the capital of France? Answer in a sentence.",
               "List two fruits.", "Describe a cat " + "very " * 30 + "briefly.", "Say hello in French."]
    prompts = prompts + [p + " Be brief." for p in prompts]

    def run(i):
        chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompts[i]}],
                                                max_tokens=24, stream=True, **settings[i])
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    alone = [run(i) for i in range(16)]
    baseline = s.rss_bytes()
    rows_seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            m = httpx.get(s.url + "/metrics", timeout=10).text
            rows_seen.extend(int(float(l.split()[1])) for l in m.splitlines() if l.startswith("host_batch_rows "))
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(run, range(16)))
    finally:
        done.set()
        watcher.join(30)
    greedy = [i for i in range(16) if settings[i]["temperature"] == 0]
    assert [together[i] for i in greedy] == [alone[i] for i in greedy]
    differ = [(i, alone[i], together[i]) for i in range(16) if together[i] != alone[i]]
    assert len(differ) <= 1, f"sampled rows that differ from their solo run: {differ}"
    assert max(rows_seen) >= 4, f"the requests did not decode together: batch rows seen {sorted(set(rows_seen))}"
    # Prompts that arrived together were prefilled in one forward (their rows still answer as alone).
    assert gauge(s, "host_prefill_together_total") >= 2
    m = dict(l.rsplit(" ", 1) for l in httpx.get(s.url + "/metrics").text.splitlines() if l.startswith("host_batch_size"))
    assert float(m['host_batch_size_bucket{le="1"}']) < float(m["host_batch_size_count"])
    assert float(m['host_batch_size_bucket{le="+Inf"}']) == float(m["host_batch_size_count"]) > 0
    grown = s.rss_bytes() - baseline
    assert grown < 150 << 20, f"memory grew by {grown / 1e6:.0f} MB"


def gauge(server, name):
    m = httpx.get(server.url + "/metrics", timeout=10).text
    return int(float(next(l.split()[1] for l in m.splitlines() if l.startswith(name + " "))))


def test_streams_open_while_waiting_or_prefilling_and_a_disconnect_stops_the_prefill(fresh):
    """Issue 20: with one slot, a ~6,000-token prompt (about 90 s of prefill on this CPU)
    streams keep-alive comments while it prefills, and a second request waiting for the slot
    gets its headers and keep-alive comments at once rather than after the first one's
    prefill, so clients with a first-byte or idle timeout (here 30 s) wait; when the clients
    go, the prefill stops and the waiting request leaves the queue, long before the prefill
    would have ended, and nothing is generated."""
    s = fresh("--prompt-cache-bytes", "0", "--max-batch", "1")
    long = {"messages": [{"role": "user", "content": "hello " * 6000}], "max_tokens": 4, "stream": True}
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    stop = threading.Event()
    seen = []

    def first_client():
        with httpx.Client(timeout=30) as c, c.stream("POST", s.url + "/v1/chat/completions", json=long) as a:
            for chunk in a.iter_raw():
                seen.append(chunk)
                if stop.is_set():
                    return
    reader = threading.Thread(target=first_client)
    reader.start()
    try:
        while not seen:
            time.sleep(0.1)
        with httpx.Client(timeout=30) as c, c.stream("POST", s.url + "/v1/chat/completions", json=short) as b:
            assert b.status_code == 200
            first = next(b.iter_raw())
            assert first.startswith(b":"), f"a keep-alive comment while waiting, got {first!r}"
            # The gauges move at the end of an engine turn, the first one a 512-token chunk of
            # the long prompt: ~5 s alone, past 30 s in session 43's CI (two pytest workers),
            # and still well inside the whole prefill's ~90 s.
            deadline = time.time() + 80
            while (gauge(s, "host_requests_running"), gauge(s, "host_queue_depth")) != (1, 1):
                assert time.time() < deadline, "one request prefilling, one waiting"
                time.sleep(0.2)
    finally:
        stop.set()
        reader.join(60)
    assert any(c.startswith(b":") for c in seen[1:]), seen
    deadline = time.time() + 60
    while gauge(s, "host_requests_running") or gauge(s, "host_queue_depth"):
        assert time.time() < deadline, "the abandoned prefill went on"
        time.sleep(0.2)
    assert not any("generation" in line for line in s.log), "".join(s.log[-20:])


def test_request_logs_name_the_path_the_turn_and_an_abandoned_request(fresh):
    """Each request's log line has its method, path and status (an unknown route's path too);
    a chat turn's line its API, model, stream flag, tool count and prompt tokens; a request
    the client gives up on before the response starts gets a line of its own, and its
    generation is dropped."""
    s = fresh("--prompt-cache-bytes", "0", "--max-batch", "1")
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
        "model": "some-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    assert r.status_code == 200, r.text
    assert httpx.get(s.url + "/v2/nowhere", timeout=10).status_code == 404
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/chat/completions", timeout=3,
                   json={"messages": [{"role": "user", "content": "hello " * 1500}], "max_tokens": 4})
    deadline = time.time() + 60
    while gauge(s, "host_requests_running") or not any("abandoned" in line for line in s.log):
        assert time.time() < deadline, "".join(s.log[-20:])
        time.sleep(0.2)
    # The abandoned prefill (~25 s of work) stopped: the next request is served at once.
    started = time.time()
    assert httpx.post(s.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
    assert time.time() - started < 15
    # The generation line is written as the turn ends, which can come just after the response.
    deadline = time.time() + 10
    while len(re.findall(r"generation prompt=", "".join(s.log))) < 2 and time.time() < deadline:
        time.sleep(0.1)
    log = "".join(s.log)
    assert re.search(r'chat turn api="chat" model="some-model" stream=false messages=1 tools=1 prompt=\d+', log), log
    assert re.search(r'request method=POST path="/v1/chat/completions" route="/v1/chat/completions" status=200', log), log
    assert re.search(r'request method=GET path="/v2/nowhere" route="unmatched" status=404', log), log
    assert re.search(r'request abandoned by the client before the response started method="POST" path="/v1/chat/completions"', log), log
    assert len(re.findall(r"generation prompt=", log)) == 2, log


def test_an_abandoned_speculative_prefill_stops_within_a_chunk(fresh):
    """Speculative requests decode alone, but they prefill in the engine loop's chunks like
    batched ones: an abandoned one stops between chunks (it used to run its whole prefill)."""
    s = fresh("--prompt-cache-bytes", "0", "--max-batch", "1")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/chat/completions", timeout=3, json={
            "messages": [{"role": "user", "content": "hello " * 4000}], "max_tokens": 4, "speculative": "prompt-lookup"})
    # The abandoned prefill (~30 s of work left) stops at its next chunk: the next request
    # is served at once.
    started = time.time()
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "speculative": "prompt-lookup"})
    assert r.status_code == 200 and r.json()["usage"]["speculative"]["method"] == "prompt-lookup", r.text
    assert time.time() - started < 12, time.time() - started


def test_health_answers_while_large_prompts_are_tokenized(fresh):
    """Tokenizing runs off the async runtime's threads: two 3.9 MB `/tokenize` calls (many
    seconds of work on this CPU) do not hold up `/health`. (Measured with a generous bound:
    before, /health waited for the tokenizers, ~27 s.)"""
    s = fresh("--prompt-cache-bytes", "0")
    text = "The quick brown fox jumps over the lazy dog. " * 87_000  # ~3.9 MB
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(httpx.post, s.url + "/tokenize", json={"prompt": text}, timeout=600) for _ in range(2)]
        time.sleep(0.3)  # both bodies sent, tokenizing
        waits = []
        while not all(c.done() for c in calls):
            t = time.time()
            assert httpx.get(s.url + "/health", timeout=60).status_code == 200
            waits.append(time.time() - t)
            time.sleep(0.2)
        results = [c.result() for c in calls]
    assert all(r.status_code == 200 and r.json()["count"] > 500_000 for r in results), [r.text[:200] for r in results]
    print(f"tokenizing took {time.time() - started:.1f} s; /health answered in at most {max(waits or [0]) * 1000:.0f} ms")
    assert waits and max(waits) < 2.0, waits


def test_slow_headers_short_bodies_and_surplus_connections_are_cut_off(fresh, tmp_path):
    """A request line that never ends and a body shorter than its Content-Length hold a
    connection only until the header and body timeouts (here 2 s each, from the config
    file); connections past `max_connections` are closed at once; the server serves on."""
    config = tmp_path / "host.toml"
    config.write_text("header_timeout_secs = 2\nbody_timeout_secs = 2\nmax_connections = 4\n")
    s = fresh("--prompt-cache-bytes", "0", "--config", str(config))
    host, port = s.url[7:].split(":")

    def closed_within(sock, seconds):
        sock.settimeout(seconds)
        data = b""
        try:
            while chunk := sock.recv(4096):
                data += chunk
        except socket.timeout:
            return None
        except ConnectionResetError:
            pass  # closed at once, before reading what was sent
        return data

    started = time.time()
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never end
        assert closed_within(slow, 10) is not None, "the connection stayed open"
    assert time.time() - started < 8
    with socket.create_connection((host, int(port))) as short:
        short.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"messages\": ")
        reply = closed_within(short, 10)
        assert reply is not None and reply.startswith(b"HTTP/1.1 408"), reply
    def open_still(sock):
        sock.setblocking(False)
        try:
            return sock.recv(1) != b""
        except BlockingIOError:
            return True
        except ConnectionResetError:
            return False

    # Four idle connections take every slot until their header timeout (2 s) frees them; a
    # fifth is refused while they hold. A fifth served after one of them timed out (a loaded
    # machine stalling the test past 2 s) proves nothing: that round is taken again.
    for attempt in range(3):
        held = [socket.create_connection((host, int(port))) for _ in range(4)]
        try:
            time.sleep(0.5)
            with socket.create_connection((host, int(port))) as extra:
                extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                extra.settimeout(5)
                try:
                    reply = extra.recv(4096)  # b"": closed at once
                except ConnectionResetError:
                    reply = b""
                held_all = all(open_still(c) for c in held)  # as the reply came
            if reply == b"" or held_all:
                assert reply == b"", f"a fifth connection was served while four were held: {reply[:60]!r}"
                break
        finally:
            for c in held:
                c.close()
        time.sleep(2.5)
    else:
        raise AssertionError("three rounds lost a held connection to the header timeout before the fifth was tried")
    time.sleep(0.5)
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200


def test_web_pages_cannot_drive_the_server(server):
    """A browser's "simple" cross-site POST (text/plain, with the page's Origin) and a
    DNS-rebinding page's foreign Host are refused; the same request from a client passes."""
    body = json.dumps({"messages": Q, "max_tokens": 1})
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                   headers={"content-type": "text/plain", "origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                   headers={"content-type": "application/json", "host": "evil.example:8080"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", r.text
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30, headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text
    r = httpx.options(server.url + "/v1/chat/completions", timeout=30,
                      headers={"origin": "http://evil.example", "access-control-request-method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert httpx.post(server.url + "/v1/chat/completions", content=body, timeout=60,
                      headers={"content-type": "application/json"}).status_code == 200


def hostile_requests():
    """(method, path, body bytes, headers) for at least 200 malformed or hostile requests."""
    j = {"content-type": "application/json"}
    out = []
    routes = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"]
    bad_bodies = [b"", b"{", b"}", b"[]", b"null", b"42", b'"text"', b"{'a': 1}", b'{"messages": }',
                  b"\xff\xfe\x00", b'{"messages": "\xff\xff"}', b'{"messages": [}]', b"{" * 5000 + b"}" * 5000,
                  b'[' * 100000, b'{"a":' * 3000 + b"1" + b"}" * 3000]
    for route in routes:
        for body in bad_bodies:
            out.append(("POST", route, body, j))
    wrong_types = [
        {"messages": "hello"}, {"messages": [1, 2]}, {"messages": [{"role": 5, "content": "x"}]},
        {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": [{"content": "x"}]},
        {"messages": Q, "max_tokens": "many"}, {"messages": Q, "max_tokens": -5}, {"messages": Q, "max_tokens": 0},
        {"messages": Q, "max_tokens": 10 ** 30}, {"messages": Q, "temperature": "hot"}, {"messages": Q, "temperature": -1},
        {"messages": Q, "temperature": 1e308}, {"messages": Q, "top_p": 7}, {"messages": Q, "top_k": -9},
        {"messages": Q, "stop": 5}, {"messages": Q, "stop": ["a"] * 100}, {"messages": Q, "logit_bias": {"abc": 1}},
        {"messages": Q, "logit_bias": {"1": 1e9}}, {"messages": Q, "logit_bias": {"999999999": 1}}, {"messages": Q, "n": 5},
        {"messages": Q, "seed": "x"}, {"messages": Q, "stream": "yes"}, {"messages": Q, "logprobs": True, "top_logprobs": 99},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": {"nested": True}}]}, {"messages": Q, "presence_penalty": 9},
        {"messages": Q, "frequency_penalty": -9}, {"messages": Q, "repetition_penalty": 0}, {"messages": Q, "min_p": 2},
        {"messages": []}, {}, {"prompt": None}, {"messages": Q, "response_format": {"type": "json_schema", "json_schema": {}}},
        {"messages": Q, "response_format": "json"}, {"messages": Q, "modalities": ["audio"]},
    ]
    for body in wrong_types:
        out.append(("POST", "/v1/chat/completions", json.dumps(body).encode(), j))
    completion_bad = [{"prompt": 5}, {"prompt": ["a", "b"]}, {"prompt": ""}, {"prompt": "x", "max_tokens": -1},
                      {"prompt": [10 ** 9]}, {"prompt": "x", "logprobs": 50}, {"prompt": "x", "n": 2}, {"prompt": {"a": 1}}]
    for body in completion_bad:
        out.append(("POST", "/v1/completions", json.dumps(body).encode(), j))
    messages_bad = [{"messages": Q}, {"max_tokens": 5}, {"max_tokens": 5, "messages": []}, {"max_tokens": 5, "messages": "x"},
                    {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
                    {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
                    {"max_tokens": 5, "messages": Q, "temperature": 3}, {"max_tokens": 5, "messages": Q, "system": 5},
                    {"max_tokens": 5, "messages": Q, "tools": [{"description": "no name"}]},
                    {"max_tokens": -2, "messages": Q}, {"max_tokens": 5, "messages": Q, "stop_sequences": "x"}]
    for body in messages_bad:
        out.append(("POST", "/v1/messages", json.dumps(body).encode(), j))
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (10 << 20) + b'"}]}'
    out += [("POST", "/v1/chat/completions", big, j), ("POST", "/v1/messages", big, j)]
    out += [("GET", "/v1/nope", b"", {}), ("POST", "/v1/models", b"{}", j), ("DELETE", "/v1/chat/completions", b"", {}),
            ("GET", "/v1/chat/completions", b"", {}), ("POST", "/../../etc/passwd", b"", {})]
    rng = random.Random(7)
    while len(out) < 230:
        noise = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        out.append(("POST", rng.choice(routes), noise, j))
    return out


def test_200_hostile_requests_each_get_a_4xx_and_the_server_survives(server, http):
    requests = hostile_requests()
    assert len(requests) >= 200
    failures = []
    for method, path, body, headers in requests:
        r = http.request(method, path, content=body, headers=headers)
        if not 400 <= r.status_code < 500:
            failures.append((path, body[:80], r.status_code, r.text[:200]))
    assert not failures, failures[:5]
    assert server.alive()
    # A raw socket that sends garbage and hangs up does not hurt either.
    host, port = server.url[7:].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"GARBAGE / HTTP/9.9\r\n\r\n")
    r = http.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("The capital")


def test_a_request_that_cannot_fit_the_memory_budget_is_told_how_many_tokens_fit(fresh):
    # SmolLM2 float32: ~540 MB of weights, 46 KB of KV cache per token.
    s = fresh("--memory-budget", "700M")
    r = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 100000}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "memory budget" in err["message"]
    # OpenAI's own wording, which clients parse for the window.
    fit = int(err["message"].split("This model's maximum context length is ")[1].split(" tokens")[0])
    assert 100 < fit < 100000, err["message"]
    ok = httpx.post(s.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 8}, timeout=60)
    assert ok.status_code == 200


def test_the_warm_up_measures_a_steps_working_memory_and_keeps_it_out_of_the_kv_budget(fresh):
    """What a step needs beyond the weights (activations; on GPUs the dequantized copies of a
    4-bit model's weights for batches) is measured by the warm-up and not offered as KV room."""
    def room(*args):
        s = fresh("--memory-budget", "800M", "--max-batch", "4", *args)
        return s, httpx.post(s.url + "/tokenize", json={"messages": Q}, timeout=30).json()["max_model_len"]
    warm, warm_room = room("--warm-up", "true")
    _, cold_room = room("--warm-up", "false")
    working = [int(m[1]) for line in warm.log if (m := re.search(r"step_working_bytes=(\d+)", line))]
    assert working and working[0] > 0, warm.log[-10:]
    # SmolLM2 float32 holds ~46 KB of KV per token.
    assert warm_room < cold_room, (warm_room, cold_room, working)
    assert cold_room - warm_room >= working[0] // (64 << 10), (warm_room, cold_room, working)


def test_sigterm_lets_an_in_flight_stream_finish(fresh):
    s = fresh()
    body = {"messages": Q, "max_tokens": 30, "temperature": 0, "stream": True}
    lines = []
    with httpx.Client(base_url=s.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        it = r.iter_lines()
        lines.append(next(it))
        s.proc.terminate()  # SIGTERM while streaming.
        lines.extend(it)
    assert [l for l in lines if l.startswith("data: ")][-1] == "data: [DONE]"
    assert s.proc.wait(timeout=30) == 0


def test_sigterm_during_an_orphaned_prefill_exits_within_the_grace_period(fresh, tmp_path):
    """A ~5,000-token prompt whose client is gone (before, its prefill ran on for minutes, and
    SIGTERM waited for it) and a second client's long prefill still running at SIGTERM: the
    server exits within the grace period plus one prefill chunk."""
    config = tmp_path / "grace.toml"
    config.write_text("shutdown_grace_secs = 2\n")
    s = fresh("--config", str(config), "--prompt-cache-bytes", "0", "--max-batch", "1")
    long = {"messages": [{"role": "user", "content": "hello " * 5000}], "max_tokens": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/chat/completions", json=long, timeout=2)  # the client gives up
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, s.url + "/v1/chat/completions", json=long, timeout=120)
        time.sleep(3)  # its prefill under way
        started = time.time()
        s.proc.terminate()
        try:
            code = s.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("host serve still running 60 s after SIGTERM:\n" + "".join(s.log[-10:]))
        took = time.time() - started
        assert code == 0, "".join(s.log[-10:])
        r = pending.result()
    print(f"exit {took:.1f} s after SIGTERM")
    # Grace (2 s) + the prefill chunk in flight (512 tokens: ~1 s deep in this prompt with the
    # host's CPU attention; with MLX's it took over 10 s in CI, the engine was not stopped in
    # time and the exit under it hung) + the engine's stop.
    assert took < 25, took
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text


def test_sigterm_after_the_only_client_left_a_long_prefill_exits_0(fresh, tmp_path):
    """Issue 42: a streamed ~3,000-word prompt whose client leaves after 3 s, then SIGTERM:
    no connection is left, so the server ended at once, `main` returned while the prefill
    still ran, and the exit hung for good in OpenBLAS's exit handler. Now the engine thread
    is stopped (after its current chunk) before the process exits."""
    config = tmp_path / "grace.toml"
    config.write_text("shutdown_grace_secs = 2\n")
    s = fresh("--config", str(config), "--prompt-cache-bytes", "0")
    body = {"messages": [{"role": "user", "content": "the story goes on " * 750}], "max_tokens": 4, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # the stream is open: the prefill is under way
        time.sleep(3)
    started = time.time()
    s.proc.terminate()
    try:
        code = s.proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        pytest.fail("host serve still running 40 s after SIGTERM:\n" + "".join(s.log[-10:]))
    print(f"exit {time.time() - started:.1f} s after SIGTERM")
    assert code == 0, "".join(s.log[-10:])


def test_requests_still_running_after_the_grace_period_are_stopped_with_a_clear_error(fresh, tmp_path):
    # With a generation still running when the grace period ends, the server used to exit
    # under it: the stream stopped without an error, and the exit could hang (OpenBLAS) or
    # fail the step with bad_alloc. Now the engine stops the request, the client gets why,
    # and the process exits 0 by itself.
    config = tmp_path / "grace.toml"
    config.write_text("shutdown_grace_secs = 1\n")
    s = fresh("--config", str(config))
    # End-of-sequence (id 2) banned: the generation outlasts the grace period.
    body = {"messages": Q, "max_tokens": 4000, "temperature": 0, "stream": True, "logit_bias": {"2": -100}}
    lines = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with httpx.Client(base_url=s.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            it = r.iter_lines()
            lines.append(next(it))
            # A second request waits in the queue behind the running one.
            waiting = pool.submit(httpx.post, s.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
            time.sleep(0.3)
            s.proc.terminate()
            # In the grace period new connections are refused, not left unanswered (issue 42).
            time.sleep(0.3)
            host, port = s.url[7:].split(":")
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, int(port)), timeout=5).close()
            lines.extend(it)
        queued = waiting.result()
    data = [l[len("data: "):] for l in lines if l.startswith("data: ")]
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert "shutting down" in error["message"] and "grace period" in error["message"], error
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "server_shutting_down", queued.text
    assert s.proc.wait(timeout=30) == 0
    deadline = time.time() + 5
    while not any("stopping the requests still running" in l for l in s.log) and time.time() < deadline:
        time.sleep(0.05)
    assert any("stopping the requests still running" in l for l in s.log), "".join(s.log)
