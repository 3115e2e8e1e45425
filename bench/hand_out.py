"""How many recorded tokens per second the request side can take, without a GPU: N threads run the
real `iter_generate` loop (records -> Steps, the text, stop checks) fed by a stand-in engine thread
that hands out one record per running request every --step-ms, sleeping in between without the
GIL as the real engine does while it waits for the device. The records are real ones, recorded
once from the default model on the CPU.

What it tells: the Python ceiling of the served path on this machine (--step-ms 0), and at a
GPU's step time how late the stand-in's steps run because request threads hold the interpreter
(the real engine thread needs it to launch each step). Baseline in the same run: the stand-in
engine's rate with no request threads (records drained directly).

    .venv/bin/python bench/hand_out.py --users 1 8 32 --tokens 256 --step-ms 2.2 --releases 0 6 \
        --orders launch-first hand-out-first
    .venv/bin/python bench/hand_out.py --users 32 --step-ms 2.2 --releases 4 --converts engine request --gates off on

--converts: which thread turns records into steps and text (the engine's, as the real engine does through
EngineRequest.convert, or each request's); --gates: whether request threads wait for the stand-in's turn
(Engine.request_turn).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXT = ("The printing press spread across Europe within fifty years of its invention, and with it came "
        "cheaper books, standardized spelling and a new market for pamphlets, maps and calendars. ") * 8


class StandInEngine:
    """What model_core.serving.generate asks of an engine, with a timer where the GPU would be."""

    def __init__(self, packed: list[list[float]], token_ids: list[int], step_s: float, releases: int = 0,
                 launch_first: bool = True, gate: bool = False, convert: bool = True):
        from model_core.serving.engine import RECORDED

        self.k, self.max_len, self.start_error = RECORDED, 10_000, None
        self.layer_bytes_per_token = [1024] * 30
        self._packed, self._ids, self.step_s, self.releases = packed, token_ids, step_s, releases
        self.launch_first = launch_first
        self.convert = convert  # records become steps on this thread (as the real engine's), else on the request's
        # as the real engine's: cleared while it launches and hands out, set while the device works
        self.request_turn = threading.Event() if gate else None
        if gate:
            self.request_turn.set()
        self._rows: list = []
        self._cv = threading.Condition()
        self.steps, self.late_s = 0, 0.0
        threading.Thread(target=self._loop, daemon=True, name="stand-in-engine").start()

    def submit(self, req):
        req.first_token_at = time.perf_counter()
        with self._cv:
            self._rows.append([req, 0])
            self._cv.notify()
        return req

    def _launch(self) -> None:
        for _ in range(self.releases):  # a launch's torch calls, each of which drops the GIL
            time.sleep(0)

    def _loop(self) -> None:
        from model_core.serving.engine import Record

        due = time.perf_counter()
        while True:
            with self._cv:
                while not self._rows:
                    self._cv.wait()
                    due = time.perf_counter()
                rows = list(self._rows)
            if self.request_turn is not None:
                self.request_turn.clear()
            if self.launch_first:
                self._launch()
            now = time.perf_counter()
            self.late_s += max(0.0, now - due)
            puts = []
            for row in rows:  # the real engine's hand-out: one Record per row, queued once all are made
                req, i = row
                packed = list(self._packed[i % len(self._packed)])
                packed[0] = float(self._ids[i % len(self._ids)])
                last = i + 1 >= req.n_steps or req.cancelled.is_set()
                rec = Record(index=i, packed=packed, seconds=self.step_s, tokens_cached=i + 1, last=last)
                puts.append((req.out, rec if req.convert is None or not self.convert else req.convert(rec)))
                row[1] = i + 1
                if last:
                    puts.append((req.out, None))
                    with self._cv:
                        self._rows.remove(row)
            for q, item in puts:
                q.put(item)
            if not self.launch_first:  # right after waking every request thread
                self._launch()
            self.steps += 1
            due += self.step_s
            wait = due - time.perf_counter()
            if self.request_turn is not None:
                self.request_turn.set()
            if wait > 0:
                time.sleep(wait)  # the device's step; the GIL is free meanwhile
            else:
                due = time.perf_counter()  # behind: the next step is due now


def _real_records(lm, n: int = 16) -> list[list[float]]:
    from model_core.core.sampling import SamplingSettings
    from model_core.serving.engine import EngineRequest, engine_for

    eng = engine_for(lm)
    req = eng.submit(EngineRequest(ids=lm.tokenizer(TEXT[:60])["input_ids"], n_steps=n,
                                   settings=SamplingSettings(temperature=0.8, top_k=50, top_p=0.9), seed=0, eos=set()))
    out = []
    while (rec := req.out.get(timeout=120)) is not None:
        out.append(rec.packed)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=2.2, help="the stand-in device's step (0: as fast as it goes)")
    ap.add_argument("--releases", type=int, nargs="+", default=[0],
                    help="times per step the stand-in's launch drops and takes back the GIL")
    ap.add_argument("--converts", nargs="+", default=["engine"], choices=["engine", "request"],
                    help="which thread turns records into steps and text: the engine's (EngineRequest.convert) or the request's")
    ap.add_argument("--gates", nargs="+", default=["off"], choices=["off", "on"],
                    help="whether request threads wait for the stand-in engine's turn (Engine.request_turn)")
    ap.add_argument("--orders", nargs="+", default=["launch-first"], choices=["launch-first", "hand-out-first"],
                    help="launch the next step before handing out this one's records, or after")
    args = ap.parse_args(argv)

    import model_core.serving.generate as generate
    from model_core import load_model
    from model_core.core.sampling import SamplingSettings
    from model_core.serving.engine import SWITCH_INTERVAL, EngineRequest

    lm = load_model("smollm2-135m-instruct", device="cpu")
    packed = _real_records(lm)
    ids = lm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))  # as the engine sets it
    print(f"# bench/hand_out.py  {args.tokens} tokens per user, stand-in step {args.step_ms} ms, "
          f"{len(packed)} real records of {len(packed[0])} floats, switch interval {sys.getswitchinterval() * 1000:.1f} ms")
    print(f"{'users':>5} {'releases':>8} {'order':>14} {'gate':>4} {'convert on':>10} {'served tok/s':>12} {'alone tok/s':>12} {'served/alone':>12} "
          f"{'steps late by (mean)':>21}")
    for n, rel, order, gate, conv in [(n, r, o, g, c) for n in args.users for r in args.releases for o in args.orders
                                      for g in args.gates for c in args.converts]:
        results = {}
        for mode in ("alone", "served"):
            eng = StandInEngine(packed, ids, args.step_ms / 1000, rel, launch_first=order == "launch-first",
                                gate=gate == "on", convert=conv == "engine")
            generate._engine_for_request = lambda lm, n_prompt, n_steps, k, eng=eng: eng  # noqa: E731
            done = threading.Barrier(n + 1)

            def alone(i, eng=eng, done=done):
                req = eng.submit(EngineRequest(ids=[1], n_steps=args.tokens, settings=SamplingSettings(temperature=0),
                                               seed=0, eos=set()))
                done.wait()
                while req.out.get() is not None:
                    pass

            def served(i, done=done):
                done.wait()
                for _ in generate.iter_generate(lm, token_ids=[1, 2, 3], max_new_tokens=args.tokens, ignore_eos=True):
                    pass

            threads = [threading.Thread(target=alone if mode == "alone" else served, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            t0 = time.perf_counter()
            done.wait()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            results[mode] = (n * args.tokens / wall, eng.late_s / max(1, eng.steps))
        (served_r, late), (alone_r, _) = results["served"], results["alone"]
        print(f"{n:>5} {rel:>8} {order:>14} {gate:>4} {conv:>10} {served_r:>12.1f} {alone_r:>12.1f} {served_r / alone_r:>12.2f} {1000 * late:>18.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
