"""The served path: page users generating over HTTP against a live `lmscope serve`, next to the
in-process engine in the same run (same model, prompts, settings and token counts).

For each N in --users (default 1 8 32):
  - in-process: N threads at once, each one user's greedy generation of --new-tokens tokens with
    every step recorded (model_core.serving.generate.iter_generate, the engine's continuous batching);
  - served: N page sessions at once, each pressing the Generation lab's Generate: one queue join and
    a read of the session's event stream, as the page's own client does (tests/helpers/raw_client.py).
Both stop at EOS (greedy, so both see the same tokens); tok/s counts the tokens each request reports.
It prints aggregate tokens/s of each and their ratio, time to first token p50/p95 (served: until the
first streamed update reaches the client, the token already on its way to the page), and the p50/p99
of a light request while N users generate: Explore's layer switch on a traced prompt, by one more
session, back to back (and alone, before the levels, as its baseline).

--with-job: each level again while a fine-tuning job trains on the same device, in a process of its
own (the job worker's way on a GPU): the users' tok/s and TTFT with and without it, and the job's
tokens/s alone and meanwhile.

--model-process off on: the server with generation in its own interpreter (off) and in the
supervised model process (on, LMSCOPE_MODEL_PROCESS), one server after the other in the same run.

GPU: PYTHONPATH=. python bench/served.py --device cuda     (random-smollm2-135m in bf16)
CPU: .venv/bin/python bench/served.py --users 1 4 --new-tokens 32 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import row_rate  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven curious students measure how far "
         "sound travels in warm air and cold water before the evening bell").split()
TOKENS_IN_STATUS = re.compile(r"\*\*(\d+) tokens\*\*")  # the Generation lab's finished status line


def prompt(i: int, n_words: int = 24) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n_words))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))] if xs else float("nan")


def at_once(fn, n: int):
    """fn(0..n-1) on n threads released together -> (results, wall seconds)."""
    out, gate = [None] * n, threading.Barrier(n + 1)

    def run(i):
        gate.wait()
        out[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


# --- in-process ---------------------------------------------------------------------------------
def in_process_level(lm, n_users: int, new_tokens: int, repeats: int) -> dict:
    from model_core.serving.generate import iter_generate

    def one(i):
        t0, ttft, gen = time.perf_counter(), None, None
        for _, gen in iter_generate(lm, prompt(i), max_new_tokens=new_tokens):  # noqa: B007 - the last is read
            ttft = ttft or time.perf_counter() - t0
        return len(gen.token_ids), ttft

    rows = []
    for _ in range(repeats):
        out, wall = at_once(one, n_users)
        rows.append((sum(n for n, _ in out), wall, [t for _, t in out]))
    return _summary(n_users, rows, errors=[])


def _summary(n_users, rows, errors) -> dict:
    tokens, wall = sum(r[0] for r in rows), sum(r[1] for r in rows)
    ttft = [t for r in rows for t in r[2] if t is not None]
    return {"users": n_users, "tok_s": tokens / wall if wall else 0.0, "tokens": tokens,
            "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else float("nan"),
            "ttft_p95_ms": 1000 * pct(ttft, 0.95), "errors": len(errors), "error_samples": errors[:3]}


# --- served ---------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def served_level(url: str, model: str, n_users: int, new_tokens: int, repeats: int, light=None,
                 pids: dict[str, int] | None = None) -> dict:
    from tests.helpers.raw_client import RawClient

    clients = [RawClient(url, timeout=600) for _ in range(n_users)]
    fn = clients[0].fn("generate")
    errors, rows = [], []

    def one(i):
        c, session = clients[i], uuid.uuid4().hex[:12]
        t0 = time.perf_counter()
        out = c.call(fn, c.data_for(fn, {"Model": model, "Prompt": prompt(i), "max new tokens": new_tokens,
                                         "temperature (0 = greedy)": 0.0}), session=session)
        if "error" in out:
            errors.append(f"user {i}: {str(out['error'])[:160]}")
            return 0, None
        found = TOKENS_IN_STATUS.search(json.dumps(out["data"]))
        if not found:
            errors.append(f"user {i}: no token count in the finished outputs")
            return 0, None
        return int(found.group(1)), (c.first_update_at - t0) if c.first_update_at else None

    cpu0 = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
    for _ in range(repeats):
        if light is not None:
            light.start()
        out, wall = at_once(one, n_users)
        if light is not None:
            light.stop()
        rows.append((sum(n for n, _ in out), wall, [t for _, t in out]))
    summary = _summary(n_users, rows, errors)
    wall = sum(r[1] for r in rows)
    # where the served path's time goes: each process's CPU as a share of one core over the level
    used = {name: cpu_seconds(pid) - cpu0[name] for name, pid in (pids or {}).items()}
    summary["cores_busy"] = {name: round(s / wall, 2) for name, s in used.items()}
    # the same CPU per generated token: unlike tok/s, it does not move with how much of a core the host
    # gives the process in a run, so it compares runs and machines (the light user's work is in it too)
    tokens = sum(r[0] for r in rows)
    summary["cpu_ms_per_token"] = {name: round(1e3 * s / max(tokens, 1), 3) for name, s in used.items()}
    return summary


class LightUser:
    """One more page session: a traced prompt, then Explore's layer switch back to back while started."""

    def __init__(self, url: str, model: str, layers: int = 8):
        from tests.helpers.raw_client import RawClient

        self.layers = layers  # it cycles through the first `layers` layers (fewer in a tiny model)
        self.c, self.session = RawClient(url, timeout=600), uuid.uuid4().hex[:12]
        trace_fn = self.c.fn("trace")
        given = {"Model": model, "Prompt": "The animal didn't cross the street because it was too tired"}
        out = self.c.call(trace_fn, self.c.data_for(trace_fn, given), session=self.session)
        if "error" in out:
            raise RuntimeError(f"the light user's trace failed: {out['error']}")
        self.fn = self.c.fn("update_layer_head")
        self.base = self.c.data_for(self.fn, {})
        self.layer_slot = next(i for i, c in enumerate(self.c.inputs_of(self.fn)) if c.get("props", {}).get("label") == "Layer")
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop, self._thread = threading.Event(), None

    def switch(self, layer: int) -> None:
        data = list(self.base)
        data[self.layer_slot] = layer
        t0 = time.perf_counter()
        out = self.c.call(self.fn, data, session=self.session)
        if "error" in out:
            self.errors.append(str(out["error"])[:160])
        else:
            self.latencies.append(time.perf_counter() - t0)

    def start(self) -> None:
        self._stop.clear()

        def loop():
            layer = 0
            while not self._stop.is_set():
                layer = (layer + 1) % self.layers
                self.switch(layer)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def take(self) -> dict:
        lat, self.latencies = self.latencies, []
        errs, self.errors = self.errors, []
        return {"n": len(lat), "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
                "p99_ms": 1000 * pct(lat, 0.99), "errors": len(errs), "error_samples": errs[:3]}


class TrainingJob:
    """A fine-tuning job on the same device, in a process of its own as the job worker runs one on a
    GPU (sft.run_sft_on_gpus on the built-in data, its default speed options and loader processes);
    its progress rows (tokens seen, seconds since training began) come back on its stdout, so its
    tokens/s can be taken over any window of the bench."""

    def __init__(self, model: str, device: str, batch: int, data_dir: str):
        import subprocess

        settings = {"model": model, "dataset": "builtin", "builtin_train_size": 4096, "batch_size": batch,
                    "max_length": 256, "max_steps": 10**6, "accuracy_examples": 0, "eval_fraction": 0.0,
                    "sample_every": 0, "device": device, "output_name": f"served-bench-job-{uuid.uuid4().hex[:6]}"}
        code = ("import json, sys\nfrom model_core.training import sft\n"
                "sft.run_sft_on_gpus(json.loads(sys.argv[1]), processes=1,\n"
                "                    progress=lambda r: print(json.dumps(r, default=float), flush=True))")
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "LMSCOPE_DATA_DIR": data_dir,
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        self.log = Path(data_dir) / "job.log"
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(settings)], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=open(self.log, "w"))  # noqa: SIM115
        self.rows: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("loss") is not None:
                self.rows.append(row)

    def wait_steps(self, steps: int, timeout: float = 900) -> None:
        deadline = time.time() + timeout
        while len(self.rows) < steps:
            if self.proc.poll() is not None or time.time() > deadline:
                tail = self.log.read_text()[-1500:]
                raise RuntimeError(f"the training job did not reach step {steps}: {tail}")
            time.sleep(0.5)

    def mark(self) -> dict:
        return self.rows[-1]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(60)


def with_a_job(server, model: str, device: str, args, without: dict, light, data_dir: str) -> dict:
    """Each level of users again while a fine-tuning job trains on the same device: the users' tok/s
    and TTFT against the same level without it (`without`), and the job's tokens/s alone and during
    each level."""
    job = TrainingJob(args.job_model or model, device, args.job_batch, data_dir)
    out = {}
    try:
        job.wait_steps(args.job_skip)  # past the steps that compile
        a = job.mark()
        time.sleep(args.job_alone_s)
        alone = row_rate(a, job.mark())
        print(f"job alone: {alone:,.0f} tokens/s (batch {args.job_batch}, steps {a['step']}-{job.mark()['step']})",
              flush=True)
        for n in args.users:
            a = job.mark()
            r = served_level(server.url, model, n, args.new_tokens, args.repeats, light=light)
            b = job.mark()
            r["light"] = light.take()
            r["job_tok_s"], r["job_alone_tok_s"] = row_rate(a, b), alone
            r["vs_without_job"] = r["tok_s"] / without[n]["tok_s"]
            out[n] = r
            print(f"  + job    {n:>3} users  {r['tok_s']:>9.0f} tok/s ({r['vs_without_job']:.2f}x without the job)  "
                  f"TTFT p50/p95 {r['ttft_p50_ms']:.0f}/{r['ttft_p95_ms']:.0f} ms (without: "
                  f"{without[n]['ttft_p95_ms']:.0f} ms)  errors {r['errors']}; the job meanwhile "
                  f"{r['job_tok_s']:,.0f} tokens/s ({r['job_tok_s'] / alone:.2f}x alone)", flush=True)
            for e in r["error_samples"]:
                print("   ", e)
    finally:
        job.stop()
    return out


def serve(model: str, device: str, model_process: str, max_users: int, data_dir: str):
    from tests.helpers.browser import LiveServer

    env = {"LMSCOPE_DEVICE": device, "LMSCOPE_DEFAULT_MODEL": model, "LMSCOPE_MODEL_PROCESS": model_process,
           "LMSCOPE_GENERATE_CONCURRENCY": str(max_users), "LMSCOPE_QUEUE_MAX": str(4 * max_users + 16),
           "LMSCOPE_DATA_DIR": data_dir, "LMSCOPE_LOG_LEVEL": "WARNING"}
    return LiveServer(extra_env=env)


def wait_ready(url: str, timeout: float = 600) -> dict:
    """/healthz until every model process it lists is ready (with none, at once: the web process
    loads its model in the background and the warm round waits for it)."""
    import urllib.request

    deadline, body = time.time() + timeout, {}
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=10) as r:
                body = json.loads(r.read())
        except OSError:
            body = {}
        if body and all(mp.get("state") == "ready" for mp in body.get("model_processes", [])):
            return body
        time.sleep(1)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s: {body}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--model", default=None, help="default: random-smollm2-135m on a GPU, the default model on a CPU")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per level (after one unmeasured warm round)")
    ap.add_argument("--model-process", nargs="+", choices=["off", "on"], default=["off", "on"])
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="py-spy (on PATH) samples the web process's threads on a core during the largest "
                         "level: DIR/web-<model process>.txt, py-spy's raw format (a line per stack and its samples)")
    ap.add_argument("--no-light", action="store_true",
                    help="no layer switches while the users generate: the web process's CPU per token is then "
                         "the generations' own (the switches run back to back, so they add CPU per second, not per token)")
    ap.add_argument("--compile", action="store_true",
                    help="let the engine compile its decode step (LMSCOPE_COMPILE; off by default: a compile "
                         "running in the background for minutes would land in some levels and not others)")
    ap.add_argument("--with-job", action="store_true",
                    help="then each level again while a fine-tuning job trains on the same device (TrainingJob)")
    ap.add_argument("--job-model", default=None, help="the job's model (default: the served one)")
    ap.add_argument("--job-batch", type=int, default=256, help="the job's examples per step")
    ap.add_argument("--job-skip", type=int, default=15, help="the job's steps before its rate is taken")
    ap.add_argument("--job-alone-s", type=float, default=15.0, help="seconds the job's rate alone is taken over")
    args = ap.parse_args(argv)
    if not args.compile:
        os.environ["LMSCOPE_COMPILE"] = "0"  # read by this process's engine and inherited by the servers
    import torch

    from model_core import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or ("random-smollm2-135m" if device == "cuda" else "smollm2-135m-instruct")
    os.environ["LMSCOPE_GENERATE_CONCURRENCY"] = str(max(args.users))
    where = torch.cuda.get_device_name(0) if device == "cuda" else f"cpu, {os.cpu_count()} cores"
    print(f"# bench/served.py  {model} on {where}; {args.new_tokens} new tokens per user, greedy, "
          f"{args.repeats} rounds per level", flush=True)

    lm = load_model(model, device=device)
    results: dict[str, dict] = {"in-process": {}}
    for n in args.users:
        in_process_level(lm, n, args.new_tokens, 1)  # warm: the engine's graphs for this batch size
        results["in-process"][n] = in_process_level(lm, n, args.new_tokens, args.repeats)
        r = results["in-process"][n]
        print(f"in-process  {n:>3} users  {r['tok_s']:>9.0f} tok/s  TTFT p50/p95 {r['ttft_p50_ms']:.0f}/"
              f"{r['ttft_p95_ms']:.0f} ms", flush=True)

    light_alone = {}
    for mode in args.model_process:
        with tempfile.TemporaryDirectory() as data_dir:
            t0 = time.time()
            server = serve(model, device, mode, max(args.users), data_dir)
            try:
                health = wait_ready(server.url)
                print(f"server (model process {mode}) ready in {time.time() - t0:.0f} s; /healthz model "
                      f"processes: {health.get('model_processes', [])}", flush=True)
                light = LightUser(server.url, model, layers=min(8, lm.shape.n_layers))
                for layer in range(40):
                    light.switch(layer % light.layers)
                light_alone[mode] = light.take()
                results[mode] = {}
                for n in args.users:
                    served_level(server.url, model, n, args.new_tokens, 1)  # warm
                    pids = {"web": server.proc.pid, **{f"child {c}": c for c in children(server.proc.pid)}}
                    spy = None
                    if args.profile and n == max(args.users):
                        import subprocess

                        Path(args.profile).mkdir(parents=True, exist_ok=True)
                        # every thread on a core, not --gil: --gil put 43% of a CPU run's samples on the SSE
                        # messages' model_dump, which a timer around it put at 55 ms in all
                        spy = subprocess.Popen(["py-spy", "record", "--nonblocking", "--threads", "-r", "200", "-f", "raw",
                                                "-p", str(server.proc.pid), "-o", f"{args.profile}/web-{mode}.txt"],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    r = served_level(server.url, model, n, args.new_tokens, args.repeats,
                                     light=None if args.no_light else light, pids=pids)
                    if spy is not None:
                        spy.send_signal(2)  # py-spy writes its file on Ctrl-C
                        spy.wait(60)
                    r["light"] = light.take()
                    r["vs_in_process"] = r["tok_s"] / results["in-process"][n]["tok_s"]
                    results[mode][n] = r
                    print(f"served {mode:>3}  {n:>3} users  {r['tok_s']:>9.0f} tok/s ({r['vs_in_process']:.2f}x in-process)"
                          f"  TTFT p50/p95 {r['ttft_p50_ms']:.0f}/{r['ttft_p95_ms']:.0f} ms  errors {r['errors']}  "
                          f"layer switch meanwhile p50/p99 {r['light']['p50_ms']:.0f}/{r['light']['p99_ms']:.0f} ms "
                          f"(n={r['light']['n']}, errors {r['light']['errors']}); cores busy {r['cores_busy']}; "
                          f"CPU ms per token {r['cpu_ms_per_token']}", flush=True)
                    for e in r["error_samples"] + r["light"]["error_samples"]:
                        print("   ", e)
                if args.with_job:
                    results[f"{mode} + job"] = with_a_job(server, model, device, args, results[mode], light, data_dir)
                    for n, r in results[f"{mode} + job"].items():
                        r["vs_in_process"] = r["tok_s"] / results["in-process"][n]["tok_s"]
            finally:
                server.stop()

    print(f"\n{'':<18}" + "".join(f"{n:>3} users: tok/s  x-inproc  TTFT p95  switch p99 | " for n in args.users))
    for name, rows in results.items():
        cells = []
        for n in args.users:
            r = rows[n]
            ratio = r.get("vs_in_process", 1.0)
            sw = r.get("light", {}).get("p99_ms", float("nan"))
            cells.append(f"{r['tok_s']:>14.0f} {ratio:>9.2f} {r['ttft_p95_ms']:>8.0f}ms {sw:>9.0f}ms | ")
        print(f"{name:<18}" + "".join(cells))
    for mode, r in light_alone.items():
        print(f"layer switch alone (model process {mode}): p50/p99 {r['p50_ms']:.0f}/{r['p99_ms']:.0f} ms over {r['n']}")
    print(json.dumps({"results": {k: {str(n): v for n, v in rows.items()} for k, rows in results.items()},
                      "light_alone": light_alone}, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
