"""Job records in Redis: one JSON document per job, indexed by time and by owner.

Keys (prefix lmscope:):
  job:<id>            JSON record (fields below)
  jobs                sorted set of ids by creation time
  jobs:owner:<owner>  same, per owner
  jobs:active         set of ids in state queued|running (what the reaper scans)
  job:<id>:cancel     cancel flag, checked by the running task between steps
  job:<id>:hb         heartbeat "time pid host" written by the running task
  worker:<node name>  a live Celery worker's heartbeat (JSON: node, pid, host, time), set every
                      config.WORKER_BEAT_EVERY_S with a time-to-live of config.WORKER_BEAT_TTL_S

Record: id, kind, params, owner, state (queued|running|succeeded|failed|cancelled),
progress {fraction, stage, eta_seconds}, log [lines], error, artifacts [{name, path, bytes}],
created, started, finished (unix seconds), attempts, worker, heartbeat.
Every write is a WATCH/MULTI transaction, so the worker's progress updates, a cancel from the UI
and the reaper never overwrite each other; final-state writes are conditional.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable

import redis

from tasks import config

P = config.KEY_PREFIX
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = ("succeeded", "failed", "cancelled")
MAX_LOG_LINES = 400

_clients: dict[str, redis.Redis] = {}


def client(url: str | None = None) -> redis.Redis:
    url = url or config.redis_url()
    c = _clients.get(url)
    if c is None:
        c = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=3, socket_timeout=10,
                                 health_check_interval=30)
        _clients[url] = c
    return c


def probe_client(url: str | None = None, timeout: float = 0.5) -> redis.Redis:
    """A client for health checks and metrics: short timeouts, no retries (a dead server answers
    within `timeout`), str replies."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url or config.redis_url(), decode_responses=True, socket_timeout=timeout,
                                socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))


def _k(*parts: str) -> str:
    return P + ":".join(parts)


def new_record(kind: str, params: dict, owner: str) -> dict:
    now = time.time()
    return {
        "id": uuid.uuid4().hex[:12],
        "kind": kind,
        "params": params,
        "owner": owner or "anonymous",
        "state": "queued",
        "progress": {"fraction": 0.0, "stage": "queued", "eta_seconds": None},
        "log": [f"{time.strftime('%H:%M:%S', time.localtime(now))} queued"],
        "error": None,
        "artifacts": [],
        "created": now,
        "started": None,
        "finished": None,
        "attempts": 0,
        "worker": None,
        "heartbeat": None,
    }


def create(rec: dict, r: redis.Redis | None = None) -> dict:
    r = r or client()
    with r.pipeline() as p:
        p.set(_k("job", rec["id"]), json.dumps(rec))
        p.zadd(_k("jobs"), {rec["id"]: rec["created"]})
        p.zadd(_k("jobs", "owner", rec["owner"]), {rec["id"]: rec["created"]})
        p.sadd(_k("jobs", "active"), rec["id"])
        p.execute()
    return rec


def _attach_heartbeat(r: redis.Redis, rec: dict) -> dict:
    if rec["state"] == "running":
        hb = r.get(_k("job", rec["id"], "hb"))
        if hb:
            t, pid, host = hb.split(" ", 2)
            rec["heartbeat"] = float(t)
            rec["worker"] = rec.get("worker") or {"pid": int(pid), "host": host}
    return rec


def get(job_id: str, r: redis.Redis | None = None) -> dict | None:
    r = r or client()
    raw = r.get(_k("job", job_id))
    if raw is None:
        return None
    return _attach_heartbeat(r, json.loads(raw))


def update(job_id: str, fn: Callable[[dict], dict | None], r: redis.Redis | None = None) -> dict | None:
    """Apply fn to the record atomically. fn mutates/returns the record, or returns None to skip
    the write (e.g. the job already reached a final state). Returns the written record or None."""
    r = r or client()
    key = _k("job", job_id)
    while True:
        with r.pipeline() as p:
            try:
                p.watch(key)
                raw = p.get(key)
                if raw is None:
                    p.unwatch()
                    return None
                rec = fn(json.loads(raw))
                if rec is None:
                    p.unwatch()
                    return None
                rec["log"] = rec["log"][-MAX_LOG_LINES:]
                p.multi()
                p.set(key, json.dumps(rec))
                if rec["state"] in TERMINAL:
                    p.srem(_k("jobs", "active"), job_id)
                    p.delete(_k("job", job_id, "hb"))
                p.execute()
                return rec
            except redis.WatchError:
                continue


def log_line(msg: str) -> str:
    return f"{time.strftime('%H:%M:%S')} {msg}"


def list_ids(owner: str | None = None, limit: int = 100, r: redis.Redis | None = None) -> list[str]:
    r = r or client()
    key = _k("jobs", "owner", owner) if owner else _k("jobs")
    return r.zrevrange(key, 0, max(0, limit - 1))


def list_records(owner: str | None = None, limit: int = 100, r: redis.Redis | None = None) -> list[dict]:
    r = r or client()
    ids = list_ids(owner, limit, r)
    if not ids:
        return []
    raws = r.mget([_k("job", i) for i in ids])
    return [_attach_heartbeat(r, json.loads(x)) for x in raws if x]


def active_ids(r: redis.Redis | None = None) -> list[str]:
    return sorted((r or client()).smembers(_k("jobs", "active")))


# ---- cancel flag and heartbeat ------------------------------------------------------------

def request_cancel(job_id: str, r: redis.Redis | None = None) -> None:
    (r or client()).set(_k("job", job_id, "cancel"), "1", ex=7 * 24 * 3600)


def cancel_requested(job_id: str, r: redis.Redis | None = None) -> bool:
    return bool((r or client()).exists(_k("job", job_id, "cancel")))


def beat(job_id: str, r: redis.Redis | None = None) -> None:
    (r or client()).set(_k("job", job_id, "hb"), f"{time.time():.3f} {os.getpid()} {socket.gethostname()}",
                        ex=24 * 3600)


def heartbeat_of(job_id: str, r: redis.Redis | None = None) -> tuple[float, int, str] | None:
    hb = (r or client()).get(_k("job", job_id, "hb"))
    if not hb:
        return None
    t, pid, host = hb.split(" ", 2)
    return float(t), int(pid), host


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def heartbeat_dead(job_id: str, r: redis.Redis | None = None, stale_after: float | None = None,
                   check_pid: bool = True) -> str | None:
    """Why the running execution of job_id is gone, or None if it may still be alive.
    check_pid: also count a dead process on this host (used by a redelivered task to take over
    at once; the reaper only trusts the heartbeat age, so a redelivery gets to retry first)."""
    stale_after = config.stale_after_s() if stale_after is None else stale_after
    hb = heartbeat_of(job_id, r)
    rec = get(job_id, r)
    if rec is None or rec["state"] != "running":
        return None
    if hb is None:
        started = rec.get("started") or rec["created"]
        if time.time() - started > stale_after:
            return f"no heartbeat for {stale_after:.0f} s"
        return None
    t, pid, host = hb
    if check_pid and host == socket.gethostname() and not pid_alive(pid):
        return f"worker process {pid} died"
    if time.time() - t > stale_after:
        return f"no heartbeat for {stale_after:.0f} s"
    return None


def reap(r: redis.Redis | None = None, stale_after: float | None = None) -> list[str]:
    """Mark running jobs whose heartbeat is older than stale_after (default
    LMSCOPE_JOB_STALE_SECONDS=30 s) as failed: "worker lost". Returns their ids. A task process
    killed under a live worker is redelivered (reject_on_worker_lost) and retried well before that."""
    r = r or client()
    reaped = []
    for job_id in active_ids(r):
        why = heartbeat_dead(job_id, r, stale_after, check_pid=False)
        if why is None:
            continue

        def fail(rec, why=why):
            if rec["state"] != "running":
                return None
            rec["state"] = "failed"
            rec["error"] = f"worker lost ({why})"
            rec["finished"] = time.time()
            rec["progress"]["stage"] = "failed"
            rec["progress"]["eta_seconds"] = None
            rec["log"].append(log_line(f"failed: worker lost ({why})"))
            return rec

        if update(job_id, fail, r) is not None:
            reaped.append(job_id)
    return reaped


# ---- live workers ---------------------------------------------------------------------------

def worker_key(node: str) -> str:
    return _k("worker", node)


def worker_beat(node: str, r: redis.Redis, ttl: float | None = None) -> None:
    """The worker `node` is alive (called by its main process every WORKER_BEAT_EVERY_S)."""
    doc = {"node": node, "pid": os.getpid(), "host": socket.gethostname(), "time": round(time.time(), 3)}
    r.set(worker_key(node), json.dumps(doc), ex=int(ttl or config.WORKER_BEAT_TTL_S))


def worker_gone(node: str, r: redis.Redis) -> None:
    r.delete(worker_key(node))


def worker_beats(r: redis.Redis) -> list[dict]:
    """The heartbeats of the workers alive now (any client: str or bytes replies)."""
    keys = list(r.scan_iter(match=_k("worker", "*"), count=1000))
    out = []
    for raw in (r.mget(keys) if keys else []):
        if raw:
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
    return out


def live_workers(r: redis.Redis) -> int:
    """How many Celery workers sent a heartbeat within their time-to-live."""
    return sum(1 for _ in r.scan_iter(match=_k("worker", "*"), count=1000))


# ---- what an operator sees (/metrics) --------------------------------------------------------

def overview(r: redis.Redis | None = None, queue: str | None = None, recent: int = 1000) -> dict:
    """The newest `recent` jobs counted by state, how many are queued or running, the live workers
    and, given the Celery queue's name, the messages waiting in it (any client: str or bytes)."""
    r = r or client()
    ids = [i.decode() if isinstance(i, bytes) else i for i in r.zrange(_k("jobs"), -recent, -1)]
    by_state: dict[str, int] = {}
    for raw in (r.mget([_k("job", i) for i in ids]) if ids else []):
        if raw:
            try:
                st = json.loads(raw).get("state", "unknown")
            except ValueError:
                st = "unknown"
            by_state[st] = by_state.get(st, 0) + 1
    out = {"by_state": by_state, "active": int(r.scard(_k("jobs", "active"))), "live_workers": live_workers(r)}
    if queue:
        out["queue_length"] = int(r.llen(queue))
    return out
