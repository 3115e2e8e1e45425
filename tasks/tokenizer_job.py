"""The tokenizer-training Celery task: corpus -> tokenizers training -> tokenizer.json + report.json.

Progress: stages 'loading corpus' (0-5 %), 'training' (5-85 %: the corpus feed is measured, the
merge phase after it is estimated from measured throughput per algorithm), 'report' (85-100 %).
A heartbeat thread writes the heartbeat key and the progress every LMSCOPE_JOB_STALE_SECONDS/6 s
and watches the cancel flag; the corpus feed checks the flag between chunks.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from model_core.errors import LmscopeError
from tasks import config, corpus, store
from tasks import tokenizer_train as tt
from tasks.celery_app import app

MAX_ATTEMPTS = 2
# Measured on a 2-core CPU machine (bench/tokenizer.py), used only for the ETA estimate.
EXPECTED_MB_S = {"bpe": 1.4, "byte-level-bpe": 2.6, "wordpiece": 3.0, "unigram": 0.11}


def _claim(job_id: str, celery_host: str) -> dict | None:
    """queued -> running (or take over a running job whose worker died). None: nothing to do."""
    dead_reason = None
    rec0 = store.get(job_id)
    if rec0 is None or rec0["state"] in store.TERMINAL:
        return None
    if rec0["state"] == "running":
        dead_reason = store.heartbeat_dead(job_id, stale_after=config.stale_after_s())
        if dead_reason is None:
            return None  # a live execution owns it: this is a duplicate delivery

    def fn(rec):
        now = time.time()
        if rec["state"] in store.TERMINAL:
            return None
        if rec["state"] == "running" and dead_reason is None:
            return None
        if store.cancel_requested(job_id):
            rec.update(state="cancelled", finished=now)
            rec["log"].append(store.log_line("cancelled before start"))
            return rec
        rec["attempts"] = rec.get("attempts", 0) + 1
        if rec["attempts"] > MAX_ATTEMPTS:
            rec.update(state="failed", finished=now, error=f"worker lost ({dead_reason}); gave up after "
                                                           f"{MAX_ATTEMPTS} attempts")
            rec["log"].append(store.log_line(f"failed: {rec['error']}"))
            return rec
        if rec["state"] == "running":
            rec["log"].append(store.log_line(f"worker lost ({dead_reason}); restarting, attempt {rec['attempts']}"))
        rec.update(state="running", started=now, error=None,
                   worker={"host": socket.gethostname(), "pid": os.getpid(), "celery": celery_host})
        rec["progress"] = {"fraction": 0.0, "stage": "starting", "eta_seconds": None}
        rec["log"].append(store.log_line(f"started on {celery_host} (pid {os.getpid()})"))
        return rec

    store.beat(job_id)
    rec = store.update(job_id, fn)
    if rec is None or rec["state"] != "running":
        return None
    return rec


class _Progress:
    """Shared between the task body and the heartbeat thread."""

    def __init__(self, job_id: str, attempt: int):
        self.job_id, self.attempt = job_id, attempt
        self.stage, self.fraction = "starting", 0.0
        self.est = None  # (t0, expected_s, base, span) for an estimated stage
        self.t_start = time.time()
        self.cancelled = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def set(self, stage: str, fraction: float, log: str | None = None, est=None) -> None:
        with self.lock:
            self.stage, self.fraction, self.est = stage, fraction, est
        self.push(log)

    def current(self) -> tuple[str, float]:
        with self.lock:
            f = self.fraction
            if self.est is not None:
                t0, expected, base, span = self.est
                f = max(f, base + span * min(0.95, (time.time() - t0) / max(expected, 1e-3)))
            return self.stage, min(f, 0.999)

    def push(self, log: str | None = None) -> None:
        stage, f = self.current()
        elapsed = time.time() - self.t_start
        eta = round(elapsed / f * (1 - f), 1) if f > 0.02 else None

        def fn(rec):
            if rec["state"] != "running" or rec.get("attempts") != self.attempt:
                return None
            rec["progress"] = {"fraction": round(f, 4), "stage": stage, "eta_seconds": eta}
            if log:
                rec["log"].append(store.log_line(log))
            return rec

        store.update(self.job_id, fn)

    def heartbeat_loop(self) -> None:
        every = config.heartbeat_every_s()
        while not self.stop.wait(every):
            try:
                store.beat(self.job_id)
                if store.cancel_requested(self.job_id):
                    self.cancelled.set()
                self.push()
            except Exception:  # noqa: BLE001 - a Redis hiccup must not kill the job
                pass


def _finish(job_id: str, attempt: int, **fields) -> dict | None:
    log = fields.pop("log", None)

    def fn(rec):
        if rec["state"] != "running" or rec.get("attempts") != attempt:
            return None
        rec.update(fields, finished=time.time())
        if fields.get("state") == "succeeded":
            rec["progress"] = {"fraction": 1.0, "stage": "done", "eta_seconds": 0}
        else:
            rec["progress"]["stage"] = fields.get("state")
            rec["progress"]["eta_seconds"] = None
        if log:
            rec["log"].append(store.log_line(log))
        return rec

    return store.update(job_id, fn)


def load_docs(params: dict, job_dir: Path) -> tuple[list[str], list[str], str]:
    """(train docs, held-out docs, held-out source) for a job's corpus parameter."""
    max_bytes = int(params["corpus_max_mb"] * 2**20) if params.get("corpus_max_mb") else None
    if params.get("corpus", "builtin") == "builtin":
        return (corpus.builtin_docs("train", max_bytes), corpus.builtin_docs("heldout"),
                "builtin held-out split (stdlib docstrings, every 10th file)")
    docs = []
    for name in params.get("corpus_files", []):
        docs.extend(corpus.file_docs(job_dir / "input" / name))
    if not docs:
        raise corpus.CorpusError("The corpus has no text to train on.")
    train, held = corpus.split_heldout(docs)
    if max_bytes:
        out, n = [], 0
        for d in train:
            n += len(d.encode())
            if n > max_bytes and out:
                break
            out.append(d)
        train = out
    if held:
        return train, held, "every 10th uploaded document"
    return train, corpus.builtin_docs("heldout"), "builtin held-out split (upload has < 10 documents)"


def _finish_unexpected(job_id: str, attempt: int, e: Exception) -> None:
    """An error no one anticipated: one line in the record (the traceback goes to the worker log)."""
    msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    _finish(job_id, attempt, state="failed", error=msg, log=f"failed: {msg}")


def start_job(task, job_id: str, progress_cls=None):
    """The start every job task shares: claim the record for this worker (None when a redelivered
    message has nothing left to do), start its heartbeat thread, make its artifact directory.
    Returns (record, progress, job_dir)."""
    rec = _claim(job_id, task.request.hostname or "?")
    if rec is None:
        return None
    prog = (progress_cls or _Progress)(job_id, rec["attempts"])
    threading.Thread(target=prog.heartbeat_loop, name=f"heartbeat-{job_id}", daemon=True).start()
    jdir = config.job_dir(job_id)
    jdir.mkdir(parents=True, exist_ok=True)
    return rec, prog, jdir


@app.task(bind=True, name="lmscope.train_tokenizer", acks_late=True, reject_on_worker_lost=True)
def train_tokenizer(self, job_id: str) -> str:
    started = start_job(self, job_id, _Progress)
    if started is None:
        return "skipped"
    rec, prog, jdir = started
    attempt = rec["attempts"]
    try:
        params = tt.validate_params(rec["params"])
        prog.set("loading corpus", 0.01, "loading corpus")
        train_docs, held, held_src = load_docs(params, jdir)
        nbytes = sum(len(d.encode()) for d in train_docs)
        mb = nbytes / 2**20
        expected = mb / EXPECTED_MB_S[params["algorithm"]]
        prog.set("training", 0.05, f"training {params['algorithm']} (vocab {params['vocab_size']}) on "
                                   f"{len(train_docs)} documents, {mb:.2f} MB", est=(time.time(), expected, 0.05, 0.8))
        t0 = time.time()
        tok = tt.train(params, train_docs, should_cancel=lambda: prog.cancelled.is_set()
                       or store.cancel_requested(job_id))
        secs = time.time() - t0
        prog.set("report", 0.85, f"trained in {secs:.2f} s ({mb / max(secs, 1e-9):.2f} MB/s); writing report")
        tok_path = jdir / "tokenizer.json"
        tok.save(str(tok_path))
        rep = tt.report(tok, params, held, held_src, {
            "seconds": round(secs, 4), "bytes": nbytes, "documents": len(train_docs),
            "mb_per_s": round(mb / max(secs, 1e-9), 4)})
        rep_path = jdir / "report.json"
        rep_path.write_text(json.dumps(rep, indent=1, ensure_ascii=False), encoding="utf-8")
        arts = [{"name": p.name, "path": str(p), "bytes": p.stat().st_size} for p in (tok_path, rep_path)]
        c = rep["compression"]
        _finish(job_id, attempt, state="succeeded", artifacts=arts,
                log=f"done: vocab {rep['vocab_size']}, {c['chars_per_token']} chars/token on held-out text")
        return "succeeded"
    except tt.Cancelled:
        _finish(job_id, attempt, state="cancelled", log="cancelled")
        return "cancelled"
    except LmscopeError as e:
        _finish(job_id, attempt, state="failed", error=str(e), log=f"failed: {e}")
        return "failed"
    except Exception as e:  # noqa: BLE001 - the record gets one line, the worker log the traceback
        _finish_unexpected(job_id, attempt, e)
        raise
    finally:
        prog.stop.set()
