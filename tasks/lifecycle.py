"""One lifecycle for every job kind: queue, claim, heartbeat, progress, cancel, finish, fail.

Queue side (the web process, the CLI): `queue(task, kind, params, owner)` stores a new record and
queues the task with the job id; `queue_client()` is the broker or one sentence saying it is not
reachable; `artifact_path` / `read_json_artifact` read a job's files back.

Worker side, Celery's idiom: a kind's task is

    @app.task(bind=True, base=JobTask, name="lmscope.<kind>", progress_cls=..., cancelled_by=(...))
    def run_x(self, job: Job) -> Done:
        job.stage("loading model", 0.01, "loading ...")     # progress into our Redis record
        ...                                                   # job.check_cancel() between steps
        return job.done("done: ...", path, ...)               # the success line and artifacts

Its message carries the job id only. JobTask.__call__ claims the record (a redelivered message
whose job is finished, reaped or owned by a live execution does nothing), starts the heartbeat
thread (the one place that writes heartbeats and notices a cancel flag), makes the job's folder,
runs the body with the claimed Job and writes the one ending:
  succeeded  the body returned job.done(log, artifacts...)
  cancelled  Cancelled (the one cancel exception; its message, else job.cancel_note, is the log
             line) or one of the task's `cancelled_by` exceptions (model_core's own)
  failed     any other exception, turned into one sentence by error_sentence (an unexpected one is
             also re-raised, so the worker log keeps its traceback)
Final-state writes are conditional on the execution's attempt, so a reaped or cancelled record
is never overwritten.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from celery import Task

from model_core.core import settings
from model_core.core.errors import LmscopeError
from tasks import config, store

MAX_ATTEMPTS = 2


class JobError(LmscopeError):
    pass


class Cancelled(Exception):
    """The job stops because it was cancelled; str(e), when given, is the record's log line."""


def error_sentence(e: BaseException) -> str:
    """The one line a record (or a caller) gets for an exception: an lmscope error's own sentence,
    else its type and first line (the worker log keeps the traceback)."""
    if isinstance(e, LmscopeError):
        return re.sub(r"\s*\n\s*", " ", str(e).strip())
    first = str(e).splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


# ---- queue side ---------------------------------------------------------------------------

def queue_client() -> redis.Redis:
    r = store.client()
    try:
        r.ping()
    except redis.RedisError:
        # never the URL itself: it can hold the server's password
        raise JobError("The job queue is not reachable; start it with `lmscope serve` (embedded) or set REDIS_URL."
                       ) from None
    return r


def check_rate(owner: str, r: redis.Redis | None = None) -> None:
    """LMSCOPE_JOBS_PER_HOUR (default 20; 0 = no limit) jobs per owner per hour; the CLI is exempt."""
    limit = settings.current().jobs_per_hour
    if limit <= 0 or owner == "cli":
        return
    hour_ago = time.time() - 3600
    n = sum(1 for rec in store.list_records(owner, limit + 1, r or queue_client()) if rec.get("created", 0) >= hour_ago)
    if n >= limit:
        raise JobError(f"You have submitted {n} jobs in the last hour; the limit is {limit}. Try again later.")


def enqueue(task, rec: dict, r: redis.Redis) -> dict:
    """Store a new job record, then queue its task; if queueing fails the record says so (failed,
    with the reason) and the caller gets one sentence. With no worker alive (no heartbeat), the
    record says that too (`warning` and its log), so the job does not sit "queued" without a word."""
    from tasks.celery_app import publish

    if store.live_workers(r) == 0:
        rec["warning"] = "No job worker is running; the job will start when one does."
        rec["log"].append(store.log_line(rec["warning"]))
    store.create(rec, r)
    try:
        publish(task, rec["id"])
    except Exception as e:  # noqa: BLE001
        msg = error_sentence(e)

        def fail(x):
            x.update(state="failed", error=f"could not queue the job: {msg}", finished=time.time())
            return x

        store.update(rec["id"], fail, r)
        raise JobError(f"Could not queue the job: {msg}") from None
    return rec


def queue(task, kind: str, params: dict, owner: str, prepare: Callable[[dict], None] | None = None) -> dict:
    """A new record of `kind` with the (validated) params, queued for `task`. prepare(record), when
    given, fills in what the kind keeps beside the params (extra fields, input files in the job's
    folder) and may still refuse with one sentence: nothing is queued then."""
    r = queue_client()
    check_rate(owner, r)
    rec = store.new_record(kind, params, owner)
    if prepare is not None:
        prepare(rec)
    return enqueue(task, rec, r)


def artifact(path: Path) -> dict:
    """A record's artifact entry for a file."""
    path = Path(path)
    return {"name": path.name, "path": str(path), "bytes": path.stat().st_size}


def artifact_path(rec: dict, name: str) -> Path | None:
    """The artifact's file, only if it really lies inside the job's own folder: a record is data
    (anyone who can write to Redis can write one), not a permission to read a server path."""
    root = config.job_dir(str(rec.get("id", ""))).resolve()
    for a in rec.get("artifacts", []):
        if a.get("name") != name:
            continue
        try:
            real = Path(a["path"]).resolve(strict=True)
        except (OSError, RuntimeError, KeyError, TypeError):
            return None
        return real if root in real.parents and real.is_file() else None
    return None


def read_json_artifact(rec: dict, name: str) -> dict | None:
    """A JSON artifact of the job (report.json, patching.json, scaling.json), or None."""
    path = artifact_path(rec, name)
    return json.loads(path.read_text(encoding="utf-8")) if path is not None else None


# ---- worker side: claim, heartbeat, progress ----------------------------------------------

def heartbeat(job_id: str) -> None:
    """This execution is alive (the reaper fails a running job whose heartbeat is stale)."""
    store.beat(job_id)


def claim(job_id: str, celery_host: str) -> dict | None:
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

    heartbeat(job_id)
    rec = store.update(job_id, fn)
    if rec is None or rec["state"] != "running":
        return None
    return rec


def _own_running(rec: dict, attempt: int) -> bool:
    """The record is still this execution's to write (not finished, reaped, cancelled or retaken)."""
    return rec["state"] == "running" and rec.get("attempts") == attempt


class Progress:
    """Stage and fraction of a running job, shared by the task body and the heartbeat thread, and
    written into the record by push(). A kind that keeps more in its record (curves, points) sets
    `section` and returns that part from snapshot()."""

    section: str | None = None  # record field that snapshot() updates
    eta_after = 0.02  # no estimate of the time left before this fraction

    def __init__(self, job_id: str, attempt: int):
        self.job_id, self.attempt = job_id, attempt
        self.stage, self.fraction = "starting", 0.0
        self.est = None  # (t0, expected_s, base, span) for an estimated stage
        self.t_start = time.time()
        self.lock = threading.Lock()
        self._last_push = 0.0

    def set(self, stage: str, fraction: float, log: str | None = None, est=None) -> None:
        with self.lock:
            self.stage, self.fraction, self.est = stage, fraction, est
        self.push(log)

    def advance(self, stage: str, fraction: float, every_s: float, force: bool = False) -> None:
        """A step inside a stage: recorded at once, written at most every `every_s` (the heartbeat
        thread writes the latest value anyway)."""
        with self.lock:
            self.stage, self.fraction, self.est = stage, fraction, None
        self.push_if_due(every_s, force)

    def current(self) -> tuple[str, float]:
        with self.lock:
            f = self.fraction
            if self.est is not None:
                t0, expected, base, span = self.est
                f = max(f, base + span * min(0.95, (time.time() - t0) / max(expected, 1e-3)))
            return self.stage, min(f, 0.999)

    def eta(self, f: float) -> float | None:
        """Seconds left (called under the lock)."""
        return round((time.time() - self.t_start) / f * (1 - f), 1) if f > self.eta_after else None

    def snapshot(self) -> dict:
        """The kind's part of the record, record[section] (called under the lock)."""
        return {}

    def push_if_due(self, every_s: float, force: bool = False) -> None:
        if force or time.time() - self._last_push >= every_s:
            self.push()

    def push(self, log: str | None = None) -> None:
        stage, f = self.current()
        with self.lock:
            eta, extra = self.eta(f), self.snapshot()
        self._last_push = time.time()

        def fn(rec):
            if not _own_running(rec, self.attempt):
                return None
            rec["progress"] = {"fraction": round(f, 4), "stage": stage, "eta_seconds": eta}
            if self.section:
                rec.setdefault(self.section, {}).update(extra)
            if log:
                rec["log"].append(store.log_line(log))
            return rec

        store.update(self.job_id, fn)


def thin(history: list[dict], max_points: int) -> list[dict]:
    """At most about max_points rows, evenly spaced; evaluation rows are always kept."""
    if len(history) <= max_points:
        return history
    keep = set(round(i * (len(history) - 1) / (max_points - 1)) for i in range(max_points))
    return [h for i, h in enumerate(history) if i in keep or h.get("eval_loss") is not None]


class CurvesProgress(Progress):
    """Progress of a training run, plus its curves in record[section]: history (loss rows, thinned
    to MAX_HISTORY), the latest row, and `extra` (what the run reports at its end). The time left
    is the run's own estimate (row_eta) when it gives one."""

    MAX_HISTORY = 2000
    eta_after = 0.05

    def __init__(self, job_id: str, attempt: int):
        super().__init__(job_id, attempt)
        self.history: list[dict] = []
        self.latest: dict | None = None
        self.row_eta: float | None = None
        self.extra: dict = {}

    def eta(self, f: float) -> float | None:
        return self.row_eta if self.row_eta is not None else super().eta(f)

    def snapshot(self) -> dict:
        return {**self.extra, "history": thin(list(self.history), self.MAX_HISTORY), "latest": self.latest}

    def report(self, **extra) -> None:
        """The run's results, written into record[section] now."""
        with self.lock:
            self.extra.update(extra)
        self.push()


@dataclass
class Done:
    """What a task body returns when the job succeeded: the last log line and the artifacts."""

    log: str
    artifacts: list[dict] = field(default_factory=list)


class Job:
    """One claimed execution of a job, as its task body sees it."""

    def __init__(self, rec: dict, progress: Progress, directory: Path):
        self.id, self.record, self.params = rec["id"], rec, rec["params"]
        self.attempt = rec["attempts"]
        self.progress = progress
        self.dir = directory
        self.cancel_note = "cancelled"  # the log line of a cancel that carries none
        self.end_artifacts: Callable[[], list[dict]] | None = None  # added to every ending's artifacts
        self._cancel_seen = threading.Event()
        self._stop = threading.Event()

    # -- cancel
    def cancelled(self) -> bool:
        if self._cancel_seen.is_set():
            return True
        try:
            return store.cancel_requested(self.id)
        except Exception:  # noqa: BLE001 - a Redis hiccup is not a cancel
            return False

    def check_cancel(self, note: str | None = None) -> None:
        """Between steps: raise Cancelled when the job was cancelled."""
        if self.cancelled():
            raise Cancelled(note or "")

    # -- progress
    def stage(self, name: str, fraction: float, log: str | None = None, est=None) -> None:
        self.progress.set(name, fraction, log, est)

    def say(self, log: str) -> None:
        self.progress.push(log)

    def ticker(self, stage: str, lo: float, hi: float, every_s: float) -> Callable[[float], None]:
        """A progress callback for a loop reporting its own fraction f in [0, 1]: checks the
        cancel flag, then moves the job from lo to hi within `stage`."""
        def tick(f: float) -> None:
            self.check_cancel()
            self.progress.advance(stage, lo + (hi - lo) * f, every_s, force=f >= 1.0)

        return tick

    # -- files
    def write_json(self, name: str, obj) -> Path:
        """name in the job's folder, written whole or not at all."""
        path, tmp = self.dir / name, self.dir / f"{name}.tmp"
        tmp.write_text(json.dumps(obj, ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)
        return path

    def done(self, log: str, *paths: Path) -> Done:
        return Done(log, [artifact(p) for p in paths])

    # -- the ending (JobTask writes it)
    def finish(self, state: str, log: str | None = None, artifacts: list[dict] | None = None, **fields) -> dict | None:
        arts = list(artifacts or [])
        if self.end_artifacts is not None:
            try:
                arts += self.end_artifacts()
            except Exception:  # noqa: BLE001 - extra files never change how a job ends
                pass
        if arts:
            fields["artifacts"] = arts

        def fn(rec):
            if not _own_running(rec, self.attempt):
                return None
            rec.update(fields, state=state, finished=time.time())
            if state == "succeeded":
                rec["progress"] = {"fraction": 1.0, "stage": "done", "eta_seconds": 0}
            else:
                rec["progress"]["stage"] = state
                rec["progress"]["eta_seconds"] = None
            if log:
                rec["log"].append(store.log_line(log))
            return rec

        return store.update(self.id, fn)

    # -- heartbeat thread
    def start_heartbeat(self) -> None:
        threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{self.id}", daemon=True).start()

    def _heartbeat_loop(self) -> None:
        every = config.heartbeat_every_s()
        while not self._stop.wait(every):
            try:
                heartbeat(self.id)
                if store.cancel_requested(self.id):
                    self._cancel_seen.set()
                self.progress.push()
            except Exception:  # noqa: BLE001 - a Redis hiccup must not kill the job
                pass

    def stop(self) -> None:
        self._stop.set()


class JobTask(Task):
    """The base of every job kind's Celery task (`@app.task(bind=True, base=JobTask, ...)`).

    Options a kind sets in its decorator: progress_cls (a Progress subclass for what it keeps in
    its record) and cancelled_by (exceptions of its library that mean "cancelled"). The message
    carries the job id; the body is called with the claimed Job and returns Done.
    """

    acks_late = True
    reject_on_worker_lost = True
    progress_cls: type[Progress] = Progress
    cancelled_by: tuple[type[BaseException], ...] = ()

    def start(self, job_id: str) -> Job | None:
        """Claim the record for this worker (None when a redelivered message has nothing left to
        do), make the job's folder, start its heartbeat."""
        rec = claim(job_id, getattr(self.request, "hostname", None) or "?")
        if rec is None:
            return None
        job = Job(rec, self.progress_cls(job_id, rec["attempts"]), config.job_dir(job_id))
        job.dir.mkdir(parents=True, exist_ok=True)
        job.start_heartbeat()
        return job

    def __call__(self, job_id: str) -> str:
        # the worker's tracer has pushed this execution's request (self.request) already
        job = self.start(job_id)
        if job is None:
            return "skipped"
        try:
            done = self.run(job)
            job.finish("succeeded", log=done.log, artifacts=done.artifacts)
            return "succeeded"
        except (Cancelled, *self.cancelled_by) as e:
            note = str(e) if isinstance(e, Cancelled) and str(e) else job.cancel_note
            job.finish("cancelled", log=note)
            return "cancelled"
        except Exception as e:  # noqa: BLE001 - the record gets one sentence
            msg = error_sentence(e)
            job.finish("failed", error=msg, log=f"failed: {msg}")
            if not isinstance(e, LmscopeError):
                raise  # unexpected: the worker log gets the traceback
            return "failed"
        finally:
            job.stop()
