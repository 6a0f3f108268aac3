"""The OpenAI-compatible server over real HTTP on 127.0.0.1, with the official ``openai`` client as the
client: responses equal ``SpeculativeGenerator.generate`` of the same request alone (greedy, float32; the
same seed when sampling), concurrent clients are batched into shared rounds, bad requests get OpenAI error
bodies, a full queue a 429, a client that leaves frees its row, SIGTERM drains. Tiny random models on the
CPU; raw HTTP through the standard library; every loop is bounded in count and time."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.config import FuzzyConfig  # noqa: E402
from fsd_eagle.server.app import build_app  # noqa: E402
from fsd_eagle.server.serving import Settings  # noqa: E402

from test_api import TREE, make_llama, make_tokenizer, noisy_copy, save_target_and_head  # noqa: E402

MODEL = "tiny"
CONTEXT = 400
WAIT_S = 60  # the longest any single wait of these tests may take


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A server of ``gen`` on a free port in a thread of this process (uvicorn), with an openai client."""

    def __init__(self, gen, **kwargs) -> None:
        import uvicorn

        self.port = free_port()
        self.app = build_app(gen, Settings(MODEL, CONTEXT), **kwargs)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=WAIT_S)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
        """(status, JSON body, headers) of a raw POST; ``body`` bytes are sent as they are."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})

    def request(self, method: str, path: str, data: bytes | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT_S)
        try:
            conn.request(method, path, body=data, headers=headers or {})
            resp = conn.getresponse()
            raw = resp.read()
            ctype = resp.getheader("content-type", "")
            payload = json.loads(raw) if "json" in ctype else raw.decode()
            return resp.status, payload, dict(resp.getheaders())
        finally:
            conn.close()

    def metric(self, name: str, labels: dict | None = None) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        _, text, _ = self.request("GET", "/metrics")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and (labels is None or sample.labels == labels):
                    return sample.value
        return 0.0


def generator(model, tokenizer, draft) -> SpeculativeGenerator:
    return SpeculativeGenerator(model, tokenizer, draft_model=draft, tree=TREE)


@pytest.fixture(scope="module")
def parts():
    model = make_llama(seed=0)
    return model, make_tokenizer(), noisy_copy(model)


@pytest.fixture(scope="module")
def ref(parts):
    """A generator of the same model and drafter as the server's, for the single-request references."""
    return generator(*parts)


@pytest.fixture(scope="module")
def served(parts):
    s = Served(generator(*parts), max_batch=8, max_queue=64)
    yield s
    s.close()


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


PROMPTS = [" ".join(f"w{3 + (7 * i + 5 * j) % 120}" for j in range(2 + i % 9)) for i in range(16)]


# ---------------------------------------------------------------------------------- equal to generate()


def test_chat_and_completions_equal_generate(served, ref):
    c = served.client
    expect = ref.generate(chat(PROMPTS[0]), 24)
    got = c.chat.completions.create(model=MODEL, messages=chat(PROMPTS[0]), temperature=0, max_tokens=24)
    assert got.choices[0].message.content == expect.text and got.choices[0].finish_reason == "length"
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-") and got.model == MODEL
    assert got.usage.completion_tokens == 24 and got.usage.prompt_tokens == len(ref.encode(chat(PROMPTS[0])))
    spec = got.usage.model_extra["speculation"]
    assert spec["target_forwards"] == expect.stats.target_forwards and spec["tau"] == pytest.approx(expect.stats.tau,
                                                                                                    abs=1e-3)
    raw = ref.generate(PROMPTS[1], 20, chat=False)
    done = c.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=20)
    assert done.choices[0].text == raw.text and done.object == "text_completion"
    ids = ref.encode(PROMPTS[2], chat=False)
    by_ids = c.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=20)
    assert by_ids.choices[0].text == ref.generate(ids, 20).text


def test_text_content_parts_join_into_one_message(served, ref):
    """A message's content as OpenAI content parts: its text parts join with newlines, as one string would."""
    parts = [{"type": "text", "text": PROMPTS[4]}, {"type": "text", "text": PROMPTS[5]}]
    got = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                                temperature=0, max_tokens=16)
    assert got.choices[0].message.content == ref.generate(chat(f"{PROMPTS[4]}\n{PROMPTS[5]}"), 16).text
    assert got.usage.prompt_tokens == len(ref.encode(chat(f"{PROMPTS[4]}\n{PROMPTS[5]}")))


def test_the_chat_template_gets_each_message_as_one_string_with_its_role_and_name():
    from fsd_eagle.server.protocol import ChatCompletionRequest
    from fsd_eagle.server.serving_chat import template_messages

    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi", "name": "ann"}]})
    assert template_messages(req) == [{"role": "system", "content": "be\nbrief"},
                                      {"role": "user", "content": "hi", "name": "ann"}]


def test_streams_add_up_to_the_text_and_end_with_done(served, ref):
    expect = ref.generate(chat(PROMPTS[3]), 30)
    pieces, finish, usage = [], None, None
    stream = served.client.chat.completions.create(model=MODEL, messages=chat(PROMPTS[3]), temperature=0,
                                                   max_tokens=30, stream=True,
                                                   stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == expect.text and finish == "length" and usage.completion_tokens == 30
    assert len([p for p in pieces if p]) > 1  # it streamed, not one piece at the end
    text = "".join(ch.choices[0].text for ch in served.client.completions.create(
        model=MODEL, prompt=PROMPTS[4], temperature=0, max_tokens=16, stream=True) if ch.choices)
    assert text == ref.generate(PROMPTS[4], 16, chat=False).text
    status, body, headers = served.post("/v1/completions", {"prompt": PROMPTS[4], "temperature": 0, "max_tokens": 4,
                                                            "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body.rstrip().endswith("data: [DONE]")


def test_stop_strings_and_eos_end_a_choice_with_stop(served, ref):
    expect = ref.generate(chat(PROMPTS[5]), 30)
    words = expect.text.split()
    stop = words[len(words) // 2]
    want = ref.generate(chat(PROMPTS[5]), 30, stop=[stop])
    got = served.client.chat.completions.create(model=MODEL, messages=chat(PROMPTS[5]), temperature=0, max_tokens=30,
                                                stop=stop)
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_clients_each_get_their_own_output_in_shared_rounds(served, ref):
    """16 clients at once, prompts and budgets of their own: each gets exactly what its request gives alone,
    and they decode as rows of shared rounds (fewer rounds than the requests' target forwards added up, more
    than one row at a time), which serving one request at a time would not give."""
    budgets = [12 + 3 * (i % 5) for i in range(16)]
    expect = [ref.generate(chat(p), n) for p, n in zip(PROMPTS, budgets)]
    rounds_before = served.metric("fsd_eagle_rounds_total")
    start = threading.Barrier(16)

    def one(i: int) -> str:
        start.wait(WAIT_S)
        got = served.client.chat.completions.create(model=MODEL, messages=chat(PROMPTS[i]), temperature=0,
                                                    max_tokens=budgets[i])
        return got.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(16), timeout=WAIT_S * 2))
    assert texts == [e.text for e in expect]
    rounds = served.metric("fsd_eagle_rounds_total") - rounds_before
    forwards = sum(e.stats.target_forwards for e in expect)
    assert served.metric("fsd_eagle_peak_running_rows") > 1
    assert rounds < 0.7 * forwards, (rounds, forwards)


def test_seeds_reproduce_and_n_choices_take_consecutive_seeds(served, ref):
    messages = chat(PROMPTS[6])
    a, b = (served.client.chat.completions.create(model=MODEL, messages=messages, temperature=0.9, max_tokens=20,
                                                  seed=11) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content == ref.generate(messages, 20, temperature=0.9, seed=11).text
    many = served.client.chat.completions.create(model=MODEL, messages=messages, temperature=0.9, max_tokens=20,
                                                 seed=11, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [ref.generate(messages, 20, temperature=0.9, seed=11 + k).text
                                                         for k in range(3)]
    assert many.usage.completion_tokens == 60


def test_rule_forms_are_served_together_each_as_alone(served, ref):
    """Greedy, sampling, fuzzy and plain requests at once: each form has its own rows, all decode
    concurrently, and each request equals its call alone; fuzzy tokens are reported in usage."""
    fsd = {"threshold": 1.0, "divergence": "kl"}
    cases = [dict(temperature=0), dict(temperature=0.8, seed=3), dict(temperature=0, extra_body={"fsd": fsd}),
             dict(temperature=0, extra_body={"speculative": False})] * 2
    expect = [ref.generate(chat(PROMPTS[i]), 20, temperature=k["temperature"], seed=k.get("seed"),
                           fuzzy=FuzzyConfig(threshold=1.0) if "fsd" in k.get("extra_body", {}) else None,
                           autoregressive="speculative" in k.get("extra_body", {}))
              for i, k in enumerate(cases)]

    def one(i: int):
        return served.client.chat.completions.create(model=MODEL, messages=chat(PROMPTS[i]), max_tokens=20,
                                                     **cases[i])

    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(one, range(len(cases)), timeout=WAIT_S * 2))
    assert [g.choices[0].message.content for g in got] == [e.text for e in expect]
    for g, e in zip(got, expect):
        assert g.usage.model_extra["speculation"]["fuzzy_accepted"] == e.stats.fuzzy_accepted
    assert got[3].usage.model_extra["speculation"]["tau"] == 1.0  # speculative: false decodes plainly


# ---------------------------------------------------------------------------------- bad requests


OK_CHAT = {"model": MODEL, "messages": chat(PROMPTS[0]), "max_tokens": 4, "temperature": 0}  # no EOS for 380 tokens
BAD = [  # (endpoint, body, status, param)
    ("chat", {**OK_CHAT, "messages": []}, 400, "messages"),
    ("chat", {k: v for k, v in OK_CHAT.items() if k != "messages"}, 400, "messages"),
    ("chat", {**OK_CHAT, "messages": [{"role": "robot", "content": "w5"}]}, 400, "messages.0.role"),
    ("chat", {**OK_CHAT, "messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("chat", {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content"),
    ("chat", {**OK_CHAT, "messages": [{"role": "user", "content": []}]}, 400, "messages.0.content"),
    ("chat", {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages.0.content"),
    ("chat", {**OK_CHAT, "colour": "blue"}, 400, "colour"),
    ("chat", {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("chat", {**OK_CHAT, "temperature": 2.5}, 400, "temperature"),
    ("chat", {**OK_CHAT, "top_p": 0}, 400, "top_p"),
    ("chat", {**OK_CHAT, "top_k": -1}, 400, "top_k"),
    ("chat", {**OK_CHAT, "top_k": 2**70}, 400, "top_k"),
    ("chat", {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {**OK_CHAT, "max_tokens": "many"}, 400, "max_tokens"),
    ("chat", {**OK_CHAT, "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("chat", {**OK_CHAT, "max_completion_tokens": 10**6}, 400, "max_tokens"),
    ("chat", {**OK_CHAT, "n": 0}, 400, "n"),
    ("chat", {**OK_CHAT, "n": 1000}, 400, "n"),
    ("chat", {**OK_CHAT, "seed": 2**70}, 400, "seed"),
    ("chat", {**OK_CHAT, "seed": 1.5}, 400, "seed"),
    ("chat", {**OK_CHAT, "stop": 5}, 400, "stop"),
    ("chat", {**OK_CHAT, "stop": ["x"] * 100}, 400, "stop"),
    ("chat", {**OK_CHAT, "stream": "yes"}, 400, "stream"),
    ("chat", {**OK_CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {**OK_CHAT, "logprobs": True}, 400, "logprobs"),
    ("chat", {**OK_CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat", {**OK_CHAT, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("chat", {**OK_CHAT, "fsd": {"threshold": -1}}, 400, "fsd.threshold"),
    ("chat", {**OK_CHAT, "fsd": {"threshold": 1, "divergence": "nope"}}, 400, "fsd"),
    ("chat", {**OK_CHAT, "fsd": {"threshold": 1, "mode": "nope"}}, 400, "fsd"),
    ("chat", {**OK_CHAT, "fsd": {"cut": 1}}, 400, "fsd.cut"),
    ("chat", {**OK_CHAT, "speculative": "no"}, 400, "speculative"),
    ("chat", {**OK_CHAT, "messages": chat("w5 " * (CONTEXT + 10))}, 400, "max_tokens"),
    ("chat", {**OK_CHAT, "model": "gpt-9"}, 404, "model"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "w5", "echo": True}, 400, "echo"),
    ("completions", {"model": MODEL, "prompt": "w5", "best_of": 3}, 400, "best_of"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_a_bad_request_gets_an_openai_error_body(served, endpoint, body, status, param):
    got, payload, _ = served.post(f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", body)
    assert got == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_a_400(served, raw):
    status, payload, _ = served.post("/v1/chat/completions", raw)
    assert status == 400 and payload["error"]["type"] == "invalid_request_error"


def test_the_openai_client_raises_its_bad_request_error(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert info.value.status_code == 400 and info.value.body["param"] == "messages"


def test_models_health_metrics_and_unknown_routes(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, body, _ = served.request("GET", "/health")
    assert status == 200 and body == {"status": "ok"}
    status, body, _ = served.request("GET", "/v1/nothing")
    assert status == 404 and body["error"]["message"]
    from prometheus_client.parser import text_string_to_metric_families

    _, text, _ = served.request("GET", "/metrics")
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"fsd_eagle_requests", "fsd_eagle_prompt_tokens", "fsd_eagle_generation_tokens", "fsd_eagle_request_tau",
            "fsd_eagle_fuzzy_accepted_tokens", "fsd_eagle_queue_depth", "fsd_eagle_running_rows",
            "fsd_eagle_time_to_first_token_seconds", "fsd_eagle_inter_token_latency_seconds"} <= names
    assert served.metric("fsd_eagle_time_to_first_token_seconds_count") > 0
    status, body, _ = served.request("GET", "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in body["paths"]


# ---------------------------------------------------------------------------------- load and faults


def read_events(resp, count: int) -> list[str]:
    """The first ``count`` server-sent events of a streaming response."""
    events = []
    while len(events) < count:
        line = resp.readline()
        assert line, "the stream ended early"
        if line.strip():
            events.append(line.decode().strip())
    return events


def open_stream(port: int, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def counted(session):
    """Count the rounds ``session`` launches (its ``launch`` wrapped on the instance); returns the counter."""
    launches = [0]
    launch = session.launch

    def counting():
        launches[0] += 1
        return launch()

    session.launch = counting
    return launches


def test_compiled_sessions_take_over_new_requests_while_running_ones_finish_as_they_began(parts, ref):
    """With ``compile``, requests decode on graph sessions until the configuration's compile cache is warm
    and the engine has made its compiled session; later requests decode on it, each equal to generate's.
    On the CPU nothing compiles: the cache is "warmed" by a function held back by a gate (so that the first
    requests surely decode before), and the compiled session is a second session of the same plan."""
    from fsd_eagle.session import Session

    gen = generator(*parts)
    graph_session = gen.session_for(gen.prepare(PROMPTS[0], 8, temperature=0, chat=False), 1)
    graph_rounds = counted(graph_session)
    gate, made, engine_thread = threading.Event(), [], []

    def make(call, rows):
        engine_thread.append(threading.current_thread().name)
        session = Session(gen.engine, gen.session_for(call, rows).plan)
        made.append((session, counted(session)))
        return session

    s = Served(gen, max_batch=8, max_queue=16, compile=True, warm_cache=lambda call, rows: gate.wait(WAIT_S),
               make_compiled=make)
    try:
        first = s.client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=30)
        assert first.choices[0].text == ref.generate(PROMPTS[1], 30, chat=False).text
        assert graph_rounds[0] > 0 and not made and s.metric("fsd_eagle_compiled_sessions") == 0
        stream = s.client.completions.create(model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=300,
                                             stream=True)
        pieces = [next(iter(stream)).choices[0].text]  # running on the graph session when the gate opens
        gate.set()
        deadline = time.monotonic() + WAIT_S
        while s.metric("fsd_eagle_compiled_sessions") < 1:
            assert time.monotonic() < deadline, "the compiled session was not handed over"
            time.sleep(0.02)
        (compiled, compiled_rounds), = made
        assert compiled.batch == 1 and engine_thread == ["fsd-eagle-engine"]  # made between the engine's rounds
        before_graph, before_compiled = graph_rounds[0], compiled_rounds[0]
        later = s.client.completions.create(model=MODEL, prompt=PROMPTS[3], temperature=0, max_tokens=30)
        assert later.choices[0].text == ref.generate(PROMPTS[3], 30, chat=False).text
        assert compiled_rounds[0] > before_compiled
        pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert "".join(pieces) == ref.generate(PROMPTS[2], 300, chat=False).text
        again = s.client.completions.create(model=MODEL, prompt=PROMPTS[4], temperature=0, max_tokens=20)
        assert again.choices[0].text == ref.generate(PROMPTS[4], 20, chat=False).text
        after = graph_rounds[0]
        s.client.completions.create(model=MODEL, prompt=PROMPTS[5], temperature=0, max_tokens=20)
        assert graph_rounds[0] == after >= before_graph  # the graph session took nothing new
        assert s.metric("fsd_eagle_compile_seconds_total") > 0
    finally:
        gate.set()
        s.close()


def test_a_client_that_leaves_mid_stream_frees_its_row(parts, ref):
    s = Served(generator(*parts), max_batch=1, max_queue=8)
    try:
        conn, resp = open_stream(s.port, {**OK_CHAT, "max_tokens": CONTEXT - 10})
        read_events(resp, 3)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        wait_for(lambda: s.metric("fsd_eagle_requests_total", {"status": "cancelled"}) == 1, "no cancellation")
        wait_for(lambda: s.metric("fsd_eagle_running_rows") == 0, "the row was not freed")
        got = s.client.chat.completions.create(model=MODEL, messages=chat(PROMPTS[7]), temperature=0, max_tokens=12)
        assert got.choices[0].message.content == ref.generate(chat(PROMPTS[7]), 12).text
    finally:
        s.close()


def test_a_full_queue_answers_429_with_retry_after(parts):
    s = Served(generator(*parts), max_batch=1, max_queue=1)
    try:
        conn, resp = open_stream(s.port, {**OK_CHAT, "max_tokens": CONTEXT - 10})  # holds the only row
        read_events(resp, 2)
        waiting = threading.Thread(target=s.post, args=("/v1/chat/completions", {**OK_CHAT, "max_tokens": 2}))
        waiting.start()
        wait_for(lambda: s.metric("fsd_eagle_queue_depth") == 1, "the second request did not queue")
        status, body, headers = s.post("/v1/chat/completions", OK_CHAT)
        assert status == 429 and headers["retry-after"] == "1" and body["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            s.client.chat.completions.create(**OK_CHAT)
        conn.close()
        waiting.join(WAIT_S)
        assert not waiting.is_alive()
    finally:
        s.close()


def test_a_fault_inside_decoding_fails_that_request_alone(parts, ref, monkeypatch):
    """A round of the sampling session raises: that request gets a 500 of one line, a greedy request beside
    it is answered, and the next sampling request is served again."""
    from fsd_eagle.session import Session

    s = Served(generator(*parts), max_batch=4, max_queue=8)
    launch, failures = Session.launch, []

    def faulty(self):
        if not self.form.greedy and not failures:
            failures.append(1)
            raise RuntimeError("a fault for the test\nsecond line")
        return launch(self)

    monkeypatch.setattr(Session, "launch", faulty)
    try:
        with pytest.raises(openai.InternalServerError) as info:
            s.client.chat.completions.create(model=MODEL, messages=chat(PROMPTS[8]), temperature=0.7, max_tokens=8,
                                             seed=1)
        assert "a fault for the test second line" in info.value.body["message"]
        greedy = s.client.chat.completions.create(model=MODEL, messages=chat(PROMPTS[9]), temperature=0, max_tokens=8)
        assert greedy.choices[0].message.content == ref.generate(chat(PROMPTS[9]), 8).text
        again = s.client.chat.completions.create(model=MODEL, messages=chat(PROMPTS[8]), temperature=0.7,
                                                 max_tokens=8, seed=1)
        assert again.choices[0].message.content == ref.generate(chat(PROMPTS[8]), 8, temperature=0.7, seed=1).text
    finally:
        s.close()


def test_an_api_key_is_required_when_set(parts):
    s = Served(generator(*parts), api_key="s3cret")
    try:
        status, body, _ = s.post("/v1/chat/completions", OK_CHAT)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            s.client.chat.completions.create(**OK_CHAT)
        keyed = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="s3cret", max_retries=0)
        assert keyed.chat.completions.create(**OK_CHAT).choices[0].finish_reason == "length"
        assert s.request("GET", "/health")[0] == 200  # health and metrics stay open
    finally:
        s.close()


# ---------------------------------------------------------------------------------- the command


def test_serve_command_answers_then_drains_on_sigterm_and_exits_0(tmp_path, ref):
    """``fsd-eagle serve`` on a saved tiny target and head: /health answers once loaded; SIGTERM during a
    stream lets it finish (every token and [DONE]), refuses new connections, and the process exits 0."""
    root = save_target_and_head(tmp_path, head_seed=1)
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fsd_eagle.cli", "serve", "--target", str(root / "target"),
                             "--head", str(root / "head"), "--device", "cpu", "--port", str(port),
                             "--served-model-name", MODEL, "--drain-timeout", "30"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + WAIT_S * 2
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no answer from /health"
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        conn, resp = open_stream(port, {**OK_CHAT, "max_tokens": 150})
        first = read_events(resp, 2)
        proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        chunks = [json.loads(e[len("data: "):]) for e in first + rest.split("\n\n") if e.strip().startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert len(text.split()) == 150
        assert proc.wait(WAIT_S) == 0
        assert "serving tiny on http://127.0.0.1" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_bad_options_in_one_line(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases = ((["--port", str(taken.getsockname()[1])], "cannot listen on"), (["--port", "70000"], "--port must be"),
             (["--max-batch", "0"], "--max-batch must"), (["--max-queue", "0"], "--max-queue must"),
             (["--api-key", " "], "--api-key is empty"), (["--max-model-len", "1"], "--max-model-len must"))
    procs = []
    try:  # the commands side by side: each spends its seconds importing
        for args, _ in cases:
            procs.append(subprocess.Popen([sys.executable, "-m", "fsd_eagle.cli", "serve", "--device", "cpu", *args],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for (args, words), proc in zip(cases, procs):
            _, err = proc.communicate(timeout=WAIT_S)
            assert proc.returncode == 2 and words in err, (args, err)
            assert err.count("\n") == 1 and "Traceback" not in err
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        taken.close()


def test_the_serving_benchmark_measures_both_variants_and_writes_its_file(tmp_path):
    """``python -m eval serve`` on a saved tiny target: every level of both variants measured without errors,
    the file rewritten with its header, and speculation's ratios against the plain server."""
    root = save_target_and_head(tmp_path, head_seed=1)
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, "-m", "eval", "serve", "--concurrency", "1,2", "--rate", "8", "--requests",
                           "4", "--max-tokens", "8", "--max-model-len", "256", "--mixed-fsd", "2", "--startup", "2",
                           "--startup-tokens", "4", "--serve-args",
                           f"--target {root / 'target'} --head {root / 'head'} --device cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=WAIT_S * 4,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {"date", "code", "command", "device", "versions", "start_s", "rows", "ratios", "startup"} <= set(result)
    for attempt in ("first", "restart"):  # off a GPU rounds run eagerly: the first wave is the level's answer
        entry = result["startup"][attempt]
        assert 0 < entry["health_s"] <= entry["first_answer_s"]
        level = entry["levels"]["2"]
        assert level["waves_before"] == 0 and level["first_wave"]["modes"] == {"eager": 2}
        assert level["compiled_at_s"] >= entry["first_answer_s"] and level["compiled_tokens_per_s"] > 0
    rows = {(r["server"], r["load"], r.get("concurrency", r.get("rate"))): r for r in result["rows"]}
    assert set(rows) == {(s, load, level) for s in ("speculative", "plain")
                         for load, level in (("closed", 1), ("closed", 2), ("poisson", 8.0))}
    for r in rows.values():
        assert r["errors"] == 0 and r["completion_tokens"] == 8 * r["requests"] and r["output_tokens_per_s"] > 0
        assert r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["tpot_ms_p50"] > 0
    assert rows[("plain", "closed", 1)]["tau_mean"] == 1.0
    assert [e["level"] for e in result["ratios"]] == [1, 2, 8.0] and all(e["vs_plain_tokens_per_s"] > 0
                                                                        for e in result["ratios"])
    mixed = result["mixed_fsd"]  # half the requests fuzzy, half exact, in one server at once
    assert mixed["concurrency"] == 2 and set(mixed["groups"]) == {"exact", "fsd"}
    assert all(g["errors"] == 0 and g["requests"] == 2 and g["tau_mean"] >= 1 for g in mixed["groups"].values())


def test_a_restarted_server_makes_the_configurations_it_recorded_from_saved_functions_before_it_answers(
        parts, ref, tmp_path, monkeypatch):
    """A configuration taken over is recorded (with no user text); the next server on that folder makes it on
    its engine thread under ``loads_only`` before ``/health`` says ready, without the compiling process, and
    its first request decodes on the compiled session, equal to generate's. On the CPU the "compiled" session
    is a second session of the same plan; ``loads_only`` is seen through ``precompiled.refuse``, which raises
    exactly under it (as a compiled function with nothing saved does). The first server starts its compiling
    process before it answers (nothing is recorded); the restart does not start one at all."""
    from fsd_eagle import precompiled
    from fsd_eagle.server import records
    from fsd_eagle.server.compiler import Compiler
    from fsd_eagle.session import Session

    gen = generator(*parts)
    made, warmed, starts = [], [], []
    start = Compiler.start
    monkeypatch.setattr(Compiler, "start", lambda self: (starts.append(self), start(self))[1])

    def make(call, rows, saved=True):
        try:
            precompiled.refuse("run_round", "nothing saved fits")
            loads_only = False
        except precompiled.NotSaved:
            if not saved:
                raise
            loads_only = True
        session = Session(gen.engine, gen.session_for(call, rows).plan)
        made.append((threading.current_thread().name, loads_only, counted(session)))
        return session

    def warm_cache(call, rows):
        warmed.append(rows)

    def compiled_sessions(s) -> float:
        return s.metric("fsd_eagle_compiled_sessions")

    first = Served(gen, compile=True, warm_cache=warm_cache, make_compiled=make, records=tmp_path)
    try:
        assert compiled_sessions(first) == 0 and not list(tmp_path.iterdir()) and len(starts) == 1
        secret = "a user's secret prompt"
        first.client.completions.create(model=MODEL, prompt=secret, temperature=0, max_tokens=8, stop=["zzz"])
        wait_for(lambda: compiled_sessions(first) == 1, "the compiled session was not handed over")
        assert warmed == [1] and made[0][:2] == ("fsd-eagle-engine", False)
    finally:
        first.close()
    (path,), = [list(tmp_path.glob("*.json"))]
    entry, = records.recorded(tmp_path)
    assert entry.rows == 1 and entry.call.prompt_ids.tolist() == [0] * records.NEUTRAL_PROMPT_TOKENS
    assert entry.call.stop == () and "secret" not in path.read_text()

    made.clear()
    again = Served(gen, compile=True, warm_cache=warm_cache, make_compiled=make, records=tmp_path)
    try:
        assert compiled_sessions(again) == 1  # made before the server answered
        (thread, loads_only, rounds), = made
        assert thread == "fsd-eagle-engine" and loads_only and rounds[0] == 0
        out = again.client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=30)
        assert out.choices[0].text == ref.generate(PROMPTS[1], 30, chat=False).text
        assert rounds[0] > 0 and warmed == [1]  # on the compiled session; the compiling process not asked
        assert len(starts) == 1  # nor started
    finally:
        again.close()

    made.clear()  # functions not all saved: the compiling process gets the configuration at once
    unsaved = Served(gen, compile=True, warm_cache=warm_cache, make_compiled=lambda c, r: make(c, r, saved=False),
                     records=tmp_path)
    try:
        wait_for(lambda: compiled_sessions(unsaved) == 1, "the compiling process was not asked")
        assert warmed == [1, 1] and [m[:2] for m in made] == [("fsd-eagle-engine", False)]
        out = unsaved.client.completions.create(model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=8)
        assert out.choices[0].text == ref.generate(PROMPTS[2], 8, chat=False).text
    finally:
        unsaved.close()


def test_recorded_configurations_beyond_the_start_up_time_are_made_when_their_lane_opens(parts, ref, tmp_path,
                                                                                        monkeypatch):
    """With no time left before ready (``PREBUILD_SECONDS`` 0), a recorded configuration waits: the first request
    of its form decodes on graph rounds, and the engine makes the compiled session from saved functions between
    rounds (not the compiling process); later requests decode on it. A recorded configuration larger than
    ``max_batch`` allows is left alone."""
    from fsd_eagle import precompiled
    from fsd_eagle.server import engine, records
    from fsd_eagle.session import Session

    gen = generator(*parts)
    call = gen.prepare(PROMPTS[0], 8, temperature=0, chat=False)
    records.record(tmp_path, call, 1, engine.key_of(call, 1))
    records.record(tmp_path, call, 16, engine.key_of(call, 16))
    monkeypatch.setattr(engine, "PREBUILD_SECONDS", 0.0)
    made = []

    def make(call, rows):
        with pytest.raises(precompiled.NotSaved):
            precompiled.refuse("run_round", "under loads_only")
        made.append(rows)
        return Session(gen.engine, gen.session_for(call, rows).plan)

    s = Served(gen, max_batch=8, compile=True, warm_cache=lambda c, r: pytest.fail("compiling process asked"),
               make_compiled=make, records=tmp_path)
    try:
        assert s.metric("fsd_eagle_compiled_sessions") == 0 and made == []
        out = s.client.completions.create(model=MODEL, prompt=PROMPTS[3], temperature=0, max_tokens=20)
        assert out.choices[0].text == ref.generate(PROMPTS[3], 20, chat=False).text
        wait_for(lambda: s.metric("fsd_eagle_compiled_sessions") == 1, "the recorded configuration was not made")
        assert made == [1]
    finally:
        s.close()


def test_a_damaged_record_is_skipped_with_one_line(tmp_path, capsys, monkeypatch):
    from fsd_eagle import precompiled
    from fsd_eagle.server import records

    (tmp_path / "bad.json").write_text("{not json")
    assert records.recorded(tmp_path) == [] and records.recorded(tmp_path / "none") == []
    err = capsys.readouterr().err
    assert "bad.json: not a configuration record" in err and len(err.strip().splitlines()) == 1
    options = {"target": "t", "head": None, "device": "cuda", "dtype": "bfloat16", "threads": 2}
    monkeypatch.delenv(precompiled.ENV, raising=False)
    assert records.folder_for(options, 2048) is None  # no saved functions: nothing to record
    monkeypatch.setenv(precompiled.ENV, str(tmp_path))
    if precompiled.supported():
        here = records.folder_for(options, 2048)
        assert here == records.folder_for({**options, "threads": 8}, 2048)  # threads do not change compiled code
        assert here != records.folder_for(options, 4096) != records.folder_for({**options, "target": "u"}, 2048)
        assert here.is_relative_to(tmp_path / precompiled.environment())


def test_the_serving_benchmark_measures_transformers_serve_with_compile_as_its_own_column():
    """``--hf-compile`` starts transformers serve a second time with ``--compile`` (alone, without ``--hf``, only
    that one), and speculation's ratio against each transformers column is its own entry."""
    from eval import serve

    def columns(*flags: str) -> tuple[dict, list[str]]:
        args = serve.parser().parse_args([*flags, "--hf-model", "m", "--out", "x.json"])
        servers, variants = serve.servers_and_variants(["ours"], args)
        return servers, [v.name for v in variants]

    servers, names = columns("--hf", "--hf-compile")
    assert names == ["speculative", "plain", "transformers serve", "transformers serve --compile"]
    assert servers["transformers-compile"][0] == servers["transformers"][0] + ["--compile"]
    assert "--compile" not in servers["transformers"][0]
    servers, names = columns("--hf-compile")
    assert names[2:] == ["transformers serve --compile"] and set(servers) == {"fsd-eagle", "transformers-compile"}
    assert columns()[1] == ["speculative", "plain"]
    rows = [{"server": name, "load": "closed", "concurrency": 8, "output_tokens_per_s": tps, "tpot_ms_p50": ms}
            for name, tps, ms in (("speculative", 300.0, 1.0), ("plain", 100.0, 4.0), ("transformers serve", 50.0, 9.0),
                                  ("transformers serve --compile", 150.0, 3.0))]
    assert serve.ratios({"rows": rows})["ratios"] == [
        {"load": "closed", "level": 8, "vs_plain_tokens_per_s": 3.0, "tpot_p50_vs_plain": 0.25,
         "vs_transformers_tokens_per_s": 6.0, "vs_transformers_compile_tokens_per_s": 2.0}]


def test_the_compiling_process_fills_the_cache_for_each_configuration_once(tmp_path):
    """The worker process (``python -m fsd_eagle.server.compiler``), started by the first ask where nothing
    started it before, loads the model its options name, makes each configuration asked once and answers; on the CPU its "compiled" session is the plain one, so this
    checks the process and its protocol, not torch.compile (GPU: eval/serve.py --startup)."""
    from fsd_eagle.server.compiler import Compiler

    model, tokenizer = make_llama(seed=0), make_tokenizer()
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    gen = SpeculativeGenerator(model, tokenizer, tree=TREE)
    ready = queue.Queue()
    options = {"target": str(tmp_path / "target"), "device": "cpu", "dtype": "float32", "threads": 1}
    compiler = Compiler(lambda *answer: ready.put(answer), CONTEXT, options)
    try:
        call = gen.prepare(PROMPTS[0], 8, temperature=0, chat=False)
        key = ("greedy", 1)
        assert compiler.worker is None
        compiler.ask(key, call, 1)  # not started: the first ask starts it
        compiler.ask(key, call, 1)  # asked twice: made once
        got_key, got_call, rows, seconds = ready.get(timeout=WAIT_S)
        assert got_key == key and got_call is call and rows == 1 and seconds > 0
        with pytest.raises(queue.Empty):
            ready.get(timeout=1)
    finally:
        compiler.close()


def test_a_compiling_process_that_cannot_start_leaves_the_server_on_graph_rounds(tmp_path, capfd):
    from fsd_eagle.server.compiler import Compiler

    ready = queue.Queue()
    compiler = Compiler(lambda *answer: ready.put(answer), CONTEXT, {"target": str(tmp_path / "missing"), "device": "cpu"})
    compiler.start()
    try:
        compiler.worker.wait(WAIT_S)
        gen = SpeculativeGenerator(make_llama(seed=0), make_tokenizer(), tree=TREE)
        compiler.ask(("greedy", 1), gen.prepare(PROMPTS[0], 8, temperature=0, chat=False), 1)  # no exception
        deadline = time.monotonic() + WAIT_S
        while "the compiling process ended" not in capfd.readouterr().err.replace("\n", " "):
            assert time.monotonic() < deadline, "the worker's end was not reported"
            time.sleep(0.1)
        assert ready.empty() and compiler.worker.returncode != 0
    finally:
        compiler.close()


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("rows, attention", [(1, "flex"), (4, "sdpa")])
def test_a_warmed_compiled_session_compiles_nothing_more_for_its_lanes(rows, attention, monkeypatch):
    """What the engine thread may compile is only what the warm-up did not (the worker filled the cache
    for exactly that): after ``warm``, requests of a lane (its cache size) with prompts short and long,
    alone and together, compile nothing new. Counted by dynamo per function, as a GPU session compiles."""
    import types

    from torch._dynamo.testing import CompileCounter

    from conftest import gpu_session_on_the_cpu, make_session, tiny_model
    from fsd_eagle.config import TreeConfig
    from fsd_eagle.decode import DecodeStats, compiled_prefill, compiled_round
    from fsd_eagle.schedule import ROUND_END, Request, Scheduler
    from fsd_eagle.server.compiler import warm
    from fsd_eagle.verify import AcceptanceRule
    from test_engine import _engine

    counters: dict = {}
    gpu_session_on_the_cpu(monkeypatch, lambda fn: counters.setdefault(fn.__name__, CompileCounter()))
    compiled_round.cache_clear()
    torch._dynamo.reset()
    try:
        session = make_session(tree=TreeConfig(total_tokens=12, depth=4, top_k=3),
                               engine=_engine("eagle", tiny_model("llama")), graphs=True, compile=True, batch=rows)
        session.use_graph, session.compile, session.attention = True, True, attention  # a GPU session's
        context = 1024
        warm(session, types.SimpleNamespace(prompt_ids=torch.arange(3, 23), rule=AcceptanceRule()), context)
        after_warm = {name: c.frame_count for name, c in counters.items()}
        assert after_warm.get("prefill") and after_warm.get("run_round"), after_warm
        scheduler = Scheduler(session, [], rows, open_ended=True, max_len=Scheduler.cache_for(session, context))
        steps = scheduler.run()
        for wave in ([5], [600], [40, 9, 300], [900, 7]):
            for n in wave:
                scheduler.submit(Request(torch.randint(0, 100, (n,)), 12, AcceptanceRule(), 1, DecodeStats()))
            for item in steps:
                if item is ROUND_END and scheduler.idle:
                    break
            assert {name: c.frame_count for name, c in counters.items()} == after_warm, wave
    finally:
        compiled_prefill.cache_clear()  # later tests compile with inductor again
        compiled_round.cache_clear()
        torch._dynamo.reset()
