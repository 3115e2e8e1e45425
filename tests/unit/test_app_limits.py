"""Per-user limits on model endpoints: concurrent requests per user, and the cores and priority a
request's thread runs torch work at. (Explore's Run on the real default model, one-token prompts and the
prompt cap: tests/reference/test_explore_limits.py.)"""


import gradio as gr
import pytest

from app.shared.context import user_slot


class _Req:
    def __init__(self, name):
        self.username, self.session_hash = name, name


def test_concurrent_requests_per_user_are_capped(monkeypatch):
    monkeypatch.setenv("LMSCOPE_MAX_CONCURRENT_PER_USER", "2")
    alice, bob = _Req("alice"), _Req("bob")
    with user_slot(alice), user_slot(alice):
        with pytest.raises(gr.Error, match="already have 2 requests running"):
            with user_slot(alice):
                pass
        with user_slot(bob):  # other users are not affected
            pass
    with user_slot(alice):  # slots come back when requests end, errors included
        pass
    def fail():
        with user_slot(alice):
            raise RuntimeError("boom")
    for _ in range(3):
        with pytest.raises(RuntimeError):
            fail()
    with user_slot(alice), user_slot(alice):
        pass


def test_model_endpoints_run_torch_on_their_share_of_the_cores():
    """A model endpoint's worker thread runs its torch work on its share of the cores
    (model_core.core.cpu_threads.request_threads: 1 on a 2-core machine, where a team of 2 per request
    beside the engine's thread oversubscribed the cores); a direct call on the main thread keeps its
    count."""
    import os
    import threading

    import torch

    from app.shared.context import endpoint, settings
    from model_core.core.cpu_threads import request_threads
    from model_core.serving.engine import engine_threads

    @endpoint(model=True)
    def threads_in_a_request():
        return torch.get_num_threads()

    def in_new_thread(fn):
        out = []
        t = threading.Thread(target=lambda: out.append(fn()))
        t.start()
        t.join()
        return out[0]

    cores = os.cpu_count() or 1
    assert in_new_thread(threads_in_a_request) == request_threads(cores, engine_threads(), settings().queue_concurrency)
    before = torch.get_num_threads()
    assert threads_in_a_request() == before  # the main thread (a script's, a test's) keeps its count
    assert request_threads(2, 1, 2) == 1 and request_threads(16, 8, 2) == 4 and request_threads(1, 1, 2) == 1


def test_request_threads_yield_the_cores_to_the_engine_and_start_threads_at_full_priority():
    """A model endpoint's worker thread runs at nice REQUEST_NICE (the engine's thread, which works for
    every generating user, keeps the cores on a busy CPU: docs/PERFORMANCE.md); a thread it starts
    through cpu_threads.start_thread (the engine of a model a request loaded) runs at the priority
    threads start with, where a plain start would inherit the request's; the main thread keeps its own."""
    import os
    import threading

    from app.shared.context import endpoint
    from model_core.core.cpu_threads import REQUEST_NICE, start_thread

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = nice()
    seen = {}

    def record(name):
        seen[name] = nice()

    @endpoint(model=True)
    def a_request():
        seen["request"] = nice()
        for name, start in (("started", start_thread), ("inherited", threading.Thread.start)):
            t = threading.Thread(target=record, args=(name,))
            start(t)
            t.join()

    t = threading.Thread(target=a_request)
    t.start()
    t.join()
    assert REQUEST_NICE > 0
    assert seen == {"request": max(base, REQUEST_NICE), "started": base, "inherited": max(base, REQUEST_NICE)}
    a_request()  # the main thread keeps its priority
    assert nice() == base


def test_streamed_updates_spread_when_many_generations_stream():
    """Each streamed update costs the web process's one interpreter a few ms: a lone generation
    updates every STREAM_EVERY_S, and with many at once all of them together stay under
    STREAM_UPDATES_PER_S (an H200 at 32 users: 466 -> 1,091 tok/s served, docs/PERFORMANCE_LOG.md)."""
    from app.tabs.generate import tab as T

    pace = T._StreamPace()
    assert pace.interval() == T.STREAM_EVERY_S
    with pace:
        assert pace.interval() == T.STREAM_EVERY_S
        entered = [pace.__enter__() for _ in range(31)]
        assert pace.streaming == 32
        assert 32 / pace.interval() == pytest.approx(T.STREAM_UPDATES_PER_S)
        for p in entered:
            p.__exit__(None, None, None)
    assert pace.streaming == 0
