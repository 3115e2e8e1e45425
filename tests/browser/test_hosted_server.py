"""Live `lmscope serve` with sign-in: operator endpoints, the API client's credentials, two users'
generations sharing forwards, the login page, and the sign-in throttle on a live server (its unit
tests with an injected clock are tests/unit/test_auth.py)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from app.server import auth

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
        with page.expect_response(lambda r: r.request.method == "POST" and "/login" in r.url) as refused:
            page.locator("button", has_text="Login").click()
        assert refused.value.status == 400  # the server's answer came back: wrong credentials, not signed in
        assert page.locator("#run").count() == 0
        page.locator("input[type=text], input:not([type])").first.fill("alice")
        page.locator("input[type=password]").fill("alice-password")
        page.locator("button", has_text="Login").click()
        page.wait_for_selector("#run", timeout=60_000)
        screenshot(page, "hosted-signed-in")
        browser.close()


# ----------------------------------------------------------------------------- sign-in throttle, live

def _post_login(url, user, pw):
    data = urllib.parse.urlencode({"username": user, "password": pw}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "login", data=data), timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.browser
def test_live_login_throttle(tmp_path):
    from tests.helpers.browser import LiveServer

    users = tmp_path / "users.txt"
    auth.write_user(users, "alice", "alice-password", iterations=20_000)
    auth.write_user(users, "bob", "bob-password", iterations=20_000)
    s = LiveServer(extra_env={"LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(users),
                              "LMSCOPE_DATA_DIR": str(tmp_path / "data"), "REDIS_URL": "redis://127.0.0.1:1/0",
                              "LMSCOPE_LOGIN_LOCK_S": "2", "LMSCOPE_LOGIN_MAX_FAILURES_PER_ADDRESS": "8"})
    try:
        assert _post_login(s.url, "alice", "alice-password")[0] == 200
        codes = [_post_login(s.url, "alice", "wrong-password") for _ in range(6)]
        assert [c for c, _ in codes] == [400] * 5 + [429], codes
        assert json.loads(codes[-1][1])["detail"].startswith("Too many failed sign-ins for this account; try again in")
        t_locked = time.monotonic()
        assert _post_login(s.url, "alice", "alice-password")[0] == 429  # even the right password
        time.sleep(max(0.0, 2.2 - (time.monotonic() - t_locked)))
        assert _post_login(s.url, "alice", "alice-password")[0] == 200  # lock over; the count is cleared
        # 5 failures from this address so far; 3 more (bob's, not enough to lock bob) reach 8
        assert [_post_login(s.url, "bob", "wrong-password")[0] for _ in range(3)] == [400, 400, 400]
        for user, pw in (("bob", "bob-password"), ("carol", "whatever-pass")):
            code, body = _post_login(s.url, user, pw)
            assert code == 429 and "from this address" in json.loads(body)["detail"], (code, body)
        # /metrics' user:password bearer shares the throttle
        req = urllib.request.Request(s.url + "metrics", headers={"Authorization": "Bearer bob:bob-password"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=20)
        assert e.value.code == 429 and "try again in" in e.value.read().decode()
    finally:
        s.stop()
