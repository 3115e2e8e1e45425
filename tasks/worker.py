"""`lmscope worker`: a Celery worker in the foreground (run one per machine to add capacity).

The worker is its own process and never imports app: its settings are model_core.core.settings'
(checked here at start; jobs read the same Settings through settings.current()). Its logging is
configured once, by tasks.celery_app's setup_logging receiver, at the level --loglevel gives Celery
(LMSCOPE_LOG_LEVEL: worker_argv passes it)."""

from __future__ import annotations

import os
import socket


def worker_argv(concurrency: int = 1, loglevel: str | None = None) -> list[str]:
    """Celery's worker arguments; loglevel None: LMSCOPE_LOG_LEVEL (this process's settings)."""
    if loglevel is None:
        from model_core.core import settings

        loglevel = settings.current().log_level
    return ["worker", f"--loglevel={loglevel}", f"--concurrency={int(concurrency)}", "--pool=prefork",
            "-Q", "lmscope", "-n", f"lmscope-{os.getpid()}@{socket.gethostname()}",
            "--without-gossip", "--without-mingle"]


def run_worker(concurrency: int = 1, settings=None) -> None:
    """settings: the Settings app/server/cli.py read and checked; None: check this process's now (a bad
    value raises SettingsError, one sentence each, before the worker takes any job)."""
    from model_core.core import settings as settings_mod

    if settings is None:
        settings = settings_mod.current()
    from tasks.celery_app import app

    app.worker_main(worker_argv(concurrency, settings.log_level))
