"""Every lmscope setting, read from the environment in this module and nowhere else.

`Settings.from_env(environ)` reads and validates every variable at once and raises one
`SettingsError` (model_core.core.errors) whose message has one sentence per bad value. `current()` is
this process's Settings: read on first use and again only when one of the variables below changed
in os.environ (tests that monkeypatch the environment see their values). The top layers (app/cli,
app/main, tasks) read Settings once and pass values down; model_core functions take plain
parameters and fall back to `current()` only for a default.

| Variable | Default | Meaning |
|---|---|---|
| REDIS_URL | (unset) | Redis/Valkey for the job queue. Unset: `lmscope serve` starts an embedded Valkey. |
| LMSCOPE_REDIS_PORT | 6390 | Port of the embedded Valkey that `lmscope serve` / `make run` starts. |
| LMSCOPE_START_WORKER | 0 | 1: `lmscope serve` starts a job worker even when REDIS_URL is set. |
| LMSCOPE_DATA_DIR | ./data | Jobs, job artifacts, fine-tuned models, the embedded Redis's data. |
| LMSCOPE_CACHE_DIR | $XDG_CACHE_HOME/lmscope or ~/.cache/lmscope | Converted model weights. |
| LMSCOPE_DEVICE | cuda if present, else cpu | Where models load; `auto` spreads a model over every GPU. |
| LMSCOPE_DTYPE | bfloat16 on CUDA, else float32 | float32, bfloat16 or float16. |
| LMSCOPE_MAX_LOADED_MODELS | 3 | Models kept loaded in one process (least recently used dropped first). |
| LMSCOPE_DEFAULT_MODEL | smollm2-135m-instruct | The model the page opens with. |
| LMSCOPE_ALLOWED_MODELS | (all registry + fine-tuned) | Comma-separated names the server may load; nothing else. |
| LMSCOPE_MODELS | (unset) | The host's own checkpoints in every picker, as `lmscope models add` adds them: comma-separated `NAME=PATH` or `NAME=org/model`. |
| LMSCOPE_AUTH | off | Sign-in: `off`, `token` (one shared token, any user name) or `users` (users file). |
| LMSCOPE_AUTH_TOKEN | (unset) | The shared token for `LMSCOPE_AUTH=token`; also the Bearer token for /metrics. |
| LMSCOPE_USERS_FILE | (unset) | For `users`: lines `name:pbkdf2_sha256$iterations$salt$hash` (`python -m app.server.auth add-user NAME`). |
| LMSCOPE_LOGIN_MAX_FAILURES | 5 | Failed sign-ins per user name before it is locked. |
| LMSCOPE_LOGIN_MAX_FAILURES_PER_ADDRESS | 20 | Failed sign-ins per client address before it is locked. |
| LMSCOPE_LOGIN_WINDOW_S | 900 | A failure count is forgotten this long after its last failure. |
| LMSCOPE_LOGIN_LOCK_S | 1 | First lock; each further failure doubles it. |
| LMSCOPE_LOGIN_MAX_LOCK_S | 300 | Longest lock. |
| LMSCOPE_LOGIN_MAX_KEYS | 10000 | User names + addresses the sign-in throttle remembers at most. |
| LMSCOPE_MAX_PROMPT_TOKENS | 1024 | Longest prompt one request may trace or generate from. |
| LMSCOPE_MAX_NEW_TOKENS | 256 | Most tokens one generation request may produce. |
| LMSCOPE_MAX_CONCURRENT_PER_USER | 2 | Requests one user may have running at once. |
| LMSCOPE_JOBS_PER_HOUR | 20 | Background jobs one user may submit per hour (0 = no limit). |
| LMSCOPE_UPLOAD_MAX_MB | 20 | Largest upload (corpus file) in MB. |
| LMSCOPE_QUEUE_CONCURRENCY | 2 | Gradio queue: model requests running at once (the GPU's share). |
| LMSCOPE_GENERATE_CONCURRENCY | 16 | Generations streaming at once; their decode steps share batched forwards. |
| LMSCOPE_QUEUE_MAX | 64 | Gradio queue: requests waiting before new ones are turned away. |
| LMSCOPE_TRACE_CACHE_ITEMS | 16 | Traces the web app keeps server-side (least recently used dropped first). |
| LMSCOPE_MAX_BATCH | 32 | Rows of one generation step (engine slots) and traces per shared forward; 1 = no batching. |
| LMSCOPE_ENGINE | 1 | 0: generation runs each request's own forwards instead of the shared engine. |
| LMSCOPE_KV_CACHE_MB | (a quarter of free GPU memory, or 512 on a CPU) | Memory for the engine's preallocated KV slots (fewer slots than LMSCOPE_MAX_BATCH if it runs out). |
| LMSCOPE_ENGINE_THREADS | half the CPU cores (at least 1) | CPU: threads of the engine's own torch work (the rest of the cores serve the web side's traces and views). |
| LMSCOPE_COMPILE | on with CUDA | The engine's decode step compiled by torch.compile in the background (a few minutes once; the inductor cache keeps it) and re-captured, the uncompiled CUDA graphs serving meanwhile; 0: never; 1 on a CPU: compiled, no graphs. |
| LMSCOPE_RECORD_STEPS | 1 | CPU: the engine's decode steps and short prefills recorded as TorchScript traces in the background (the buckets a server's first users need right after start, others at first use; ~2 s each) and replayed, which holds the interpreter lock once per call instead of ~1,500 times; 0: always eager. |
| LMSCOPE_PATCH_TOKENS | 65536 on CUDA, else 1024 | Tokens per batch of an activation-patching sweep (rows = this / prompt length). |
| LMSCOPE_MODEL_PROCESS | auto | on: the Generation lab generates in a supervised model process; tcp://host:port: one started elsewhere; auto: on where models load on CUDA, off on a CPU. |
| LMSCOPE_MODEL_PROCESS_KEY | key file in the data folder | Hex key signing messages between the web process and a model process. |
| LMSCOPE_JOB_STALE_SECONDS | 30 | A running job whose worker sent no heartbeat for this long is marked failed ("worker lost"). |
| LMSCOPE_VISIBILITY_TIMEOUT | 21600 | Seconds before the broker redelivers an unacknowledged job message (longer than any job). |
| LMSCOPE_LOG_LEVEL | INFO | Lowest level of the log lines `lmscope serve`, the worker and the CLI write: DEBUG, INFO, WARNING, ERROR or CRITICAL. |

This module imports nothing heavy (no torch): the CLI, the web app and the worker all read it first.
`configure_logging(level)` is the one logging setup of those processes (they call it once, at start).
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from model_core.core.errors import SettingsError

__all__ = ["Settings", "SettingsError", "current", "configure_logging", "VARIABLES", "AUTH_MODES", "DTYPES",
           "DEFAULT_MODEL", "LOG_LEVELS", "LOG_FORMAT"]

DEFAULT_MODEL = "smollm2-135m-instruct"
AUTH_MODES = ("off", "token", "users")
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|meta|(cuda|xpu|hpu)(:\d+)?)$")

# Every variable this module reads (the table above, in order), plus XDG_CACHE_HOME for the cache
# folder's default. current() re-reads the environment when any of them changes.
VARIABLES = (
    "REDIS_URL", "LMSCOPE_REDIS_PORT", "LMSCOPE_START_WORKER", "LMSCOPE_DATA_DIR", "LMSCOPE_CACHE_DIR",
    "LMSCOPE_DEVICE", "LMSCOPE_DTYPE", "LMSCOPE_MAX_LOADED_MODELS", "LMSCOPE_DEFAULT_MODEL",
    "LMSCOPE_ALLOWED_MODELS", "LMSCOPE_MODELS", "LMSCOPE_AUTH", "LMSCOPE_AUTH_TOKEN", "LMSCOPE_USERS_FILE",
    "LMSCOPE_LOGIN_MAX_FAILURES", "LMSCOPE_LOGIN_MAX_FAILURES_PER_ADDRESS", "LMSCOPE_LOGIN_WINDOW_S",
    "LMSCOPE_LOGIN_LOCK_S", "LMSCOPE_LOGIN_MAX_LOCK_S", "LMSCOPE_LOGIN_MAX_KEYS",
    "LMSCOPE_MAX_PROMPT_TOKENS", "LMSCOPE_MAX_NEW_TOKENS", "LMSCOPE_MAX_CONCURRENT_PER_USER",
    "LMSCOPE_JOBS_PER_HOUR", "LMSCOPE_UPLOAD_MAX_MB", "LMSCOPE_QUEUE_CONCURRENCY",
    "LMSCOPE_GENERATE_CONCURRENCY", "LMSCOPE_QUEUE_MAX", "LMSCOPE_TRACE_CACHE_ITEMS", "LMSCOPE_MAX_BATCH",
    "LMSCOPE_ENGINE", "LMSCOPE_ENGINE_THREADS", "LMSCOPE_KV_CACHE_MB", "LMSCOPE_COMPILE", "LMSCOPE_RECORD_STEPS",
    "LMSCOPE_PATCH_TOKENS", "LMSCOPE_MODEL_PROCESS", "LMSCOPE_MODEL_PROCESS_KEY",
    "LMSCOPE_JOB_STALE_SECONDS", "LMSCOPE_VISIBILITY_TIMEOUT", "LMSCOPE_LOG_LEVEL",
)
_WATCHED = VARIABLES + ("XDG_CACHE_HOME",)


def _default_cache_dir(env) -> Path:
    base = (env.get("XDG_CACHE_HOME") or "").strip() or os.path.expanduser("~/.cache")
    return Path(base) / "lmscope"


@dataclass(frozen=True)
class Settings:
    # job queue and embedded services
    redis_url: str | None = None
    redis_port: int = 6390
    start_worker: bool = False
    # where things live
    data_dir: Path = Path("data")  # relative paths are taken from the working directory at use
    cache_dir: Path = field(default_factory=lambda: _default_cache_dir(os.environ))
    # models
    device: str | None = None  # None: cuda if present, else cpu
    dtype: str | None = None  # None: bfloat16 on CUDA, else float32
    max_loaded_models: int = 3
    default_model: str = DEFAULT_MODEL
    allowed_models: tuple[str, ...] | None = None
    host_models: tuple[tuple[str, str], ...] = ()  # (name, path or hub id) from LMSCOPE_MODELS
    # sign-in
    auth: str = "off"
    auth_token: str | None = None
    users_file: Path | None = None
    login_max_failures: int = 5
    login_max_failures_per_address: int = 20
    login_window_s: float = 900.0
    login_lock_s: float = 1.0
    login_max_lock_s: float = 300.0
    login_max_keys: int = 10_000
    # limits per request and per user
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 256
    max_concurrent_per_user: int = 2
    jobs_per_hour: int = 20
    upload_max_mb: float = 20.0
    # web server
    queue_concurrency: int = 2
    generate_concurrency: int = 16
    queue_max: int = 64
    trace_cache_items: int = 16
    # batching and the generation engine
    max_batch: int = 32
    engine: bool = True
    kv_cache_mb: int | None = None  # None: a quarter of free GPU memory, or 512 on a CPU
    engine_threads: int | None = None  # None: half the CPU cores, at least 1
    compile: bool | None = None  # None: on where the engine captures CUDA graphs
    record_steps: bool = True  # CPU engines: decode steps and prefills replayed from TorchScript recordings
    patch_tokens: int | None = None  # None: 65536 on CUDA, else 1024
    # where generations run: "off" (the web process), "on" (a model process `lmscope serve` starts and
    # restarts), or the tcp:// address of a model process started elsewhere
    model_process: str = "auto"
    model_process_key: str | None = None  # hex; the data folder's key file when unset
    # jobs
    job_stale_seconds: float = 30.0
    visibility_timeout_s: int = 6 * 3600
    # logging (configure_logging)
    log_level: str = "INFO"
    # which variables the environment set (e.g. an operator's LMSCOPE_MAX_PROMPT_TOKENS bounds
    # every model_core entry point; unset, only the app's own requests are capped)
    given: frozenset = field(default=frozenset(), compare=False, repr=False)

    @property
    def auth_on(self) -> bool:
        return self.auth != "off"

    @property
    def upload_max_bytes(self) -> int:
        return int(self.upload_max_mb * 1024 * 1024)

    @property
    def prompt_token_cap(self) -> int | None:
        """LMSCOPE_MAX_PROMPT_TOKENS where the environment set it, else None (no server-wide cap)."""
        return self.max_prompt_tokens if "LMSCOPE_MAX_PROMPT_TOKENS" in self.given else None

    @classmethod
    def from_env(cls, environ=None, *, check_files: bool = True) -> Settings:
        """Read and validate every setting from `environ` (default os.environ). check_files: also
        check that LMSCOPE_USERS_FILE exists (the web server at start; a job worker never reads it)."""
        env = os.environ if environ is None else environ
        errors: list[str] = []

        def s(name):
            v = env.get(name)
            return (v.strip() or None) if isinstance(v, str) else None

        def parsed(name, default, kind, what, in_range, bounds):
            """The variable read as `kind`, else `default` with one sentence in `errors`."""
            raw = s(name)
            if raw is None:
                return default
            try:
                v = kind(raw)
            except ValueError:
                errors.append(f"{name} must be {what}, not '{raw}'.")
                return default
            if not in_range(v):
                errors.append(f"{name} must be {bounds}, not {raw}.")
                return default
            return v

        def integer(name, default, lo, hi):
            return parsed(name, default, int, "a whole number", lambda v: lo <= v <= hi, f"between {lo} and {hi}")

        def number(name, default, lo, hi):
            return parsed(name, default, float, "a number", lambda v: math.isfinite(v) and lo < v <= hi,
                          f"more than {lo} and at most {hi}")

        def flag(name, default):
            raw = s(name)
            if raw is None:
                return default
            if raw not in ("0", "1"):
                errors.append(f"{name} must be 0 or 1, not '{raw}'.")
                return default
            return raw == "1"

        def path(name):
            raw = s(name)
            return Path(raw).expanduser() if raw else None

        redis_url = s("REDIS_URL")
        if redis_url and not redis_url.startswith(("redis://", "rediss://", "unix://")):
            errors.append(f"REDIS_URL must start with redis://, rediss:// or unix://, not '{redis_url}'.")
        device = s("LMSCOPE_DEVICE")
        if device and not _DEVICE_RE.match(device):
            errors.append(f"LMSCOPE_DEVICE must be cpu, cuda, cuda:N or auto, not '{device}'.")
            device = None
        dtype = s("LMSCOPE_DTYPE")
        if dtype and dtype not in DTYPES:
            errors.append(f"LMSCOPE_DTYPE must be float32, bfloat16 or float16, not '{dtype}'.")
            dtype = None
        allowed = s("LMSCOPE_ALLOWED_MODELS")
        allowed_t = tuple(m.strip() for m in allowed.split(",") if m.strip()) if allowed else None
        host_models = []
        for item in (s("LMSCOPE_MODELS") or "").split(","):
            if not item.strip():
                continue
            name, sep, source = (x.strip() for x in item.partition("="))
            if not sep or not name or not source:
                errors.append(f"LMSCOPE_MODELS takes NAME=PATH or NAME=org/model items, not '{item.strip()}'.")
            else:
                host_models.append((name, source))
        default_model = s("LMSCOPE_DEFAULT_MODEL")
        if default_model and allowed_t and default_model not in allowed_t:
            errors.append(f"LMSCOPE_DEFAULT_MODEL '{default_model}' is not in LMSCOPE_ALLOWED_MODELS.")
        auth = (s("LMSCOPE_AUTH") or "off").lower()
        if auth not in AUTH_MODES:
            errors.append(f"LMSCOPE_AUTH must be one of {', '.join(AUTH_MODES)}, not '{auth}'.")
            auth = "off"
        token = s("LMSCOPE_AUTH_TOKEN")
        if auth == "token" and (not token or len(token) < 8):
            errors.append("LMSCOPE_AUTH=token needs LMSCOPE_AUTH_TOKEN of at least 8 characters.")
        users = s("LMSCOPE_USERS_FILE")
        if auth == "users":
            if not users:
                errors.append("LMSCOPE_AUTH=users needs LMSCOPE_USERS_FILE (make one with "
                              "`python -m app.server.auth add-user NAME`).")
            elif check_files and not Path(users).expanduser().is_file():
                errors.append(f"LMSCOPE_USERS_FILE {users} does not exist.")
        patch_tokens = integer("LMSCOPE_PATCH_TOKENS", 0, 0, 100_000_000)
        log_level = (s("LMSCOPE_LOG_LEVEL") or "INFO").upper()
        if log_level not in LOG_LEVELS:
            errors.append(f"LMSCOPE_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, not '{s('LMSCOPE_LOG_LEVEL')}'.")
            log_level = "INFO"
        model_process = (s("LMSCOPE_MODEL_PROCESS") or "auto").lower()
        if model_process in ("0", "false", "no"):
            model_process = "off"
        if model_process in ("1", "true", "yes"):
            model_process = "on"
        if model_process not in ("auto", "off", "on") and not re.fullmatch(r"tcp://[^\s/]+:\d{1,5}", model_process):
            errors.append(f"LMSCOPE_MODEL_PROCESS must be auto, off, on or tcp://host:port, not '{s('LMSCOPE_MODEL_PROCESS')}'.")
            model_process = "auto"
        process_key = s("LMSCOPE_MODEL_PROCESS_KEY")
        if process_key is not None and not re.fullmatch(r"(?:[0-9a-fA-F]{2}){16,}", process_key):
            errors.append("LMSCOPE_MODEL_PROCESS_KEY must be at least 32 hexadecimal digits "
                          "(e.g. from `openssl rand -hex 32`).")
            process_key = None
        kv_mb = integer("LMSCOPE_KV_CACHE_MB", 0, 1, 10_000_000) if s("LMSCOPE_KV_CACHE_MB") else 0
        out = cls(
            redis_url=redis_url,
            redis_port=integer("LMSCOPE_REDIS_PORT", 6390, 1, 65535),
            start_worker=flag("LMSCOPE_START_WORKER", False),
            data_dir=path("LMSCOPE_DATA_DIR") or Path("data"),
            cache_dir=path("LMSCOPE_CACHE_DIR") or _default_cache_dir(env),
            device=device,
            dtype=dtype,
            max_loaded_models=integer("LMSCOPE_MAX_LOADED_MODELS", 3, 1, 1000),
            default_model=default_model or DEFAULT_MODEL,
            allowed_models=allowed_t, host_models=tuple(host_models),
            auth=auth,
            auth_token=token,
            users_file=Path(users).expanduser() if users else None,
            login_max_failures=integer("LMSCOPE_LOGIN_MAX_FAILURES", 5, 1, 1_000_000),
            login_max_failures_per_address=integer("LMSCOPE_LOGIN_MAX_FAILURES_PER_ADDRESS", 20, 1, 1_000_000),
            login_window_s=number("LMSCOPE_LOGIN_WINDOW_S", 900.0, 0, 10**9),
            login_lock_s=number("LMSCOPE_LOGIN_LOCK_S", 1.0, 0, 10**9),
            login_max_lock_s=number("LMSCOPE_LOGIN_MAX_LOCK_S", 300.0, 0, 10**9),
            login_max_keys=integer("LMSCOPE_LOGIN_MAX_KEYS", 10_000, 1, 10**9),
            max_prompt_tokens=integer("LMSCOPE_MAX_PROMPT_TOKENS", 1024, 1, 1_000_000),
            max_new_tokens=integer("LMSCOPE_MAX_NEW_TOKENS", 256, 1, 100_000),
            max_concurrent_per_user=integer("LMSCOPE_MAX_CONCURRENT_PER_USER", 2, 1, 1000),
            jobs_per_hour=integer("LMSCOPE_JOBS_PER_HOUR", 20, 0, 100_000),
            upload_max_mb=number("LMSCOPE_UPLOAD_MAX_MB", 20.0, 0, 100_000),
            queue_concurrency=integer("LMSCOPE_QUEUE_CONCURRENCY", 2, 1, 256),
            generate_concurrency=integer("LMSCOPE_GENERATE_CONCURRENCY", 16, 1, 256),
            queue_max=integer("LMSCOPE_QUEUE_MAX", 64, 1, 100_000),
            trace_cache_items=integer("LMSCOPE_TRACE_CACHE_ITEMS", 16, 1, 100_000),
            max_batch=integer("LMSCOPE_MAX_BATCH", 32, 1, 1024),
            engine=flag("LMSCOPE_ENGINE", True),
            kv_cache_mb=kv_mb or None,
            engine_threads=integer("LMSCOPE_ENGINE_THREADS", 0, 0, 4096) or None,
            compile=flag("LMSCOPE_COMPILE", None),
            record_steps=flag("LMSCOPE_RECORD_STEPS", True),
            patch_tokens=patch_tokens or None,
            model_process=model_process, model_process_key=process_key,
            job_stale_seconds=number("LMSCOPE_JOB_STALE_SECONDS", 30.0, 0, 10**7),
            visibility_timeout_s=integer("LMSCOPE_VISIBILITY_TIMEOUT", 6 * 3600, 1, 10**8),
            log_level=log_level,
            given=frozenset(n for n in VARIABLES if s(n) is not None),
        )
        if errors:
            raise SettingsError(" ".join(errors))
        return out


_current: tuple[tuple, Settings] | None = None
_current_lock = threading.Lock()


def _fingerprint() -> tuple:
    env = os.environ
    return tuple(map(env.get, _WATCHED))


def current() -> Settings:
    """This process's settings: read from os.environ on first use and again whenever one of the
    variables changed. Raises SettingsError (one sentence per bad value) when one is bad. Never
    checks that files exist: a job worker may not see the web server's users file."""
    global _current
    fp = _fingerprint()
    cached = _current
    if cached is not None and cached[0] == fp:
        return cached[1]
    with _current_lock:
        s = Settings.from_env({n: v for n, v in zip(_WATCHED, fp) if v is not None}, check_files=False)
        _current = (fp, s)
        return s


# ---- logging ------------------------------------------------------------------------------

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # one line per event


class _Handler(logging.StreamHandler):
    """The stderr handler configure_logging installs (and a later call replaces)."""


def configure_logging(level: str | int = "INFO", fmt: str = LOG_FORMAT) -> None:
    """Send every logger's lines at `level` and above to stderr, formatted as `fmt` (default: time,
    level, logger, message). Called once by each process that reports to a person: `lmscope serve`
    and the CLI (app/server/cli.py), the Celery worker (tasks/celery_app.py); modules only call
    logging.getLogger(__name__). A second call replaces the handler of the first, and leaves other
    handlers alone; the new one writes to the sys.stderr of *now* (the tests run the CLI in-process
    under a captured stderr)."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(h)
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level)
