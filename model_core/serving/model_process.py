"""A model process: the models of one device and their generation engine, behind a ZeroMQ socket.

`lmscope serve` starts one and restarts it when it dies (tasks/services.py); the web process talks to
it through model_core/serving/model_process_client.py in the messages of model_process_wire.py. A
crash in model code (a poisoned CUDA context, an out-of-memory in a native kernel, a segfault in an
extension) ends this process, not the web server.

    python -m model_core.serving.model_process --address tcp://127.0.0.1:7861 [--warm NAME ...]

Device, dtype, data folder and the key come from Settings (LMSCOPE_DEVICE, LMSCOPE_DTYPE,
LMSCOPE_DATA_DIR, LMSCOPE_MODEL_PROCESS_KEY), as for the web process. The models named by --warm
(default: the default model) are loaded before the socket is bound, so a process that answers a ping
is one that can generate at once.

Threads: the main thread owns both sockets (a ZeroMQ socket belongs to one thread): the ROUTER that
clients reach and a PULL that every request thread's PUSH feeds. Each GenerateCall runs on its own
thread through `iter_generate`, as a web request did in the web process: the engine batches them.
A request's steps go back together, the first at once and then at most every STEPS_EVERY_S.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from dataclasses import replace

import zmq

from model_core.core.errors import LmscopeError
from model_core.serving.model_process_wire import (
    DRAIN_AT_MOST,
    MAX_MESSAGE_BYTES,
    CancelCall,
    Failed,
    Finished,
    GenerateCall,
    PingCall,
    Pong,
    Started,
    Steps,
    pack,
    shared_key,
    unpack,
)

log = logging.getLogger(__name__)
OUT = "inproc://lmscope-model-process-out"
STEPS_EVERY_S = 0.03  # a generation's steps are sent together at most this often (the page redraws every 0.1 s)


class ModelProcess:
    """The serving loop: `run()` until `stop()` (another thread) or the process ends."""

    def __init__(self, address: str, key: bytes, *, device=None, dtype=None, ctx: zmq.Context | None = None):
        self.address, self.key, self.device, self.dtype = address, key, device, dtype
        self.ctx = ctx or zmq.Context.instance()
        self.running: dict[tuple[bytes, bytes], threading.Event] = {}  # (client, request id) -> cancel
        self._stop = threading.Event()
        self._local = threading.local()

    # --- the loop (main thread) ----------------------------------------------------------------------
    def run(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.address)
        pull = self.ctx.socket(zmq.PULL)
        pull.bind(OUT)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        log.info("model process %d serving on %s (device %s)", os.getpid(), self.address, self.device)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(200))
                if pull in ready:  # answers first: they free the clients' pages (bounded: pings wait behind them)
                    for _ in range(DRAIN_AT_MOST):
                        try:
                            router.send_multipart(pull.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                if router in ready:
                    frames = router.recv_multipart()
                    self._take(router, frames[0], frames[1:])
        finally:
            router.close(0)
            pull.close(0)

    def stop(self) -> None:
        self._stop.set()
        for cancel in list(self.running.values()):
            cancel.set()

    def _take(self, router, client: bytes, frames: list[bytes]) -> None:
        got = unpack(frames, self.key)
        if got is None:
            log.warning("dropped a message that was not signed with this server's key")
            return
        request_id, call = got
        if isinstance(call, PingCall):
            router.send_multipart([client, *pack(request_id, self.pong(), self.key)])
        elif isinstance(call, GenerateCall):
            cancel = self.running[(client, request_id)] = threading.Event()
            threading.Thread(target=self._generate, args=(client, request_id, call, cancel),
                             name="lmscope-generate", daemon=True).start()
        elif isinstance(call, CancelCall):
            cancel = self.running.get((client, request_id))
            if cancel is not None:
                cancel.set()
        else:
            log.warning("dropped a message of unknown type %s", type(call).__name__)

    def pong(self) -> Pong:
        from model_core.core import registry

        return Pong(pid=os.getpid(), device=str(self.device or "auto"),
                    models=tuple(lm.name for lm in registry.loaded_models()))

    # --- a request (its own thread) ------------------------------------------------------------------
    def _send(self, client: bytes, request_id: bytes, message) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(OUT)
        push.send_multipart([client, *pack(request_id, message, self.key)])

    def _generate(self, client: bytes, request_id: bytes, call: GenerateCall, cancel: threading.Event) -> None:
        from model_core.serving.generate import iter_generate

        gen = None
        try:
            req = call.request
            if req.keep_logits or req.keep_probs or req.attention or req.edits or req.should_stop is not None:
                raise LmscopeError("A generation that keeps logits, attention or edits runs in the web process, "
                                   "not through the model process.")
            lm = self.load(call.model)
            steps, kv_points, sent_at = [], [], 0.0
            for step, gen in iter_generate(lm, request=replace(req, should_stop=cancel)):
                if step.index == 0:
                    self._send(client, request_id, Started(replace(gen, steps=[], token_ids=[], kv_series=[])))
                steps.append(step)
                kv_points.append(gen.kv_series[-1])
                # the first token at once (time to first token), then a message per STEPS_EVERY_S: one
                # per step was 5,000 messages/s at 32 users on an H200, more than either end's
                # interpreter could pack, sign and route
                if step.index == 0 or time.monotonic() - sent_at >= STEPS_EVERY_S:
                    self._send(client, request_id, Steps(steps, gen.text, kv_points))
                    steps, kv_points, sent_at = [], [], time.monotonic()
            if steps:
                self._send(client, request_id, Steps(steps, gen.text, kv_points))
            self._send(client, request_id, Finished(replace(gen, steps=[]) if gen is not None else None))
        except Exception as e:  # noqa: BLE001 - the request fails with a sentence; the process serves on
            if not isinstance(e, LmscopeError):
                log.exception("a generation failed")
            self._send(client, request_id, Failed.of(e))
        finally:
            self.running.pop((client, request_id), None)
            push = getattr(self._local, "push", None)
            if push is not None:
                push.close()
                self._local.push = None

    def load(self, name: str):
        from model_core.core.registry import load_model

        return load_model(name, device=self.device, dtype=self.dtype, allow_paths=False, allow_hub=False)


def main(argv=None) -> int:
    from model_core.core import paths
    from model_core.core import settings as settings_mod

    parser = argparse.ArgumentParser(prog="python -m model_core.serving.model_process")
    parser.add_argument("--address", required=True, help="where to bind, e.g. tcp://127.0.0.1:7861")
    parser.add_argument("--warm", nargs="*", default=None, help="models to load before serving (default: the default)")
    args = parser.parse_args(argv)
    s = settings_mod.current()
    settings_mod.configure_logging(s.log_level)
    key = shared_key(paths.data_dir(), s.model_process_key)
    server = ModelProcess(args.address, key, device=s.device, dtype=s.dtype)
    for name in args.warm if args.warm is not None else [s.default_model]:
        server.load(name)
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
