"""The model process: generations run in a process of their own that `lmscope serve` starts and
restarts. Real parts: a live `lmscope serve` with LMSCOPE_MODEL_PROCESS=on, the real default model
in a real model process, a real SIGKILL in the middle of 16 generations and an Explore trace."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from bench.load import connect, gen_args, trace_args
from model_core.serving.model_process_wire import RESTARTED
from tests.helpers.browser import LiveServer, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

MODEL = "smollm2-135m-instruct"
USERS = 16


def health(server) -> dict:
    return json.loads(urllib.request.urlopen(server.url + "healthz", timeout=5).read())


def process_of(server) -> dict:
    return health(server)["model_processes"][0]


def ready_pid(server, not_pid=None, timeout=180.0) -> int:
    wait_until(lambda: process_of(server)["state"] == "ready" and process_of(server)["pid"] not in (None, not_pid),
               timeout=timeout)
    return process_of(server)["pid"]


def generate(call, prompt, n=200):
    """The generate event's outputs as one JSON text (status, messages, text)."""
    return json.dumps(call("generate", gen_args(MODEL, prompt, n)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer(extra_env={"LMSCOPE_MODEL_PROCESS": "on", "LMSCOPE_DATA_DIR": str(tmp_path_factory.mktemp("data")),
                              "LMSCOPE_GENERATE_CONCURRENCY": str(USERS)})
    try:
        yield s
    finally:
        s.stop()


def test_a_killed_model_process_ends_its_requests_with_a_sentence_and_comes_back(server):
    pid = ready_pid(server)
    assert process_of(server)["device"] == "cpu"
    calls = [connect(server.url, None) for _ in range(USERS + 1)]
    results: dict[int, str] = {}

    def run(i):
        try:
            results[i] = generate(calls[i], f"Story number {i}: once upon a time")
        except Exception as e:  # noqa: BLE001 - a 5xx or a dropped connection: the test fails on it below
            results[i] = f"FAILED {type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(USERS)]
    for t in threads:
        t.start()
    wait_until(lambda: process_of(server)["in_flight"] == USERS, timeout=120)
    trace = {}
    tracer = threading.Thread(target=lambda: trace.update(out=calls[USERS]("trace", trace_args(MODEL, "The capital of France is"))))
    tracer.start()
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # the dropped connection is noticed at once; the supervisor restarts the process after a second
    wait_until(lambda: process_of(server)["state"] == "restarting", timeout=5, what="the restarting state")
    h = health(server)
    for t in threads:
        t.join(60)
    tracer.join(120)
    # every generation in flight ended with the one sentence, none with a server error
    assert len(results) == USERS
    for out in results.values():
        assert not out.startswith("FAILED"), out
        assert RESTARTED in out, out[:400]
    assert trace.get("out"), "the trace in the web process went on"
    # /healthz says what happened and since when, then the process is back with a new pid
    assert h["model_processes"][0]["state"] == "restarting" and "model_process" in h["down"], h
    new_pid = ready_pid(server, not_pid=pid)
    back_s = time.monotonic() - killed_at
    print(f"model process back after {back_s:.1f} s (pid {pid} -> {new_pid})")
    assert "model_process" not in health(server).get("down", {})
    # new requests succeed: the restarted process reloaded the default model from its cache
    out = generate(calls[0], "The capital of France is", n=8)
    assert RESTARTED not in out and "Paris" in out, out[:400]


def test_a_request_that_killed_the_process_twice_is_refused(server):
    prompt = "A request that is in flight at two deaths in a row"
    call = connect(server.url, None)
    for _ in range(2):
        pid = ready_pid(server)
        got = {}
        t = threading.Thread(target=lambda got=got: got.update(out=generate(call, prompt)))
        t.start()
        wait_until(lambda: process_of(server)["in_flight"] == 1, timeout=60)
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        assert RESTARTED in got["out"]
        ready_pid(server, not_pid=pid)
    out = generate(call, prompt)
    assert "died 2 times in a row" in out and RESTARTED not in out, out[:400]
    # another request runs
    assert "Paris" in generate(call, "The capital of France is", n=8)
