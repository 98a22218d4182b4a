"""The second real model through the SDKs: `host serve --model` on Gemma 3 270M's Q4_K_M GGUF
(a base model: SentencePiece vocabulary, sliding-window layers, no chat template).

Completions through the official openai SDK, streamed and not, give `host generate`'s greedy
text; the chat routes of both SDKs refuse with a 400 that says the model has no chat template
and what to use instead, and the server goes on serving.
"""
import json
import os
import subprocess

import anthropic
import httpx
import openai
import pytest

from conftest import ROOT, Server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma():
    path = os.environ.get("HOST_GEMMA_GGUF")
    if not path:
        pytest.fail('HOST_GEMMA_GGUF is not set: run eval "$(scripts/test-fixtures.sh)" first')
    s = Server(model=path)
    yield s
    s.stop()


def host_generate(model, prompt, max_tokens):
    binary = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
    out = subprocess.run([binary, "generate", "--json", "--device", "cpu", "--max-tokens", str(max_tokens),
                          "--prompt", prompt, "--model", model], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_gemma_completions_through_the_openai_sdk_equal_host_generate(gemma):
    want = host_generate(gemma.model, PROMPT, 16)
    client = openai.OpenAI(base_url=gemma.url + "/v1", api_key="none")
    models = client.models.list()
    assert [m.id for m in models.data] and all(m.id for m in models.data)
    r = client.completions.create(model="gemma", prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == want["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want["prompt_token_ids"]) and r.usage.completion_tokens == 16
    stream = client.completions.create(model="gemma", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want["text"]


def test_gemma_chat_routes_say_the_model_has_no_chat_template(gemma):
    client = openai.OpenAI(base_url=gemma.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert "chat template" in str(e.value) and "completions" in str(e.value), str(e.value)
    claude = anthropic.Anthropic(base_url=gemma.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="gemma", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert "chat template" in str(e.value), str(e.value)
    # Still serving.
    r = httpx.post(gemma.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
