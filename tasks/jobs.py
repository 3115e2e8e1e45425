"""The job service used by the CLI, the UI and the tests: submit, list, show, cancel, wait.

Kinds come from the registry (tasks.kinds: each kind's validate, submit and Celery task); the
record's lifecycle (queue, claim, heartbeat, progress, cancel, ending) is tasks.lifecycle's. This
module imports no kind module.

Every read runs the reaper first, so a job whose worker was killed is reported as failed
("worker lost") at most LMSCOPE_JOB_STALE_SECONDS (default 30 s) after its last heartbeat.
"""

from __future__ import annotations

import time

from tasks import kinds, store
from tasks.lifecycle import JobError, artifact_path, check_rate, queue_client, read_json_artifact

__all__ = ["JobError", "artifact_path", "cancel_job", "check_rate", "get_job", "list_jobs", "read_report",
           "submit", "wait_job"]


def __getattr__(name: str):
    if name == "KINDS":  # the registered kinds (tasks.kinds), in the CLI's order
        return kinds.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def submit(kind: str, params: dict, owner: str = "cli", files=None) -> dict:
    """Validate, record and queue a job of a registered kind (tasks.kinds); one sentence and nothing
    queued on bad input. The hourly limit is checked when the job is queued, after its input: a bad
    upload gets its own sentence even while the queue is down or the limit is reached."""
    k = kinds.find(kind)
    if k is None:
        raise JobError(f"Unknown job kind '{kind}'; known: {', '.join(kinds.names())}.")
    return k.submit_job(params, owner, files)


def list_jobs(owner: str | None = None, limit: int = 100) -> list[dict]:
    r = queue_client()
    store.reap(r)
    return store.list_records(owner, limit, r)


def get_job(job_id: str, owner: str | None = None) -> dict:
    """The job's record; with `owner`, someone else's job is reported as missing (not revealed)."""
    r = queue_client()
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
    """A tokenizer job's report.json, or None."""
    return read_json_artifact(rec, "report.json")
