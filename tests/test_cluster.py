"""`minillm serve --replicas`: replicas on a local Ray Serve (every address 127.0.0.1), driven
by OpenAI's official client as the single server is in test_server.py; the same answers, prefix
routing, a replica killed mid-stream, and a shutdown that leaves nothing running. The prefix
router's choices are also tested alone, without Ray."""
import concurrent.futures
import os
import signal
import time

import openai
import pytest

from conftest import model_path
from test_server import KEY, LiveServer, chat_request, run

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

REPLICAS = ("--replicas", "2", "--threads", "1", "--parallel", "4", "--ctx", "1024", "--api-key", KEY)
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
    health = replicas_live(cluster)
    assert len(health) == 2 and all(r["status"] == "ok" and r["slots"] == 4 for r in health)
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
    # /metrics adds up the replicas' reports: 8 more requests of 5 tokens each are 40 more tokens
    before = cluster.wait_for(lambda m: m["minillm_requests_finished_total"] >= 16, "both replicas' reports")
    assert before["minillm_replicas"] == 2 and before["minillm_requests_rejected_total"] >= 2
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
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        live = replicas_live(cluster)
        if len(live) == 2 and victim not in {r["id"] for r in live} and all(r["status"] == "ok" for r in live):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no replacement replica: {replicas_live(cluster)}")
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


# -- the router alone -------------------------------------------------------------------------
@pytest.mark.parametrize("body, text", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "\x00user\x00hi"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
     "\x00user\x00ab"),
    ({"prompt": "plain"}, "plain"), ({"prompt": [1, 2, 3]}, "1 2 3"), ({"prompt": 5}, ""), (None, ""), ([], "")])
def test_prompt_text(body, text):
    from minillm.serving.prefix_router import prompt_text

    assert prompt_text(body) == text
