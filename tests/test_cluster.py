"""`minillm serve --replicas`: replicas on a local Ray Serve (every address 127.0.0.1), driven
by OpenAI's official client as the single server is in test_server.py; the same answers, prefix
routing, a replica killed mid-stream, and a shutdown that leaves nothing running. The prefix
router's choices are also tested alone, without Ray."""
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from conftest import model_path
from test_server import KEY, LiveServer, chat_request, run

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

REPLICAS = ("--replicas", "2", "--threads", "1", "--parallel", "4", "--ctx", "1024", "--api-key", KEY)
RAY_LOCAL = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}  # as serve sets for its own Ray
SYSTEM = ("You are a careful assistant who answers in one short sentence, plainly, and never adds a "
          "greeting or a question of your own.")


@pytest.fixture(scope="module")
def cluster():
    live = LiveServer(*REPLICAS)
    yield live
    if live.proc.poll() is None:
        live.stop(timeout=60)


def replicas_live(cluster) -> list[dict]:
    status, _, body = cluster.request("GET", "/health")
    return body["replicas"] if status == 200 else []


def wait_replicas(cluster, n: int, timeout: float = 60, gone: str | None = None) -> list[dict]:
    """The live replicas once n of them (none of them `gone`) report status ok."""
    deadline = time.monotonic() + timeout
    while True:
        live = replicas_live(cluster)
        if len(live) == n and all(r["status"] == "ok" and r["id"] != gone for r in live):
            return live
        assert time.monotonic() < deadline, f"not {n} replicas ready within {timeout} s: {live}"
        time.sleep(0.5)


def raw(client, body: dict, stream: bool = False):
    """(text, replica id) of one request, through the client's raw-response interface."""
    chat = "messages" in body
    call = (client.chat.completions if chat else client.completions).with_raw_response.create
    response = call(**body, stream=stream)
    replica = response.headers["x-minillm-replica"]
    parsed = response.parse()
    if not stream:
        choice = parsed.choices[0]
        return (choice.message.content if chat else choice.text), replica
    parts = []
    for event in parsed:
        for choice in event.choices:
            parts.append((choice.delta.content or "") if chat else choice.text)
    return "".join(parts), replica


def test_replicas_answer_as_the_single_server(cluster):
    bodies = [chat_request(i) for i in range(16)]
    single = LiveServer("--threads", "1", "--parallel", "4", "--ctx", "1024", "--api-key", KEY)
    try:
        expected = [run(single.client(), body, stream=i % 2 == 1) for i, body in enumerate(bodies)]
        refused = single.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": -1},
                                 {"Authorization": f"Bearer {KEY}"})
    finally:
        assert single.stop() == 0
    health = wait_replicas(cluster, 2)
    assert all(r["slots"] == 4 for r in health), health
    client = cluster.client()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda ib: (run(client, ib[1], stream=ib[0] % 2 == 1)), enumerate(bodies)))
    assert got == expected  # batch invariance holds across replicas and through Ray
    # errors are the single server's: the same status and body; the key is checked
    status, _, body = cluster.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": -1},
                                      {"Authorization": f"Bearer {KEY}"})
    assert (status, body) == refused[::2] and status == 400
    with pytest.raises(openai.AuthenticationError):
        cluster.client(key="wrong", max_retries=0).completions.create(model="x", prompt="Hi", max_tokens=2)
    assert cluster.request("GET", "/metrics")[0] == 401
    # /metrics adds up the replicas' reports, each a second old at most: the 16 answers, the two
    # refusals, then 8 more requests of 5 tokens each are 40 more tokens
    before = cluster.wait_for(lambda m: m["minillm_requests_finished_total"] >= 16 and m["minillm_replicas"] == 2
                              and m["minillm_requests_rejected_total"] >= 2, "both replicas' reports")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.completions.create(model="x", prompt=f"{i} " * 40, max_tokens=5,
                                                          extra_body={"ignore_eos": True}), range(8)))
    after = cluster.wait_for(lambda m: m["minillm_requests_finished_total"] >= before["minillm_requests_finished_total"]
                             + 8, "the 8 requests reported")
    time.sleep(1.5)  # one more report from each replica: nothing else was counted
    assert cluster.metrics()["minillm_generated_tokens_total"] == after["minillm_generated_tokens_total"] \
        == before["minillm_generated_tokens_total"] + 40


def test_a_conversation_stays_on_its_replica(cluster):
    client = cluster.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}]
    body = {"model": "x", "messages": messages, "max_tokens": 8, "temperature": 0}
    answer, first = raw(client, body)
    seen = {first}
    for turn in ("Name another.", "And one more.", "Which did you like best?"):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": turn}]
        answer, replica = raw(client, {**body, "messages": messages}, stream=True)
        seen.add(replica)
    assert seen == {first}
    # requests with no shared start spread over both replicas
    spread = {raw(client, {"model": "x", "prompt": f"{i} " * 40, "max_tokens": 2})[1] for i in range(12)}
    assert len(spread) == 2


def test_a_killed_replica_ends_its_streams_and_is_replaced(cluster):
    client = cluster.client(max_retries=0, timeout=60)
    response = client.completions.with_raw_response.create(
        model="x", prompt="Once upon a time", max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
    victim = response.headers["x-minillm-replica"]
    pid = next(r["pid"] for r in replicas_live(cluster) if r["id"] == victim)
    events = iter(response.parse())
    next(events)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="replica answering this request stopped"):
        for _ in events:
            pass
    # new requests go to the other replica at once, and Ray starts a new one
    for i in range(4):
        assert run(cluster.client(timeout=60), chat_request(i))[0]
    wait_replicas(cluster, 2, timeout=180, gone=victim)
    assert run(cluster.client(timeout=60), chat_request(5))[0]


def descendants(pid: int) -> set[int]:
    """Every process below pid (Ray's own and its replicas, for the command)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_ends_streams_and_leaves_nothing_running(cluster):
    processes = descendants(cluster.proc.pid)
    assert {r["pid"] for r in replicas_live(cluster)} <= processes
    client = cluster.client(max_retries=0, timeout=60)
    stream = client.completions.create(model="x", prompt="Once upon a time", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    events = iter(stream)
    next(events)
    cluster.proc.send_signal(signal.SIGTERM)
    finish = [c.finish_reason for event in events for c in event.choices if c.finish_reason]
    assert finish == ["abort"]
    assert cluster.proc.wait(60) == 0
    deadline = time.monotonic() + 30
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in processes if alive(p)]
    assert "minillm serve: stopped" in "".join(cluster.stderr)


def test_autoscaling_and_a_shutdown_from_outside():
    live = LiveServer("--replicas", "1:2", "--threads", "1", "--parallel", "2", "--ctx", "512")
    try:
        wait_replicas(live, 1)
        client = live.client(max_retries=0, timeout=120)

        def long_request(i):
            try:
                return client.completions.create(model="x", prompt=f"Story {i}:", max_tokens=400,
                                                 extra_body={"ignore_eos": True}).usage.completion_tokens
            except openai.APIError as exc:  # the ones still running when the application goes
                return exc

        # 12 requests for 2 slots: the queue holds for seconds, and Ray adds the second replica
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = [pool.submit(long_request, i) for i in range(12)]
            wait_replicas(live, 2, timeout=120)
            processes = descendants(live.proc.pid)
            # `serve shutdown` (or serve.delete) from another Ray client ends the command (which then
            # stops its local Ray: a blocking delete would still be waiting on it)
            delete = "import ray; from ray import serve; ray.init(address='auto'); serve.delete('minillm', _blocking=False)"
            outside = subprocess.run([sys.executable, "-c", delete], env=dict(os.environ, **RAY_LOCAL),
                                     capture_output=True, text=True, timeout=120)
            assert outside.returncode == 0, outside.stderr
            assert live.proc.wait(60) == 0
            assert all(a.result(timeout=60) == 400 or isinstance(a.result(), openai.APIError) for a in answers)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in processes if alive(p)]
        assert "the application was shut down from outside" in "".join(live.stderr)
    finally:
        if live.proc.poll() is None:
            live.stop(timeout=60)


def test_joining_a_running_ray_leaves_it_running(monkeypatch):
    """--ray-address: the replicas go to a Ray started beforehand (`ray start`, on 127.0.0.1 here,
    with a token: the command and every client need its settings); stopping the command removes
    its application and leaves that Ray up."""
    ray_cli = [os.path.join(os.path.dirname(sys.executable), "ray")]
    for name, value in RAY_LOCAL.items():
        monkeypatch.setenv(name, value)
    env = dict(os.environ)
    port = free_port(6300, 6999)  # under Ray's worker ports (10002 and up)
    started = subprocess.run(ray_cli + ["start", "--head", "--port", str(port), "--num-cpus", "2",
                                        "--include-dashboard", "false", "--disable-usage-stats"],
                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             timeout=120)  # no pipes: Ray's daemons would hold them open
    try:
        assert started.returncode == 0
        live = LiveServer("--replicas", "1", "--threads", "1", "--ray-address", f"127.0.0.1:{port}")
        assert f"on Ray 127.0.0.1:{port}" in "".join(live.stderr)
        assert run(live.client(key="none"), chat_request(0))[0]
        assert live.stop(timeout=60) == 0
        apps = "import ray; from ray import serve; ray.init(address='auto'); print(sorted(serve.status().applications))"
        left = subprocess.run([sys.executable, "-c", apps], env=env, capture_output=True, text=True, timeout=120)
        assert left.returncode == 0 and left.stdout.strip().endswith("[]"), left.stderr
    finally:
        subprocess.run(ray_cli + ["stop", "--force"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=120)


def free_port(low: int, high: int) -> int:
    for port in range(low, high):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {low}..{high}")


def test_a_replica_on_the_gpu_reserves_one_gpu():
    from pathlib import Path

    from minillm.serving.app import Settings
    from minillm.serving.cluster import replica_resources

    assert replica_resources(Settings(Path("m.gguf")), 2) == {"num_cpus": 2}
    assert replica_resources(Settings(Path("m.gguf"), device="cuda"), 2) == {"num_cpus": 2, "num_gpus": 1}


# -- the router alone -------------------------------------------------------------------------
@pytest.mark.parametrize("body, text", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "\x00user\x00hi"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
     "\x00user\x00ab"),
    ({"prompt": "plain"}, "plain"), ({"prompt": [1, 2, 3]}, "1 2 3"), ({"prompt": 5}, ""), (None, ""), ([], "")])
def test_prompt_text(body, text):
    from minillm.serving.prefix_router import prompt_text

    assert prompt_text(body) == text


def test_prefix_blocks_chain_the_text_before_them():
    from minillm.serving.prefix_router import BLOCK, prefix_blocks

    text = "".join(chr(65 + i % 26) for i in range(5 * BLOCK + 10))
    blocks = prefix_blocks(text)
    assert len(blocks) == 5 and prefix_blocks(text[:3 * BLOCK]) == blocks[:3]
    changed = prefix_blocks("x" + text[1:])
    assert all(a != b for a, b in zip(blocks, changed))  # a change in block 0 changes every later hash
    assert prefix_blocks("short") == ()


class FakeReplica:
    def __init__(self, name):
        self.replica_id = name


class FakePending:
    def __init__(self, request_id, text=""):
        from minillm.serving.prefix_router import prefix_blocks

        self.args = (type("Forwarded", (), {"prefix": prefix_blocks(text)})(),)
        self.metadata = type("Metadata", (), {"internal_request_id": request_id})()


def test_the_router_prefers_the_prefix_holder_unless_it_is_too_busy():
    import asyncio

    from minillm.serving.prefix_router import PrefixRouter

    router = object.__new__(PrefixRouter)  # its state alone: no Ray
    router.initialize_state(slack=2)
    a, b = FakeReplica("a"), FakeReplica("b")
    conversation = "You are a helpful assistant who answers briefly. " * 4

    def route(request_id, text="", to=None):
        pending = FakePending(request_id, text)
        ranks = asyncio.run(router.choose_replicas([a, b], pending))
        assert all(len(rank) == 1 for rank in ranks) and {r[0] for r in ranks} == {a, b}
        chosen = to or ranks[0][0]
        router.on_request_routed(pending, chosen.replica_id, None)
        return ranks[0][0]

    first = route("r0", conversation)
    other = b if first is a else a
    assert route("r1", conversation + " A follow-up.") is first  # holds the prefix; 1 busier: within slack
    assert route("r2", "an unrelated prompt " * 5) is other      # no prefix held: the least busy
    assert route("r3", conversation) is first                    # 2 against 1
    router.on_request_completed(other.replica_id, "r2")
    route("r4", conversation, to=first)                          # Ray placed it there: 4 against 0
    assert route("r5", conversation) is other                    # too busy for its prefix: the least busy
    for request in ("r0", "r1", "r3", "r4"):
        router.on_request_completed(first.replica_id, request)
    assert router.in_flight == {first.replica_id: 0, other.replica_id: 1}
    least = {asyncio.run(router.choose_replicas([a, b], None))[0][0] for _ in range(20)}
    assert least == {first} and router.in_flight[other.replica_id] == 1  # None: no request counted
    router.on_request_completed(other.replica_id, "r5")
    assert {asyncio.run(router.choose_replicas([a, b], None))[0][0] for _ in range(40)} == {a, b}  # ties: either
