"""`lmscope worker`: a Celery worker in the foreground (run one per machine to add capacity)."""

from __future__ import annotations

import os
import socket


def worker_argv(concurrency: int = 1, loglevel: str = "INFO") -> list[str]:
    return ["worker", f"--loglevel={loglevel}", f"--concurrency={int(concurrency)}", "--pool=prefork",
            "-Q", "lmscope", "-n", f"lmscope-{os.getpid()}@{socket.gethostname()}",
            "--without-gossip", "--without-mingle"]


def run_worker(concurrency: int = 1) -> None:
    from tasks.celery_app import app

    app.worker_main(worker_argv(concurrency))
