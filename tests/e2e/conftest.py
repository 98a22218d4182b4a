"""Fixtures for the end-to-end tests: the real `host serve` binary on a free loopback port
with a real model (SmolLM2-135M-Instruct, float32, from scripts/test-fixtures.sh).

Environment: HOST_BIN (default target/debug/host), HOST_TEST_MODELS (set by
`eval "$(scripts/test-fixtures.sh)"`).
"""
import os
import queue
import re
import subprocess
import threading
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Server:
    def __init__(self, *args, model=None, cwd=None, env=None, prefix=()):
        binary = os.environ.get("HOST_BIN", os.path.join(ROOT, "target", "debug", "host"))
        models = os.environ.get("HOST_TEST_MODELS")
        if not models:
            pytest.fail('HOST_TEST_MODELS is not set: run eval "$(scripts/test-fixtures.sh)" first')
        self.model = str(model or os.path.join(models, "smollm2-f32"))
        cmd = [*prefix, binary, "serve", "--model", self.model, "--port", "0", "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                     env={**os.environ, **(env or {})})
        self.log = []
        # The log is read on a thread of its own from the start: waiting on the pipe itself
        # for the address line would block past any deadline, and past the server's exit
        # when a child of it (a tensor-parallel rank) still holds the pipe open.
        lines = queue.Queue()
        threading.Thread(target=self._drain, args=(lines,), daemon=True).start()
        deadline = time.time() + 120
        self.url = None
        while self.url is None:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    time.sleep(0.2)  # what it wrote last
                    raise RuntimeError(f"host serve exited ({self.proc.returncode}):\n" + "".join(self.log))
                if time.time() > deadline:
                    self.proc.kill()
                    raise RuntimeError("host serve did not start within 120 s:\n" + "".join(self.log))
                continue
            m = re.search(r"on (http://[0-9.:]+)", line)
            if m:
                self.url = m.group(1)

    def _drain(self, lines):
        # Keeps draining the log so the server never blocks on a full pipe.
        for line in self.proc.stderr:
            self.log.append(line)
            lines.put(line)

    def rss_bytes(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def build_wasm_plugin(crate, name, dest):
    """Builds the Rust plugin `crate` (a workspace member) for wasm32 and copies it to
    `dest/name.wasm`; returns `dest`."""
    subprocess.run(["cargo", "build", "--quiet", "--release", "--target", "wasm32-unknown-unknown", "-p", crate],
                   cwd=ROOT, check=True)
    wasm = os.path.join(ROOT, "target", "wasm32-unknown-unknown", "release", crate.replace("-", "_") + ".wasm")
    (dest / f"{name}.wasm").write_bytes(open(wasm, "rb").read())
    return dest


@pytest.fixture(scope="session")
def server():
    s = Server("--prompt-cache-bytes", "256M")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
