"""One settings object for a hosted lmscope, read from environment variables.

Every setting, its variable, default and meaning:

| Variable | Default | Meaning |
|---|---|---|
| REDIS_URL | (unset) | Redis/Valkey for the job queue. Unset: `lmscope serve` starts an embedded Valkey. |
| LMSCOPE_DATA_DIR | ~/.local/share/lmscope | Jobs, fine-tuned models, the embedded Redis's data. |
| LMSCOPE_CACHE_DIR | (model_core default) | Converted model weights (safetensors cache). |
| LMSCOPE_DEFAULT_MODEL | smollm2-135m-instruct | The model the page opens with. |
| LMSCOPE_ALLOWED_MODELS | (all registry + fine-tuned) | Comma-separated names the server may load; nothing else. |
| LMSCOPE_AUTH | off | Sign-in: `off`, `token` (one shared token, any user name) or `users` (users file). |
| LMSCOPE_AUTH_TOKEN | (unset) | The shared token for `LMSCOPE_AUTH=token`; also the Bearer token for /metrics. |
| LMSCOPE_USERS_FILE | (unset) | For `users`: lines `name:pbkdf2_sha256$iterations$salt$hash` (`python -m app.auth add-user NAME`). |
| LMSCOPE_MAX_PROMPT_TOKENS | 1024 | Longest prompt one request may trace or generate from. |
| LMSCOPE_MAX_NEW_TOKENS | 256 | Most tokens one generation request may produce. |
| LMSCOPE_MAX_CONCURRENT_PER_USER | 2 | Requests one user may have running at once. |
| LMSCOPE_JOBS_PER_HOUR | 20 | Background jobs one user may submit per hour (0 = no limit). |
| LMSCOPE_UPLOAD_MAX_MB | 20 | Largest upload (corpus file) in MB. |
| LMSCOPE_QUEUE_CONCURRENCY | 2 | Gradio queue: model requests running at once (the GPU's share). |
| LMSCOPE_GENERATE_CONCURRENCY | 16 | Generations streaming at once; their decode steps share batched forwards. |
| LMSCOPE_MAX_BATCH | 32 | Rows of one generation step (engine slots) and traces per shared forward; 1 = no batching. |
| LMSCOPE_QUEUE_MAX | 64 | Gradio queue: requests waiting before new ones are turned away. |
| LMSCOPE_KV_CACHE_MB | (a quarter of free GPU memory, or 512 on a CPU) | Memory for the engine's preallocated KV slots (fewer slots than LMSCOPE_MAX_BATCH if it runs out). |
| LMSCOPE_COMPILE | 0 | 1: compile the engine's decode step with torch.compile before capturing it (CUDA; ~30 s per batch bucket at start). |

`Settings.from_env()` validates everything at once and raises `SettingsError` whose message has one
sentence per bad value.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from model_core.errors import LmscopeError

AUTH_MODES = ("off", "token", "users")


class SettingsError(LmscopeError):
    pass


@dataclass(frozen=True)
class Settings:
    redis_url: str | None = None
    data_dir: Path | None = None
    cache_dir: Path | None = None
    default_model: str | None = None
    allowed_models: tuple[str, ...] | None = None
    auth: str = "off"
    auth_token: str | None = None
    users_file: Path | None = None
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 256
    max_concurrent_per_user: int = 2
    jobs_per_hour: int = 20
    upload_max_mb: float = 20.0
    queue_concurrency: int = 2
    generate_concurrency: int = 16
    max_batch: int = 32
    queue_max: int = 64
    kv_cache_mb: int | None = None
    compile: bool = False

    @property
    def auth_on(self) -> bool:
        return self.auth != "off"

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Settings":
        env = os.environ if env is None else env
        errors: list[str] = []

        def s(name):
            v = env.get(name, "")
            return v.strip() or None

        def integer(name, default, lo, hi):
            raw = s(name)
            if raw is None:
                return default
            try:
                v = int(raw)
            except ValueError:
                errors.append(f"{name} must be a whole number, not '{raw}'.")
                return default
            if not lo <= v <= hi:
                errors.append(f"{name} must be between {lo} and {hi}, not {v}.")
                return default
            return v

        def number(name, default, lo, hi):
            raw = s(name)
            if raw is None:
                return default
            try:
                v = float(raw)
            except ValueError:
                errors.append(f"{name} must be a number, not '{raw}'.")
                return default
            if not math.isfinite(v) or not lo < v <= hi:
                errors.append(f"{name} must be more than {lo} and at most {hi}, not {raw}.")
                return default
            return v

        redis_url = s("REDIS_URL")
        if redis_url and not redis_url.startswith(("redis://", "rediss://", "unix://")):
            errors.append(f"REDIS_URL must start with redis://, rediss:// or unix://, not '{redis_url}'.")
        allowed = s("LMSCOPE_ALLOWED_MODELS")
        allowed_t = tuple(m.strip() for m in allowed.split(",") if m.strip()) if allowed else None
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
                              "`python -m app.auth add-user NAME`).")
            elif not Path(users).is_file():
                errors.append(f"LMSCOPE_USERS_FILE {users} does not exist.")
        out = cls(
            redis_url=redis_url,
            data_dir=Path(s("LMSCOPE_DATA_DIR")).expanduser() if s("LMSCOPE_DATA_DIR") else None,
            cache_dir=Path(s("LMSCOPE_CACHE_DIR")).expanduser() if s("LMSCOPE_CACHE_DIR") else None,
            default_model=s("LMSCOPE_DEFAULT_MODEL"),
            allowed_models=allowed_t,
            auth=auth,
            auth_token=token,
            users_file=Path(users) if users else None,
            max_prompt_tokens=integer("LMSCOPE_MAX_PROMPT_TOKENS", 1024, 1, 1_000_000),
            max_new_tokens=integer("LMSCOPE_MAX_NEW_TOKENS", 256, 1, 100_000),
            max_concurrent_per_user=integer("LMSCOPE_MAX_CONCURRENT_PER_USER", 2, 1, 1000),
            jobs_per_hour=integer("LMSCOPE_JOBS_PER_HOUR", 20, 0, 100_000),
            upload_max_mb=number("LMSCOPE_UPLOAD_MAX_MB", 20.0, 0, 100_000),
            queue_concurrency=integer("LMSCOPE_QUEUE_CONCURRENCY", 2, 1, 256),
            generate_concurrency=integer("LMSCOPE_GENERATE_CONCURRENCY", 16, 1, 256),
            max_batch=integer("LMSCOPE_MAX_BATCH", 32, 1, 1024),
            queue_max=integer("LMSCOPE_QUEUE_MAX", 64, 1, 100_000),
            kv_cache_mb=integer("LMSCOPE_KV_CACHE_MB", 512, 1, 10_000_000) if s("LMSCOPE_KV_CACHE_MB") else None,
            compile=(s("LMSCOPE_COMPILE") or "0") == "1",
        )
        if (s("LMSCOPE_COMPILE") or "0") not in ("0", "1"):
            errors.append(f"LMSCOPE_COMPILE must be 0 or 1, not '{s('LMSCOPE_COMPILE')}'.")
        if out.default_model and allowed_t and out.default_model not in allowed_t:
            errors.append(f"LMSCOPE_DEFAULT_MODEL '{out.default_model}' is not in LMSCOPE_ALLOWED_MODELS.")
        if errors:
            raise SettingsError(" ".join(errors))
        return out


def load() -> Settings:
    return Settings.from_env()
