"""The job service used by the CLI, the UI and the tests: submit, list, show, cancel, wait.

Every read runs the reaper first, so a job whose worker was killed is reported as failed
("worker lost") at most LMSCOPE_JOB_STALE_SECONDS (default 30 s) after its last heartbeat.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import redis

from model_core.errors import LmscopeError
from tasks import config, corpus, store
from tasks import tokenizer_train as tt

KINDS = ("tokenizer", "patching", "sft", "pretrain", "scaling", "neurons")


class JobError(LmscopeError):
    pass


def _r() -> redis.Redis:
    r = store.client()
    try:
        r.ping()
    except redis.RedisError:
        # never the URL itself: it can hold the server's password
        raise JobError("The job queue is not reachable; start it with `lmscope serve` (embedded) or set REDIS_URL."
                       ) from None
    return r


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
        def fail(x):
            x.update(state="failed", error=f"could not queue the job: {e}", finished=time.time())
            return x

        store.update(rec["id"], fail, r)
        raise JobError(f"Could not queue the job: {str(e).splitlines()[0]}") from None
    return rec


def submit_tokenizer(params: dict, owner: str = "cli", files: list[str | Path] | None = None) -> dict:
    """Validate, record and queue a tokenizer-training job. `params`: algorithm, vocab_size,
    min_frequency, special_tokens (list or comma string), corpus ('builtin' or 'upload'),
    corpus_max_mb (optional slice of the training corpus). `files`: uploaded .txt/.jsonl paths
    (then corpus = 'upload'). Raises a LmscopeError with one sentence for bad input; nothing is
    queued then."""
    p = tt.validate_params(params)
    files = [Path(f) for f in (files or [])]
    if p.get("corpus") not in (None, "builtin", "upload"):
        files.append(Path(p["corpus"]))
    if files:
        for f in files:
            corpus.check_upload(f)
        p["corpus"] = "upload"
        names = []
        for f in files:
            n = f.name
            while n in names:
                n = "_" + n
            names.append(n)
        p["corpus_files"] = names
    else:
        if p.get("corpus") == "upload":
            raise corpus.CorpusError("No corpus file was uploaded.")
        p["corpus"] = "builtin"
    r = _r()
    rec = store.new_record("tokenizer", p, owner)
    if files:
        inp = config.job_dir(rec["id"]) / "input"
        inp.mkdir(parents=True, exist_ok=True)
        for f, n in zip(files, p["corpus_files"]):
            shutil.copyfile(f, inp / n)
    from tasks.tokenizer_job import train_tokenizer

    enqueue(train_tokenizer, rec, r)
    return rec


def check_rate(owner: str) -> None:
    """LMSCOPE_JOBS_PER_HOUR (default 20; 0 = no limit) jobs per owner per hour; the CLI is exempt."""
    import os

    limit = int(os.environ.get("LMSCOPE_JOBS_PER_HOUR") or 20)
    if limit <= 0 or owner == "cli":
        return
    hour_ago = time.time() - 3600
    n = sum(1 for rec in store.list_records(owner, limit + 1, _r()) if rec.get("created", 0) >= hour_ago)
    if n >= limit:
        raise JobError(f"You have submitted {n} jobs in the last hour; the limit is {limit}. Try again later.")


def submit(kind: str, params: dict, owner: str = "cli", files=None) -> dict:
    check_rate(owner)
    if kind == "tokenizer":
        return submit_tokenizer(params, owner, files)
    if kind == "patching":  # activation-patching sweep: tasks/patching_job.py
        from tasks.patching_job import submit_patching

        return submit_patching(params, owner)
    if kind == "sft":  # supervised fine-tuning: tasks/sft_job.py
        from tasks.sft_job import submit_sft

        return submit_sft(params, owner, files)
    if kind in ("pretrain", "scaling"):  # training from scratch, one model or a sweep: tasks/pretrain_job.py
        from tasks.pretrain_job import submit_pretrain

        return submit_pretrain(kind, params, owner)
    if kind == "neurons":  # top-activating contexts of every neuron and head: tasks/neuron_job.py
        from tasks.neuron_job import submit_neurons

        return submit_neurons(params, owner)
    raise JobError(f"Unknown job kind '{kind}'; known: {', '.join(KINDS)}.")


def list_jobs(owner: str | None = None, limit: int = 100) -> list[dict]:
    r = _r()
    store.reap(r)
    return store.list_records(owner, limit, r)


def get_job(job_id: str, owner: str | None = None) -> dict:
    """The job's record; with `owner`, someone else's job is reported as missing (not revealed)."""
    r = _r()
    store.reap(r)
    rec = store.get(job_id, r)
    if rec is None or (owner is not None and rec.get("owner") != owner):
        raise JobError(f"No job with id '{job_id}'.")
    return rec


def cancel_job(job_id: str, owner: str | None = None) -> dict:
    """Cancel a queued job (it will never start) or a running one (cooperative flag between steps
    plus a revoke that terminates the worker's task process). Final jobs are left as they are.
    With `owner`, only that owner's job can be cancelled."""
    rec = get_job(job_id, owner)
    if rec["state"] in store.TERMINAL:
        return rec
    store.request_cancel(job_id)
    was = {}

    def fn(x):
        if x["state"] in store.TERMINAL:
            return None
        was["state"] = x["state"]
        x.update(state="cancelled", finished=time.time())
        x["progress"]["stage"] = "cancelled"
        x["progress"]["eta_seconds"] = None
        x["log"].append(store.log_line(f"cancelled by user (was {was['state']})"))
        return x

    out = store.update(job_id, fn)
    if out is not None:
        try:
            from tasks.celery_app import revoke

            revoke(job_id, terminate=was.get("state") == "running")
        except Exception:  # noqa: BLE001 - the flag and the record already stop it
            pass
    return get_job(job_id, owner)


def wait_job(job_id: str, timeout: float | None = None, poll: float = 0.5, on_update=None) -> dict:
    t0 = time.time()
    while True:
        rec = get_job(job_id)
        if on_update:
            on_update(rec)
        if rec["state"] in store.TERMINAL:
            return rec
        if timeout is not None and time.time() - t0 > timeout:
            raise JobError(f"Job {job_id} is still {rec['state']} after {timeout:.0f} s.")
        time.sleep(poll)


def read_report(rec: dict) -> dict | None:
    import json

    path = artifact_path(rec, "report.json")
    return json.loads(path.read_text(encoding="utf-8")) if path is not None else None


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
