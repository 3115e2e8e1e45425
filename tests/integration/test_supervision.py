"""Dead services get noticed: `lmscope serve`'s embedded Valkey and Celery worker are restarted when
they die, workers announce themselves with heartbeats, /healthz says which part is down, and a job
queued while no worker is alive says so. Real processes only: the embedded Valkey (with its
password), real Celery workers, a live `lmscope serve`."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import urllib.request
from pathlib import Path

import pytest
import redis

from tasks import services, store
from tests.helpers.browser import LiveServer, wait_until
from tests.helpers.services import LiveServices, free_port

pytestmark = pytest.mark.integration

SMALL = {"algorithm": "byte-level-bpe", "vocab_size": 300, "corpus_max_mb": 0.05}
FAST_JOBS = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "LMSCOPE_DEVICE": "cpu"}


@pytest.fixture
def no_redis_url():
    """REDIS_URL unset (the `make run` path), restored afterwards (ensure_services sets it in this process)."""
    saved = os.environ.pop("REDIS_URL", None)
    yield
    if saved is None:
        os.environ.pop("REDIS_URL", None)
    else:
        os.environ["REDIS_URL"] = saved


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def unauthenticated_ping(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"*1\r\n$4\r\nPING\r\n")
        return s.recv(128)


def beats(r) -> list[dict]:
    try:
        return store.worker_beats(r)
    except redis.RedisError:
        return []


def test_embedded_services_are_private_and_restarted(tmp_path, monkeypatch, no_redis_url):
    port = free_port()
    data = tmp_path / "data"
    monkeypatch.setenv("LMSCOPE_REDIS_PORT", str(port))
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(data))
    for k, v in FAST_JOBS.items():
        monkeypatch.setenv(k, v)
    h = services.ensure_services(data)
    pids = []
    try:
        # the URL file: this user only, with the data folder's password; the server wants it
        url_file = data / "redis.url"
        assert stat.S_IMODE(url_file.stat().st_mode) == 0o600
        assert stat.S_IMODE((data / "redis" / "password").stat().st_mode) == 0o600
        assert stat.S_IMODE((data / "redis" / "valkey.conf").stat().st_mode) == 0o600
        url = url_file.read_text().strip()
        password = services.redis_password(data)
        assert len(password) >= 32 and url == f"redis://:{password}@127.0.0.1:{port}/0" == h.redis_url
        assert "bind 127.0.0.1" in (data / "redis" / "valkey.conf").read_text()
        assert unauthenticated_ping(port).startswith(b"-NOAUTH")
        assert password not in " ".join(h.notes)
        r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=2, socket_connect_timeout=2)

        wait_until(lambda: [b["pid"] for b in beats(r)] == [h.worker_proc.pid], 60, "the worker's heartbeat")
        assert store.live_workers(r) == 1

        # kill -9 the worker: a new one runs and beats; the old one's pool process went with it
        old = h.worker_proc.pid
        pids.append(old)
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: h.worker_proc.pid != old and alive(h.worker_proc.pid)
                   and [b["pid"] for b in beats(r)] == [h.worker_proc.pid], 30, "a restarted worker's heartbeat")
        assert not alive(old) and group_members(old) == []
        assert h.restarts()["job worker"] == 1

        # kill -9 Valkey: it comes back, with the same password, and the worker is served again
        old_redis = h.redis_proc.pid
        pids.append(old_redis)
        os.kill(old_redis, signal.SIGKILL)
        wait_until(lambda: h.redis_proc.pid != old_redis and services._ping("127.0.0.1", port, password), 30,
                   "a restarted Valkey")
        assert unauthenticated_ping(port).startswith(b"-NOAUTH")
        assert services.redis_password(data) == password and url_file.read_text().strip() == url
        wait_until(lambda: store.live_workers(r) == 1, 30, "the worker's heartbeat after Valkey's restart")

        from tasks import jobs

        rec = jobs.submit("tokenizer", dict(SMALL), owner="t-supervised")
        assert "warning" not in rec
        done = jobs.wait_job(rec["id"], timeout=60, poll=0.1)
        assert done["state"] == "succeeded", (done, (data / "worker.log").read_text()[-3000:])
    finally:
        pids += [p.pid for p in (h.worker_proc, h.redis_proc) if p is not None]
        h.stop()
    # stop() ends the supervisor first (no restart) and then every child
    assert not h._thread.is_alive() and h.worker_proc is None and h.redis_proc is None
    assert [p for p in pids if alive(p) or group_members(p)] == []
    assert not services._ping("127.0.0.1", port, password)


def _health(server) -> dict:
    with urllib.request.urlopen(server.url + "healthz", timeout=5) as resp:
        assert resp.status == 200  # degraded or not: the web app itself answers
        return json.loads(resp.read())


def test_healthz_reports_a_dead_worker_until_it_is_restarted(tmp_path, monkeypatch):
    data = tmp_path / "data"
    port = free_port()
    monkeypatch.delenv("REDIS_URL", raising=False)  # LiveServer passes os.environ on: embedded services
    server = LiveServer(extra_env={"LMSCOPE_DATA_DIR": str(data), "LMSCOPE_REDIS_PORT": str(port),
                                   "LMSCOPE_DEFAULT_MODEL": "random-llama-tiny", **FAST_JOBS}, args=())
    started = []
    try:
        wait_until(lambda: _health(server) == {"status": "ok"}, 60, "/healthz ok")
        started.append(int((data / "redis" / "valkey.pid").read_text()))
        url = (data / "redis.url").read_text().strip()
        password = services.redis_password(data)
        r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=2, socket_connect_timeout=2)
        [beat] = beats(r)
        worker = beat["pid"]
        started.append(worker)
        assert int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1]) == server.proc.pid

        os.kill(worker, signal.SIGKILL)
        seen = {}

        def degraded():
            seen.update(_health(server))
            return seen["status"] == "degraded"

        wait_until(degraded, 30, "/healthz to report the dead worker")
        assert set(seen["down"]) == {"worker"}, seen
        text = json.dumps(seen)
        assert password not in text and "redis://" not in text and str(data) not in text
        assert seen["down"]["worker"].endswith(".") and seen["down"]["worker"].count(". ") == 0

        wait_until(lambda: _health(server) == {"status": "ok"}, 60, "/healthz ok after the restart")
        [beat] = beats(r)
        assert beat["pid"] != worker
        started.append(beat["pid"])
    finally:
        server.stop()
        try:  # lmscope serve stops its Valkey and worker when it stops; nothing may be left behind
            wait_until(lambda: not any(alive(p) for p in started), 30, "the server's children to end")
        finally:
            for p in started:
                if alive(p):
                    os.kill(p, signal.SIGKILL)


def test_job_queued_with_no_worker_says_so(tmp_path, monkeypatch):
    svc = LiveServices(tmp_path / "data")
    for k, v in svc.env().items():
        monkeypatch.setenv(k, v)
    svc.start_redis()  # Valkey only: no worker
    try:
        from tasks import jobs

        r = store.client()
        assert store.live_workers(r) == 0
        rec = jobs.submit("tokenizer", dict(SMALL), owner="t-no-worker")
        msg = "No job worker is running; the job will start when one does."
        got = jobs.get_job(rec["id"])
        assert rec["warning"] == got["warning"] == msg and got["state"] == "queued"
        assert any(line.endswith(msg) for line in got["log"])
    finally:
        svc.stop_redis()
