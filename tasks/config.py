"""Where the job queue lives, and the knobs for jobs, all from model_core.core.settings (this process's
Settings; the worker never imports app).

Broker URL: REDIS_URL if set, else the URL the embedded server wrote to <data dir>/redis.url
(`lmscope serve` / `make run` start it), else the embedded server's default address.
"""

from __future__ import annotations

from pathlib import Path

from model_core.core import paths, settings

DEFAULT_EMBEDDED_PORT = settings.Settings.redis_port  # the dataclass field's default
KEY_PREFIX = "lmscope:"


def embedded_port() -> int:
    """LMSCOPE_REDIS_PORT (default 6390)."""
    return settings.current().redis_port


def url_file(data_dir: Path | None = None) -> Path:
    return Path(data_dir or paths.data_dir()) / "redis.url"


def password_file(data_dir: Path | None = None) -> Path:
    """The embedded server's password (generated once per data folder, mode 0600)."""
    return Path(data_dir or paths.data_dir()) / "redis" / "password"


def redis_url() -> str:
    url = settings.current().redis_url
    if url:
        return url
    f = url_file()
    if f.exists():
        text = f.read_text().strip()
        if text:
            return text
    return f"redis://127.0.0.1:{embedded_port()}/0"


def jobs_dir() -> Path:
    p = paths.data_dir() / "jobs"
    p.mkdir(parents=True, exist_ok=True)
    return p


def job_dir(job_id: str) -> Path:
    return jobs_dir() / job_id


def stale_after_s() -> float:
    """A running job whose heartbeat is older than this is declared lost (worker killed)."""
    return settings.current().job_stale_seconds


def heartbeat_every_s() -> float:
    return max(0.2, min(5.0, stale_after_s() / 6))


def upload_max_bytes() -> int:
    return settings.current().upload_max_bytes


# Every Celery worker process (its main process) sets lmscope:worker:<node name> this often, with a
# time-to-live of WORKER_BEAT_TTL_S: a killed worker stops counting as live within that long.
WORKER_BEAT_EVERY_S = 2.0
WORKER_BEAT_TTL_S = 6


# Longer than any job may run: an unacked message (acks_late) is only redelivered after this
# long. Lost workers are detected much sooner by the heartbeat reaper, not by redelivery.
# (LMSCOPE_VISIBILITY_TIMEOUT, read when the Celery app is configured)
VISIBILITY_TIMEOUT_S = settings.current().visibility_timeout_s
