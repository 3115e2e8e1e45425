"""Load test: N concurrent simulated users against a live `lmscope serve` on loopback, alternating
trace (Explore's Run) and generate requests. For N = 1, 5, 20 it prints throughput, p50/p95
latency and the error count, and the p95 as a multiple of the single-user p50.

Each user is one page session, as a browser tab is: one session hash and one kept-alive
connection; a request is a queue join and a read of the session's event stream until the event
completes, which is what the page's own client does (`--client gradio` uses gradio_client
instead, which polls its message queue every 50 ms and rebuilds every streamed update: on the
2 shared cores its 20 users took ~0.25 of a core from the server they measured).

    python bench/load.py                      # starts its own server (default model, CPU)
    python bench/load.py --url http://host:7860/ --auth user:password
    python bench/load.py --users 1 5 20 --requests 3 --new-tokens 8

Target on the 2-core CPU box: 20 users, zero errors, p95 under 5x the single-user latency. With
LMSCOPE_QUEUE_CONCURRENCY requests running at once, queueing makes a user's latency grow with N;
the target is about the queue staying fair and nothing failing, not about N x the hardware.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def add(a, b):\n    return",
           "The animal didn't cross the street because it was too tired"]


def trace_args(model, prompt):
    return [model, prompt, False, False, 0, 0, "probability", 1.0, 0, 1.0, 0.0, 1.0]


def gen_args(model, prompt, n):
    return [model, prompt, False, n, 0.0, 0, 1.0, 0.0, 1.0, 0, None, "prob", 0.0, 0.0]


def connect(url, auth, client: str = "page"):
    """call(api_name, args) -> the event's outputs, over one session (a browser tab); raises on an error."""
    if client == "gradio":
        from gradio_client import Client

        c = Client(url, auth=auth, verbose=False)
        return lambda api, args: c.predict(*args, api_name="/" + api)
    import uuid

    from tests.helpers.raw_client import RawClient

    c, session = RawClient(url, *(auth or (None, None)), timeout=600), uuid.uuid4().hex[:12]

    def call(api, args):
        """-> the event's outputs; call.started: when the server began running it (after its queue wait)."""
        fn, given = c.fn(api), iter(args)
        # the page sends null for a State input (its value lives in the server's session);
        # gradio_client's API leaves those out of the arguments, as these benches do
        data = [None if comp.get("type") == "state" else next(given) for comp in c.inputs_of(fn)]
        out = c.call(fn, data, session=session)
        call.started = c.started_at
        if "error" in out:
            raise RuntimeError(out["error"])
        return out["data"]

    call.started = None
    return call


def user(url, auth, model, n_requests, new_tokens, idx, out, errors, start_evt, think=0.0, connected=None,
         client="page", queued=None):
    import random

    rng = random.Random(idx)

    try:
        call = connect(url, auth, client)
    except Exception as e:  # noqa: BLE001
        errors.append(f"user {idx}: connect: {e}")
        return
    finally:
        if connected is not None:
            connected.release()
    start_evt.wait()
    for r in range(n_requests):
        if think > 0:  # a person reads the page before the next request (exponential, mean `think` s)
            time.sleep(rng.expovariate(1.0 / think))
        prompt = PROMPTS[(idx + r) % len(PROMPTS)]
        kind = "trace" if (idx + r) % 2 == 0 else "generate"
        t0 = time.perf_counter()
        try:
            if kind == "trace":
                call("trace", trace_args(model, prompt))
            else:
                call("generate", gen_args(model, prompt, new_tokens))
            out.append((kind, time.perf_counter() - t0))
            started = getattr(call, "started", None)  # the page client sees when its event left the queue
            if started is not None and queued is not None:
                queued.append((kind, started - t0))
        except Exception as e:  # noqa: BLE001
            errors.append(f"user {idx} {kind}: {type(e).__name__}: {str(e)[:120]}")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def run_level(url, auth, model, n_users, n_requests, new_tokens, think=0.0, client="page"):
    out, errors, queued = [], [], []
    start, connected = threading.Event(), threading.Semaphore(0)
    threads = [threading.Thread(target=user, args=(url, auth, model, n_requests, new_tokens, i, out, errors, start,
                                                   think, connected, client, queued))
               for i in range(n_users)]
    for t in threads:
        t.start()
    # every client connected (each fetched the page's config: ~1 MB, tens of ms of the server's
    # interpreter) before the clock starts: the level measures requests, not 20 page loads
    for _ in threads:
        connected.acquire()
    time.sleep(1.0)
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = [x for _, x in out]
    return {"users": n_users, "requests": len(out), "errors": len(errors), "wall_s": wall,
            "throughput": len(out) / wall if wall else 0.0,
            "p50": statistics.median(lat) if lat else float("nan"), "p95": pct(lat, 0.95) if lat else float("nan"),
            "p50_trace": statistics.median([x for k, x in out if k == "trace"] or [float("nan")]),
            "p50_generate": statistics.median([x for k, x in out if k == "generate"] or [float("nan")]),
            "p95_trace": pct([x for k, x in out if k == "trace"] or [float("nan")], 0.95),
            "queued_p50_p95": {kind: (statistics.median(w), pct(w, 0.95)) for kind in ("trace", "generate")
                               if (w := [x for k, x in queued if k == kind])},
            "p95_generate": pct([x for k, x in out if k == "generate"] or [float("nan")], 0.95),
            "error_samples": errors[:5]}


def _models(url, auth) -> list[dict]:
    """The server's loaded models as GET /metrics reports them ([] where it cannot tell)."""
    import json
    import urllib.request

    req = urllib.request.Request(url.rstrip("/") + "/metrics")
    if auth:
        req.add_header("Authorization", "Bearer " + ":".join(auth))
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            models = json.loads(r.read()).get("models") or []
    except OSError:
        return []
    return models if isinstance(models, list) else []


def _batching(url, auth) -> dict | None:
    """The server's own count of requests that shared forwards (GET /metrics)."""
    return next((m.get("batching") for m in _models(url, auth) if m.get("batching")), None)


def _engine(url, auth, model) -> dict | None:
    return next((m.get("engine") for m in _models(url, auth) if m.get("name") == model and m.get("engine")), None)


def wait_for_recordings(url, auth, model, timeout: float = 180.0) -> str:
    """Wait until the engine has recorded the buckets it records at start (a CPU server with
    LMSCOPE_RECORD_STEPS: ~2 s each, in the background), as an operator lets a server warm up
    before opening it to a team; what it waited, for the printout."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        eng = _engine(url, auth, model)
        if eng is None and time.time() - t0 < 30:  # the server may still be loading the model
            time.sleep(1)
            continue
        rec = (eng or {}).get("recorded_steps")
        if rec is None:
            return "no recorded steps (no engine, a GPU, or LMSCOPE_RECORD_STEPS=0)"
        if rec.get("waiting") == 0:
            return f"recorded {rec['buckets']} buckets, waited {time.time() - t0:.0f} s"
        time.sleep(1)
    return f"recordings still waiting after {timeout:.0f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--auth", help="user:password")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--users", type=int, nargs="+", default=[1, 5, 20])
    ap.add_argument("--requests", type=int, default=3, help="requests per user per level")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--think", type=float, default=0.0,
                    help="mean seconds a user reads the page between requests (0: back to back, a stress test)")
    ap.add_argument("--client", choices=["page", "gradio"], default="page",
                    help="page: one session per user reading its event stream as the page does; gradio: gradio_client")
    args = ap.parse_args(argv)
    server = None
    url = args.url
    auth = tuple(args.auth.split(":", 1)) if args.auth else None
    if url is None:
        from tests.helpers.browser import LiveServer

        t0 = time.time()
        server = LiveServer(extra_env={"REDIS_URL": "redis://127.0.0.1:1/0"})
        url = server.url
        print(f"server up in {time.time() - t0:.0f} s at {url}")
    try:
        # warm: load the model once so the first level does not pay for it
        run_level(url, auth, args.model, 1, 2, args.new_tokens, client=args.client)
        print(wait_for_recordings(url, auth, args.model))
        rows = [run_level(url, auth, args.model, n, args.requests, args.new_tokens, args.think, args.client)
                for n in args.users]
        batching, engine = _batching(url, auth), _engine(url, auth, args.model)
    finally:
        if server is not None:
            server.stop()
    base = rows[0]["p50"]
    print(f"\nclient {args.client}, model {args.model}, {args.requests} requests per user (trace and generate {args.new_tokens} tokens "
          f"alternating), " + (f"think time exponential, mean {args.think:g} s" if args.think else "no think time"))
    print(f"{'users':>5} {'reqs':>5} {'errors':>6} {'req/s':>7} {'p50 s':>7} {'p95 s':>7} {'p95/p50(1)':>10} "
          f"{'trace p50/p95':>14} {'gen p50/p95':>12}")
    for r in rows:
        print(f"{r['users']:>5} {r['requests']:>5} {r['errors']:>6} {r['throughput']:>7.2f} {r['p50']:>7.2f} "
              f"{r['p95']:>7.2f} {r['p95'] / base:>10.1f} {r['p50_trace']:>6.2f}/{r['p95_trace']:<7.2f} "
              f"{r['p50_generate']:>5.2f}/{r['p95_generate']:.2f}")
        if r["queued_p50_p95"]:
            print("      in the server's queue before running, p50/p95 s: " + ", ".join(
                f"{k} {a:.2f}/{b:.2f}" for k, (a, b) in r["queued_p50_p95"].items()))
        for e in r["error_samples"]:
            print("   ", e)
    if batching:
        print(f"shared forwards (/metrics): {batching}")
    if engine:
        print(f"engine (/metrics, whole run): mean batch {engine['mean_batch']}, launch "
              f"{engine['host_ms_per_step']['launch']} ms/step, prefill {engine['mean_prefill_ms']} ms, "
              f"recorded: {engine['recorded_steps']}")
    last = rows[-1]
    ok = last["errors"] == 0 and last["p95"] < 5 * base
    print(f"\ntarget (N={last['users']}: zero errors, p95 < 5x single-user p50): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
