"""`minillm serve` as its users' programs see it: live servers on 127.0.0.1 (an ephemeral port),
driven by OpenAI's official client and by raw HTTP; `generate --server` and `chat --server`."""
import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from conftest import model_path

pytestmark = pytest.mark.slow

KEY = "test-key-123"
START_TIMEOUT_S = 600  # a cold machine compiles the kernels first


class LiveServer:
    """`minillm serve MODEL --port 0 ARGS` in a child process; stop() sends SIGTERM."""

    def __init__(self, *args: str, model="smollm2"):
        """model: a real model's name (conftest.model_path), or a file."""
        env = dict(os.environ, MINILLM_API_KEY="")
        path = model if isinstance(model, os.PathLike) else model_path(model)
        self.proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", str(path), "--port", "0",
                                      *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.stderr: list[str] = []
        self.url = self.port = None
        self.health_while_loading = None
        self._lines = threading.Thread(target=self._read_stderr, daemon=True)
        self._ready = threading.Event()
        self._lines.start()
        assert self._ready.wait(START_TIMEOUT_S), "".join(self.stderr)
        assert self.proc.poll() is None, "".join(self.stderr)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            if found and self.port is None:
                self.port = int(found.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
                self.health_while_loading = self.request("GET", "/health")
            if "ready:" in line:
                self._ready.set()
        self._ready.set()

    def request(self, method: str, path: str, body=None, headers=None, timeout: float = 120):
        """(status, headers, parsed JSON or text) of one request on a new connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            raw = response.read().decode("utf-8", "replace")
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw
            return response.status, {k.lower(): v for k, v in response.getheaders()}, payload
        finally:
            conn.close()

    def client(self, key: str = KEY, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, **kwargs)

    def metrics(self) -> dict[str, float]:
        _, _, text = self.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        return {k: float(v) for k, v in re.findall(r"^(minillm_\w+) (\S+)$", text, re.M)}

    def wait_for(self, condition, what: str, timeout: float = 60) -> dict:
        """The metrics once condition(metrics) holds; fails after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if condition(m):
                return m
            assert time.monotonic() < deadline, f"{what}: not within {timeout} s ({m})"
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 60) -> dict:
        return self.wait_for(lambda m: m["minillm_requests_running"] == m["minillm_requests_queued"] == 0,
                             "no request running or queued", timeout)

    def stop(self, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def server():
    live = LiveServer("--parallel", "4", "--ctx", "1024", "--api-key", KEY)
    yield live
    assert live.stop() == 0


def chat_request(i: int) -> dict:
    """Mixed prompts and parameters: greedy and seeded sampling, chat and plain completions."""
    topic = ["the sea", "bread", "the moon", "rain", "chess", "honey bees", "a red bicycle", "volcanoes"][i % 8]
    body = {"model": "any", "max_tokens": 10 + i % 5}
    if i % 2:
        body["messages"] = [{"role": "user", "content": f"Write one sentence about {topic}." + " Be precise." * i}]
    else:
        body["prompt"] = f"A short note about {topic}:"
    body.update({"temperature": 0} if i % 3 == 0 else {"temperature": 0.9, "seed": 100 + i, "extra_body": {"top_k": 30}})
    return body


def run(client, body: dict, stream: bool = False) -> tuple[str, str]:
    """(text, finish_reason) of one request through the openai client."""
    chat = "messages" in body
    call = client.chat.completions.create if chat else client.completions.create
    if not stream:
        answer = call(**body)
        choice = answer.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason
    text, finish = [], None
    for event in call(**body, stream=True):
        for choice in event.choices:
            text.append((choice.delta.content or "") if chat else choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish


def test_health_models_and_loading(server):
    status, headers, body = server.health_while_loading  # asked as soon as the port was printed
    assert (status, body) == (503, {"status": "loading"})
    status, headers, body = server.request("GET", "/health")
    assert (status, body) == (200, {"status": "ok"})
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_chat_and_completions_through_the_openai_client(server):
    client = server.client()
    answer = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=8, temperature=0)
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    u = answer.usage
    assert u.prompt_tokens > 5 and 0 < u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    # streamed: one id, the role first, the finish reason last, then the usage chunk
    events = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hello."}],
                                                 max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len({e.id for e in events}) == 1
    assert events[0].choices[0].delta.role == "assistant"
    assert events[-2].choices[0].finish_reason == answer.choices[0].finish_reason
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == u.completion_tokens
    streamed = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert streamed == answer.choices[0].message.content
    # plain completions, with a stop string and logprobs
    done = client.completions.create(model="x", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, logprobs=2)
    assert done.choices[0].text.startswith(" 5")
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == done.usage.completion_tokens == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert max(lp.top_logprobs[0].values()) == lp.token_logprobs[0]  # greedy: the best one was taken
    stopped = client.completions.create(model="x", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == done.choices[0].text.split(" 7")[0]
    chat_lp = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                             temperature=0, logprobs=True, top_logprobs=3)
    content = chat_lp.choices[0].logprobs.content
    assert len(content) == chat_lp.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == chat_lp.choices[0].message.content


def stop_cases(pieces: list[str]) -> dict[str, list[str]]:
    """Stop strings cut from a greedy answer's token pieces: a whole token, and strings that
    begin inside token k (so that text before them is held back) and end at its end, inside
    it, or two tokens later; one in the first token; several at once."""
    k = next(i for i in range(2, len(pieces) - 2) if len(pieces[i]) >= 3)
    word = pieces[k]
    return {"token": [pieces[k]], "boundary": [word[1:]], "inside": [word[1:-1]],
            "across": [word[1:] + pieces[k + 1] + pieces[k + 2][:1]], "first": [pieces[0][-1]],
            "several": [pieces[k + 1][-1:] + pieces[k + 2], word[1:]]}


def streamed_with_usage(client, body: dict) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of one streamed request with include_usage."""
    chat = "messages" in body
    call = client.chat.completions.create if chat else client.completions.create
    text, finish, usage = [], None, None
    for event in call(**body, stream=True, stream_options={"include_usage": True}):
        for choice in event.choices:
            text.append((choice.delta.content or "") if chat else choice.text)
            finish = choice.finish_reason or finish
        usage = event.usage or usage
    return "".join(text), finish, usage.completion_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_stop_strings_streamed_as_unstreamed(server, chat):
    """A stop string cuts the same text streamed or not, wherever it falls among the tokens."""
    client = server.client()
    body = dict(model="x", max_tokens=24, temperature=0)
    if chat:
        body["messages"] = [{"role": "user", "content": "Write one sentence about the sea."}]
        answer = client.chat.completions.create(**body, logprobs=True)
        pieces = [c.token for c in answer.choices[0].logprobs.content]
        text = answer.choices[0].message.content
    else:
        body["prompt"] = "Count from one to ten in words: one, two,"
        answer = client.completions.create(**body, logprobs=1)
        pieces, text = answer.choices[0].logprobs.tokens, answer.choices[0].text
    assert "".join(pieces) == text and len(pieces) >= 8
    for name, stops in stop_cases(pieces).items():
        expected = text[:min(text.find(s) for s in stops if s in text)]
        stopped = dict(body, stop=stops)
        assert run(client, stopped) == (expected, "stop"), name
        assert run(client, stopped, stream=True) == (expected, "stop"), name
        whole = (client.chat.completions.create if chat else client.completions.create)(**stopped)
        assert streamed_with_usage(client, stopped) == (expected, "stop", whole.usage.completion_tokens), name


def test_seeds_and_refusals(server):
    client = server.client()
    body = dict(model="x", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7)
    first, again = client.completions.create(**body), client.completions.create(**body)
    assert first.choices[0].text == again.choices[0].text
    assert any(client.completions.create(**dict(body, seed=s)).choices[0].text != first.choices[0].text
               for s in (8, 9, 10))
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.completions.create(model="x", prompt="Hi", max_tokens=2, n=2)
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").completions.create(model="x", prompt="Hi", max_tokens=2)
    status, _, body = server.request("POST", "/v1/completions", {"prompt": "Hi"})  # no key at all
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert server.request("GET", "/health")[0] == 200  # /health needs no key


def test_batch_invariance_over_http(server):
    """16 clients at once: each answer is the one it gets alone, streamed or not; a repeat (its
    prompt's cells cached in a slot) too."""
    client = server.client()
    bodies = [chat_request(i) for i in range(16)]
    alone = [run(client, b) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda ib: run(client, ib[1], stream=ib[0] % 2 == 0), enumerate(bodies)))
    assert together == alone
    assert run(client, bodies[3]) == alone[3]
    assert server.wait_idle()["minillm_requests_running"] == 0


def test_bad_input_gets_its_status_and_the_server_goes_on(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [
        (b'{"prompt": "hi", ', 400, "malformed JSON"),
        (b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({"prompt": "hi", "max_tokens": -1}, 400, "'max_tokens' must be an integer >= 0"),
        ({"prompt": "hi", "max_tokens": 10 ** 9}, 400, "more than the context of 1024"),
        ({"prompt": "word " * 1500}, 400, "more than the context of 1024 allows"),
        ({"prompt": ["two", "prompts"]}, 400, "one prompt per request"),
        ({"prompt": "hi", "n": 3}, 400, "'n' must be 1"),
        ([1, 2], 400, "must be a JSON object"),
        (b"x" * (10 << 20), 413, "more than the"),
    ]
    for body, status, message in cases:
        got, _, answer = server.request("POST", "/v1/completions", body, auth)
        assert got == status and message in answer["error"]["message"], (str(body)[:60], got, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    got, _, answer = server.request("POST", "/v1/chat/completions", image, auth)
    assert got == 400 and "only text parts" in answer["error"]["message"]
    got, _, answer = server.request("POST", "/v1/chat/completions", {"messages": "hello"}, auth)
    assert got == 400 and "'messages' must be a non-empty list" in answer["error"]["message"]
    got, _, answer = server.request("GET", "/v1/nothing-here", None, auth)
    assert got == 404 and answer["error"]["type"] == "not_found_error"
    got, _, answer = server.request("GET", "/v1/completions", None, auth)
    assert got == 405
    m = server.wait_idle()
    assert m["minillm_requests_rejected_total"] >= len(cases) + 4
    assert run(server.client(), chat_request(0))[0]  # still serving


def test_tokenize_and_detokenize(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, body = server.request("POST", "/tokenize", {"content": "Hello world"}, auth)
    assert status == 200 and len(body["tokens"]) == 2
    status, _, back = server.request("POST", "/detokenize", {"tokens": body["tokens"]}, auth)
    assert status == 200 and back["content"] == "Hello world"
    status, _, pieces = server.request("POST", "/tokenize", {"content": "Hello world", "with_pieces": True}, auth)
    assert [p["piece"] for p in pieces["tokens"]] == ["Hello", " world"]
    status, _, error = server.request("POST", "/detokenize", {"tokens": [10 ** 9]}, auth)
    assert status == 400 and "outside the vocabulary" in error["error"]["message"]


def test_generate_and_chat_through_the_server(server):
    env = dict(os.environ, MINILLM_API_KEY=KEY)
    cmd = [sys.executable, "-m", "minillm", "generate", "--server", server.url, "-p", "1, 2, 3, 4,", "-n", "8",
           "--temp", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    direct = server.client().completions.create(model="x", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    assert out.returncode == 0 and out.stdout == direct.choices[0].text + "\n", out.stderr
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, timeout=120)
    record = json.loads(out.stdout)
    assert record["text"] == direct.choices[0].text and len(record["tokens"]) == record["generated_tokens"] == 8
    out = subprocess.run([sys.executable, "-m", "minillm", "chat", "--server", server.url, "--temp", "0", "-n", "8"],
                         input="Say hello.", capture_output=True, text=True, env=env, timeout=120)
    direct = server.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    assert out.returncode == 0 and out.stdout == direct.choices[0].message.content + "\n", out.stderr
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, MINILLM_API_KEY="nope"), timeout=120)
    assert out.returncode == 1 and "the server answered 401" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(cmd[:4] + [str(model_path("smollm2"))] + cmd[4:], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "not both" in out.stderr


@pytest.fixture(scope="module")
def narrow():
    """One slot, one place in the queue: for the queue-full and disconnect tests."""
    live = LiveServer("--parallel", "1", "--max-queue", "1")
    yield live
    assert live.stop() == 0


def test_full_queue_and_a_client_that_leaves(narrow):
    # A occupies the one slot (streaming), B waits in the queue, so C finds it full
    conn = http.client.HTTPConnection("127.0.0.1", narrow.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 1000,
                                                        "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    streaming = conn.getresponse()
    assert streaming.status == 200 and streaming.readline().startswith(b"data: ")
    client = narrow.client(key="none", max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        queued = pool.submit(client.completions.create, model="x", prompt="Hello", max_tokens=4, temperature=0)
        narrow.wait_for(lambda m: m["minillm_requests_queued"] >= 1, "B queued")
        status, headers, body = narrow.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 503 and headers["retry-after"] == "1" and "queue is full" in body["error"]["message"]
        # the official client retries a 503 after Retry-After; once it has met the full queue, A's client leaves
        rejected = narrow.metrics()["minillm_requests_rejected_total"]
        retried = pool.submit(narrow.client(key="none", max_retries=5).completions.create, model="x", prompt="Hi",
                              max_tokens=2, temperature=0)
        narrow.wait_for(lambda m: m["minillm_requests_rejected_total"] > rejected, "the retried request refused once")
        conn.close()
        assert queued.result(timeout=60).choices[0].text
        assert retried.result(timeout=60).usage.completion_tokens == 2
    m = narrow.wait_idle()
    assert m["minillm_requests_cancelled_total"] >= 1 and m["minillm_requests_running"] == 0
    assert m["minillm_generated_tokens_total"] < 1000  # A stopped when its client left


def test_a_bad_model_or_a_busy_port_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(20))
    serve = [sys.executable, "-m", "minillm", "serve", "--port", "0"]
    out = subprocess.run(serve + [str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "unsupported GGUF version 0" in out.stderr and "Traceback" not in out.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(serve[:-1] + [str(port), str(model_path("smollm2"))], capture_output=True, text=True,
                             timeout=120)
    assert out.returncode == 1 and f"error: cannot listen on 127.0.0.1:{port}" in out.stderr


def test_sigterm_ends_streams_and_exits_cleanly():
    live = LiveServer("--parallel", "2")
    client = live.client(key="none", max_retries=0)
    finishes = []

    def stream():
        for event in client.completions.create(model="x", prompt="Once upon a time", max_tokens=2000, stream=True,
                                               extra_body={"ignore_eos": True}):
            if event.choices[0].finish_reason:
                finishes.append(event.choices[0].finish_reason)

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    live.wait_for(lambda m: m["minillm_generated_tokens_total"] >= 6, "the streams under way")
    t0 = time.monotonic()
    assert live.stop(timeout=10) == 0
    assert time.monotonic() - t0 < 5
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert finishes == ["abort"] * 3
    assert "stopped" in "".join(live.stderr)


def test_a_draft_model_serves_requests_by_default(tmp_path):
    """serve --draft: requests use the draft unless they say "draft": false (or ask for lookup),
    report the guesses in llama-server's timings, and answer as without it (greedy). A draft
    of another vocabulary stops the command with one message."""
    live = LiveServer("--parallel", "2", "--ctx", "512", "--draft", str(model_path("smollm2")), "--draft-max", "4")
    try:
        assert any("draft SmolLM2" in line for line in live.stderr)
        body = {"messages": [{"role": "user", "content": "List the days of the week."}], "max_tokens": 24,
                "temperature": 0}
        answers = [live.request("POST", "/v1/chat/completions", dict(body, **extra))
                   for extra in ({}, {"draft": False}, {"lookup": True})]
        assert all(status == 200 for status, _, _ in answers)
        texts = [a["choices"][0]["message"]["content"] for _, _, a in answers]
        assert texts[0] == texts[1] == texts[2] and texts[0]
        assert "draft_n" in answers[0][2]["timings"] and "draft_n" not in answers[1][2]["timings"]
        assert "draft_n_accepted" in answers[2][2]["timings"]
        status, _, error = live.request("POST", "/v1/chat/completions", dict(body, draft="yes"))
        assert status == 400 and "'draft' must be true or false" in error["error"]["message"]
    finally:
        assert live.stop() == 0
    out = subprocess.run([sys.executable, "-m", "minillm", "serve", str(model_path("smollm2")), "--port", "0",
                          "--draft", str(model_path("gemma3"))], capture_output=True, text=True, timeout=600)
    assert out.returncode == 1 and "vocabulary" in out.stderr and "Traceback" not in out.stderr
