"""A model split over two hosts: each rank in a network namespace of its own (made here with
`ip netns` and a veth pair, addresses only inside them), rank 0 `host serve --hostfile`, rank
1 `host tp-worker --hostfile --rank 1` started by hand before it, talking TCP over MLX's ring
backend. Tensor-parallel shards, pipeline stages, and stages of shards (two hosts of two ranks
each, or four hosts on a switch) alike: concurrent requests (one batch)
answer what one rank answers; a worker with other
model files is refused with the difference named; a killed worker and a dropped link each
stop the server within seconds, naming the rank and its host."""
import concurrent.futures
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import time
import uuid

import httpx
import pytest

from conftest import Server

BINARY = os.environ.get("HOST_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "target", "debug", "host"))
CLONE_NEWNET = 0x40000000
ADDRESSES = ("10.249.0.1", "10.249.0.2")
PROMPTS = ["The capital of France", "one two three four one two three", "Hello", "A long time ago, in a"]


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def lan(count, subnet="10.249.3"):
    """`count` hosts on one switch: a namespace each, joined by veth pairs to a bridge in a
    namespace of its own, host i at `subnet`.(i + 1); yields [(namespace, address)]."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    switch = f"s{tag}"
    hosts = [(f"s{tag}h{i}", f"{subnet}.{i + 1}") for i in range(count)]
    made = []
    try:
        for ns in [switch] + [ns for ns, _ in hosts]:
            try:
                ip("netns", "add", ns)
            except (subprocess.CalledProcessError, FileNotFoundError) as e:
                pytest.skip(f"no network namespaces here: {e}")
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", switch, "link", "add", "sw", "type", "bridge")
        ip("-n", switch, "link", "set", "sw", "up")
        for i, (ns, addr) in enumerate(hosts):
            ip("link", "add", f"{ns}0", "type", "veth", "peer", "name", f"{switch}p{i}")
            ip("link", "set", f"{ns}0", "netns", ns)
            ip("link", "set", f"{switch}p{i}", "netns", switch)
            ip("-n", switch, "link", "set", f"{switch}p{i}", "master", "sw", "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"{ns}0")
            ip("-n", ns, "link", "set", f"{ns}0", "up")
        yield hosts
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def hosts(tmp_path):
    """Two hosts, `a` and `b` (ADDRESSES), on one switch; yields (namespace of a, namespace of
    b, hostfile)."""
    with lan(2, subnet=ADDRESSES[0].rsplit(".", 1)[0]) as [(a, _), (b, _)]:
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(json.dumps([{"ssh": "a", "ips": [ADDRESSES[0]]}, {"ssh": "b", "ips": [ADDRESSES[1]]}]))
        yield a, b, str(hostfile)


def enter(ns):
    """Moves the calling thread into namespace `ns` (the sockets it opens then live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)


def answers(url, ns=None):
    """Each prompt alone, then all at once (rows of one batch): (alone, together)."""
    def one(prompt):
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json={"prompt": prompt, "max_tokens": 12 + len(prompt) % 5, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    init = (lambda: enter(ns)) if ns else None
    with concurrent.futures.ThreadPoolExecutor(1, initializer=init) as pool:
        alone = list(pool.map(one, PROMPTS))
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS), initializer=init) as pool:
        together = list(pool.map(one, PROMPTS))
    return alone, together


def one_rank(model):
    """What `answers` gets from `model` on one rank."""
    one = Server("--prompt-cache-bytes", "0", model=model)
    try:
        return answers(one.url)[0]
    finally:
        one.stop()


def start_worker(ns, hostfile, *extra, binary=BINARY, rank=1):
    return subprocess.Popen(["ip", "netns", "exec", ns, binary, "tp-worker", "--hostfile", hostfile, "--rank",
                             str(rank), "--device", "cpu", *extra], stderr=subprocess.PIPE, text=True)


def wait_exit(server, seconds):
    start = time.time()
    code = server.proc.wait(timeout=seconds)
    time.sleep(0.2)  # its last line
    return code, time.time() - start


@pytest.mark.parametrize("split", [[], ["--pipeline-parallel", "2"]], ids=["tensor", "pipeline"])
def test_two_hosts_serve_like_one_and_stop_with_rank_0(hosts, split):
    a, b, hostfile = hosts
    tiny = os.path.join(os.environ["HOST_TEST_MODELS"], "tiny-qwen2")
    want = one_rank(tiny)
    # The worker starts first and waits for rank 0.
    worker = start_worker(b, hostfile)
    server = Server("--hostfile", hostfile, "--prompt-cache-bytes", "0", *split, model=tiny,
                    prefix=["ip", "netns", "exec", a])
    try:
        alone, together = answers(server.url, ns=a)
        assert alone == want
        assert together == want
        how = "pipeline parallel over hosts" if split else "tensor parallel over hosts"
        assert any(how in line for line in server.log), server.log[-5:]
        server.proc.terminate()
        assert server.proc.wait(timeout=30) == 0
        assert worker.wait(timeout=10) == 0
    finally:
        server.stop()
        worker.kill()


@pytest.mark.parametrize("places", [[0, 0, 1, 1], [0, 1, 2, 3]], ids=["two-hosts-of-two", "four-hosts"])
def test_pipeline_stages_of_shards_over_hosts_serve_like_one_rank(places, tmp_path):
    """Two pipeline stages of two tensor-parallel shards (ranks 0-1 the last stage, 2-3 the
    first) over hosts on one switch: two hosts of two ranks each (the hostfile lists each host
    twice; the shards' sums stay inside a host, and only the stages' activations and the ids
    cross the link, rank 2 to rank 1 and rank 0 to rank 3), or a host per rank."""
    tiny = os.path.join(os.environ["HOST_TEST_MODELS"], "tiny-qwen2")
    want = one_rank(tiny)
    with lan(max(places) + 1) as hosts:
        hostfile = tmp_path / "four.json"
        hostfile.write_text(json.dumps([{"ssh": f"h{p}", "ips": [hosts[p][1]]} for p in places]))
        workers = [start_worker(hosts[p][0], str(hostfile), rank=rank) for rank, p in enumerate(places) if rank]
        server = Server("--hostfile", str(hostfile), "--prompt-cache-bytes", "0", "--pipeline-parallel", "2",
                        "--tensor-parallel", "2", model=tiny, prefix=["ip", "netns", "exec", hosts[0][0]])
        try:
            alone, together = answers(server.url, ns=hosts[0][0])
            assert alone == want
            assert together == want
            assert any("pipeline parallel (2 stages) x tensor parallel (2 shards) over hosts" in line
                       for line in server.log), server.log[-5:]
            server.proc.terminate()
            assert server.proc.wait(timeout=30) == 0
            assert [w.wait(timeout=10) for w in workers] == [0, 0, 0]
        finally:
            server.stop()
            for w in workers:
                w.kill()


def test_a_worker_with_another_binary_or_other_model_files_is_refused(hosts, tmp_path):
    a, b, hostfile = hosts
    models = os.environ["HOST_TEST_MODELS"]
    other = tmp_path / "host"
    shutil.copyfile(BINARY, other)
    with open(other, "ab") as f:
        f.write(b"another build")
    other.chmod(0o755)
    worker = start_worker(b, hostfile, binary=str(other))
    with pytest.raises(RuntimeError) as refused:
        Server("--hostfile", hostfile, model=os.path.join(models, "tiny-qwen2"), prefix=["ip", "netns", "exec", a])
    assert "rank 1 on b (10.249.0.2) runs another build of host" in str(refused.value), refused.value
    assert worker.wait(timeout=20) == 1
    assert "rank 0 refused this worker" in worker.stderr.read()

    worker = start_worker(b, hostfile, "--model", os.path.join(models, "tiny-llama"))
    with pytest.raises(RuntimeError) as refused:
        Server("--hostfile", hostfile, model=os.path.join(models, "tiny-qwen2"), prefix=["ip", "netns", "exec", a])
    message = str(refused.value)
    assert "tensor-parallel rank 1 on b (10.249.0.2)" in message and "config.json is" in message, message
    assert worker.wait(timeout=20) == 1
    assert "are not rank 0's" in worker.stderr.read()


def test_a_killed_rank_and_a_dropped_link_stop_the_server_naming_the_rank(hosts):
    a, b, hostfile = hosts
    tiny = os.path.join(os.environ["HOST_TEST_MODELS"], "tiny-qwen2")
    worker = start_worker(b, hostfile)
    server = Server("--hostfile", hostfile, model=tiny, prefix=["ip", "netns", "exec", a])
    try:
        worker.kill()
        code, took = wait_exit(server, 20)
        assert code == 1 and took < 5, (code, took)
        assert any("tensor-parallel rank 1 on b (10.249.0.2) exited" in line for line in server.log), server.log[-3:]
    finally:
        server.stop()
        worker.kill()

    worker = start_worker(b, hostfile)
    server = Server("--hostfile", hostfile, model=tiny, prefix=["ip", "netns", "exec", a])
    try:
        alone, _ = answers(server.url, ns=a)  # the link works first
        assert len(alone) == len(PROMPTS)
        ip("-n", b, "link", "set", f"{b}0", "down")
        code, took = wait_exit(server, 30)
        assert code == 1 and took < 20, (code, took)
        assert any("rank 1 on b (10.249.0.2) sent nothing" in line for line in server.log), server.log[-3:]
        assert worker.wait(timeout=20) == 1
        assert "nothing from rank 0 at 10.249.0.1" in worker.stderr.read()
    finally:
        server.stop()
        worker.kill()


def test_ssh_launch_starts_the_other_rank_on_its_host(hosts, tmp_path):
    """`--ssh-launch`: rank 0 starts rank 1 through a real sshd running in the other host's
    namespace (a key made here; HOST_SSH carries ssh's options)."""
    a, b, _ = hosts
    if not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("no sshd (Debian: openssh-server)")
    for key in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / key)], check=True)
    shutil.copyfile(tmp_path / "id.pub", tmp_path / "authorized_keys")
    config = tmp_path / "sshd_config"
    config.write_text("\n".join([
        f"ListenAddress {ADDRESSES[1]}", "Port 22", f"HostKey {tmp_path}/host_key",
        f"AuthorizedKeysFile {tmp_path}/authorized_keys", "PermitRootLogin prohibit-password",
        "PasswordAuthentication no", "StrictModes no", "UsePAM no", f"PidFile {tmp_path}/sshd.pid", ""]))
    os.makedirs("/run/sshd", exist_ok=True)
    sshd = subprocess.Popen(["ip", "netns", "exec", b, "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                            stderr=subprocess.PIPE, text=True)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": [ADDRESSES[0]]},
                                    {"ssh": f"root@{ADDRESSES[1]}", "ips": [ADDRESSES[1]]}]))
    ssh = (f"ssh -i {tmp_path}/id -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
           "-o LogLevel=ERROR -o ConnectTimeout=5")
    tiny = os.path.join(os.environ["HOST_TEST_MODELS"], "tiny-qwen2")
    server = None
    try:
        server = Server("--hostfile", str(hostfile), "--ssh-launch", "--pipeline-parallel", "2", model=tiny,
                        prefix=["ip", "netns", "exec", a], env={"HOST_SSH": ssh})
        alone, together = answers(server.url, ns=a)
        assert together == alone
        server.proc.terminate()
        assert server.proc.wait(timeout=30) == 0
    finally:
        if server:
            server.stop()
        sshd.terminate()
        sshd.wait(timeout=10)
