"""The web process's side of a model process: generations sent as typed requests, steps streamed back.

    client = ModelProcessClient("tcp://127.0.0.1:7861", key)
    for step, gen in client.iter_generate("smollm2-135m-instruct", GenerateRequest(prompt="Hi")):
        ...                                   # as model_core.serving.generate.iter_generate yields them
    client.health()                           # {"address", "pid", "device", "state", "since", ...}

States: "starting" (no answer yet), "ready" (it answered a ping), "restarting" (its connection dropped
or it stopped answering pings; until it answers again). When the connection drops, every request in
flight ends at once with RESTARTED (one sentence); a new request waits up to READY_WAIT_S for the
process to be back, then is refused with a sentence. A request that was in flight at two deaths of
the process in a row is refused instead of being sent a third time.

Threads: one I/O thread owns the DEALER socket, its monitor and an inproc PULL that each caller
thread's PUSH socket feeds (a ZeroMQ socket belongs to one thread). Messages are unpickled on the
caller's thread, so the I/O thread only moves frames.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import fields

import zmq
from zmq.utils.monitor import recv_monitor_message

from model_core.core.errors import LmscopeError
from model_core.serving.model_process_wire import (
    DRAIN_AT_MOST,
    MAX_MESSAGE_BYTES,
    RESTARTED,
    CancelCall,
    Failed,
    Finished,
    GenerateCall,
    PingCall,
    Pong,
    Started,
    Steps,
    new_request_id,
    pack,
    unpack,
)

log = logging.getLogger(__name__)

PING_ID = b"\0ping\0\0\0"
PING_EVERY_S = 1.0  # while ready; every 0.2 s while waiting for it
PONG_TIMEOUT_S = 15.0  # no answer this long while ready: the process is taken for dead (another host)
READY_WAIT_S = 60.0  # a new request waits this long for a (re)starting process
CRASHES_REFUSED = 2  # a request in flight at this many deaths in a row is not sent again
_GEN_FIELDS = None  # Generation's fields other than steps, filled on first use


class ModelProcessClient:
    def __init__(self, address: str, key: bytes, ctx: zmq.Context | None = None):
        self.address, self.key = address, key
        self.ctx = ctx or zmq.Context.instance()
        self.state, self.since = "starting", time.time()
        self.last_pong: Pong | None = None
        self.deaths = 0
        self._pending: dict[bytes, tuple[queue.SimpleQueue, bytes]] = {}  # request id -> (inbox, fingerprint)
        self._crashes: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._local = threading.local()
        self._inbox = f"inproc://lmscope-model-client-{id(self):x}"
        bound = threading.Event()
        self._thread = threading.Thread(target=self._io, args=(bound,), name="lmscope-model-client", daemon=True)
        self._thread.start()
        bound.wait(5)

    # --- what callers use -----------------------------------------------------------------------------
    def health(self) -> dict:
        p = self.last_pong
        return {"address": self.address, "state": self.state, "since": round(self.since, 3),
                "pid": p.pid if p else None, "device": p.device if p else None,
                "models": list(p.models) if p else [], "deaths": self.deaths, "in_flight": len(self._pending)}

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def iter_generate(self, model: str, request) -> Iterator[tuple]:
        """(step, generation) as the model process produces them; the generation is the same object
        every time, finished once the iterator ends. Closing the iterator cancels the request there."""
        fingerprint = _fingerprint(model, request)
        if self._crashes.get(fingerprint, 0) >= CRASHES_REFUSED:
            raise LmscopeError(f"This request was running when the model process died {CRASHES_REFUSED} times "
                               "in a row, so it is not run again; change the prompt or the settings.")
        if not self._ready.wait(READY_WAIT_S):
            raise LmscopeError(f"The model process has been {self.state} since {time.strftime('%H:%M:%S', time.localtime(self.since))}; "
                               "run it again in a minute.")
        request_id, inbox = new_request_id(), queue.SimpleQueue()
        with self._lock:
            self._pending[request_id] = (inbox, fingerprint)
        self._send(request_id, GenerateCall(model, request))
        gen, done = None, False
        try:
            while True:
                message = inbox.get()
                if isinstance(message, list):
                    got = unpack(message, self.key)
                    if got is None:
                        continue
                    message = got[1]
                if isinstance(message, Started):
                    gen = message.generation
                elif isinstance(message, Steps):
                    for step, kv in zip(message.steps, message.kv_points):
                        gen.steps.append(step)
                        gen.token_ids.append(step.chosen_id)
                        gen.kv_series.append(tuple(kv))
                        gen.text = step.text_so_far
                        yield step, gen
                    gen.text = message.text
                elif isinstance(message, Finished):
                    done = True
                    self._crashes.pop(fingerprint, None)
                    if gen is not None and message.generation is not None:
                        _finish(gen, message.generation)
                    return
                elif isinstance(message, Failed):
                    done = True
                    raise message.error()
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
            if not done:
                self._send(request_id, CancelCall())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    # --- the I/O thread -------------------------------------------------------------------------------
    def _send(self, request_id: bytes, message) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self._inbox)
        push.send_multipart(pack(request_id, message, self.key))

    def _io(self, bound: threading.Event) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        dealer.connect(self.address)
        inbox = self.ctx.socket(zmq.PULL)
        inbox.bind(self._inbox)
        bound.set()
        poller = zmq.Poller()
        for s in (dealer, inbox, monitor):
            poller.register(s, zmq.POLLIN)
        next_ping, pong_at = 0.0, time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_ping:
                    dealer.send_multipart(pack(PING_ID, PingCall(), self.key), zmq.NOBLOCK)
                    next_ping = now + (PING_EVERY_S if self.state == "ready" else 0.2)
                if self.state == "ready" and now - pong_at > PONG_TIMEOUT_S:
                    self._lost(f"did not answer for {PONG_TIMEOUT_S:.0f} s")
                for sock, _ in poller.poll(100):
                    if sock is monitor:
                        event = recv_monitor_message(monitor)["event"]
                        if event == zmq.EVENT_DISCONNECTED:
                            self._lost("closed its connection")
                    elif sock is inbox:
                        dealer.send_multipart(inbox.recv_multipart(), zmq.NOBLOCK)
                    else:
                        pong_at = self._deliver(dealer, pong_at)
        except zmq.ZMQError as e:  # the context was terminated (shutdown)
            log.debug("model process client stopped: %s", e)
        finally:
            dealer.disable_monitor()
            for s in (dealer, inbox, monitor):
                s.close(0)

    def _deliver(self, dealer, pong_at: float) -> float:
        """Every message waiting on the DEALER to its request's inbox (a pong to the health record);
        returns when the process was last heard from: any message says it is alive, so a busy
        process's pong queued behind its steps does not make it look dead."""
        for _ in range(DRAIN_AT_MOST):
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            pong_at = time.monotonic()
            if frames[0] == PING_ID:
                got = unpack(frames, self.key)
                if got is not None and isinstance(got[1], Pong):
                    self._answered(got[1])
                continue
            with self._lock:
                entry = self._pending.get(frames[0])
            if entry is not None:
                entry[0].put(frames)
        return pong_at

    def _answered(self, pong: Pong) -> None:
        if self.state != "ready":
            log.info("model process at %s is ready (pid %d, device %s)", self.address, pong.pid, pong.device)
            self.state, self.since = "ready", time.time()
            self._ready.set()
        self.last_pong = pong

    def _lost(self, how: str) -> None:
        """The process is gone: every request in flight ends with RESTARTED, at once."""
        if self.state == "ready":
            self.deaths += 1
            log.warning("model process at %s (pid %s) %s; %d requests in flight ended",
                        self.address, self.last_pong.pid if self.last_pong else "?", how, len(self._pending))
        self.state, self.since = "restarting", time.time()
        self._ready.clear()
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for inbox, fingerprint in pending:
            self._crashes[fingerprint] = self._crashes.get(fingerprint, 0) + 1
            self._crashes.move_to_end(fingerprint)
            inbox.put(Failed("", RESTARTED))
        while len(self._crashes) > 1024:
            self._crashes.popitem(last=False)


def _fingerprint(model: str, request) -> bytes:
    """The same model, prompt and settings give the same fingerprint (the seed included)."""
    import hashlib
    import pickle

    return hashlib.sha256(pickle.dumps((model, request), protocol=4)).digest()


def _finish(gen, final) -> None:
    """Copy the finished Generation's fields (all but the steps, which the client already holds)."""
    global _GEN_FIELDS
    if _GEN_FIELDS is None:
        _GEN_FIELDS = [f.name for f in fields(final) if f.name != "steps"]
    for name in _GEN_FIELDS:
        setattr(gen, name, getattr(final, name))
