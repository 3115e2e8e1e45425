"""Sign-in hardening (issue 13, "Safe to host"): equal cost for unknown and known user names,
control characters refused, and failed sign-ins throttled per user name and per client address
(unit tests with an injected clock and Gradio's real /login route in-process; the live server's throttle is
tests/browser/test_hosted_server.py)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from app.server import auth
from model_core.core.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def _throttle(clock, **kw):
    kw = {"max_failures": 5, "max_failures_per_address": 100, "window_s": 900, "lock_s": 1, "max_lock_s": 300,
          **kw}
    return auth.LoginThrottle(clock=clock, **kw)


def _fail(t, user, address="10.0.0.1"):
    assert t.begin(user, address) is None
    t.finish(user, address, False)


# ----------------------------------------------------------------------------- throttle (injected clock)

def test_failures_lock_the_name_with_the_wait_in_the_sentence():
    clock = Clock()
    t = _throttle(clock)
    _fail(t, "alice")  # one wrong password throttles nothing
    assert t.wait("alice", "10.0.0.1") == (0, None)
    for _ in range(3):
        _fail(t, "alice")
    assert t.begin("alice", "10.0.0.1") is None  # the 5th attempt is still checked
    t.finish("alice", "10.0.0.1", False)
    refused = t.begin("alice", "10.0.0.9")  # any address: the name is locked
    assert refused is not None
    wait, sentence = refused
    assert wait == pytest.approx(1.0)
    assert sentence == "Too many failed sign-ins for this account; try again in 1 s."
    assert t.begin("bob", "10.0.0.1") is None  # others are not affected
    t.finish("bob", "10.0.0.1", None)


def test_backoff_doubles_up_to_the_cap():
    clock = Clock()
    t = _throttle(clock)
    for _ in range(5):
        _fail(t, "alice")
    waits = []
    for _ in range(12):
        wait, sentence = t.begin("alice", "10.0.0.1")
        waits.append(wait)
        clock.advance(wait + 0.01)  # wait out the lock, then fail again
        _fail(t, "alice")
    assert waits[:9] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert waits[9:] == [300, 300, 300]
    assert t.wait("alice")[1] == "Too many failed sign-ins for this account; try again in 5 min."
    clock.advance(3)
    assert t.wait("alice")[1] == "Too many failed sign-ins for this account; try again in 5 min."
    clock.advance(200)
    assert t.wait("alice")[1] == "Too many failed sign-ins for this account; try again in 97 s."


def test_success_resets_the_name_but_not_the_address():
    clock = Clock()
    t = _throttle(clock, max_failures_per_address=6)
    for _ in range(5):
        _fail(t, "alice")
    clock.advance(t.wait("alice")[0] + 0.01)
    assert t.begin("alice", "10.0.0.1") is None
    t.finish("alice", "10.0.0.1", True)
    assert t.wait("alice") == (0, None)
    for _ in range(4):  # a fresh count: four more failures (from elsewhere) lock nothing
        _fail(t, "alice", "10.0.0.2")
    assert t.wait("alice") == (0, None)
    # the address's count survived the success: a 6th failure from 10.0.0.1 locks it
    _fail(t, "bob", "10.0.0.1")
    assert t.wait(address="10.0.0.1")[0] > 0 and t.wait(address="10.0.0.2") == (0, None)


def test_per_address_limit_across_many_names():
    clock = Clock()
    t = _throttle(clock, max_failures_per_address=10)
    for i in range(10):
        _fail(t, f"user{i}", "203.0.113.7")  # one failure each: no name is locked
    assert all(t.wait(f"user{i}")[0] == 0 for i in range(10))
    wait, sentence = t.begin("someone-else", "203.0.113.7")
    assert sentence == "Too many failed sign-ins from this address; try again in 1 s."
    assert t.begin("someone-else", "198.51.100.1") is None  # another address is fine
    t.finish("someone-else", "198.51.100.1", None)


def test_window_forgets_old_failures():
    clock = Clock()
    t = _throttle(clock, window_s=60)
    for _ in range(10):
        _fail(t, "alice")
        clock.advance(61)  # each failure a window after the previous one
    assert t.wait("alice", "10.0.0.1") == (0, None)
    assert len(t) == 0  # stale entries are dropped when next looked at


def test_parallel_attempts_count_while_in_flight():
    clock = Clock()
    t = _throttle(clock)
    for _ in range(5):
        assert t.begin("alice", "10.0.0.1") is None  # five guesses being checked at once
    assert t.begin("alice", "10.0.0.1") is not None  # a sixth waits for them
    for _ in range(5):
        t.finish("alice", "10.0.0.1", False)
    assert t.wait("alice")[0] == pytest.approx(1.0)
    # after the lock, one attempt at a time
    clock.advance(1.01)
    assert t.begin("alice", "10.0.0.1") is None
    assert t.begin("alice", "10.0.0.1") is not None
    t.finish("alice", "10.0.0.1", True)
    assert t.wait("alice") == (0, None)


def test_state_is_bounded():
    clock = Clock()
    t = _throttle(clock, max_keys=100)
    for i in range(5000):
        _fail(t, f"spray{i}", f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(t) <= 100
    # the most recent ones are the ones remembered
    assert t._entries and ("user", "spray4999") in t._entries


def test_settings_from_environment():
    t = auth.LoginThrottle.from_env({"LMSCOPE_LOGIN_MAX_FAILURES": "3", "LMSCOPE_LOGIN_MAX_FAILURES_PER_ADDRESS": "7",
                                     "LMSCOPE_LOGIN_WINDOW_S": "60", "LMSCOPE_LOGIN_LOCK_S": "2",
                                     "LMSCOPE_LOGIN_MAX_LOCK_S": "30", "LMSCOPE_LOGIN_MAX_KEYS": "50"})
    assert (t.max_failures, t.max_failures_per_address, t.window_s, t.lock_s, t.max_lock_s, t.max_keys) == \
        (3, 7, 60, 2, 30, 50)
    d = auth.LoginThrottle.from_env({})
    assert (d.max_failures, d.max_failures_per_address, d.window_s, d.lock_s, d.max_lock_s, d.max_keys) == \
        (5, 20, 900, 1, 300, 10_000)
    # a bad value is refused at start with one sentence each (model_core.core.settings), never silently replaced
    with pytest.raises(SettingsError) as e:
        auth.LoginThrottle.from_env({"LMSCOPE_LOGIN_MAX_FAILURES": "lots", "LMSCOPE_LOGIN_LOCK_S": "-1"})
    assert "LMSCOPE_LOGIN_MAX_FAILURES must be a whole number" in str(e.value)
    assert "LMSCOPE_LOGIN_LOCK_S must be more than 0" in str(e.value)


# ----------------------------------------------------------------------------- control characters

@pytest.fixture
def users_settings(tmp_path):
    p = tmp_path / "users.txt"
    auth.write_user(p, "alice", "alice-password", iterations=1000)
    return Settings.from_env({"LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(p)})


def test_control_characters_are_refused(users_settings):
    # why: HMAC zero-pads short keys, so PBKDF2 cannot tell "pw" from "pw\0"
    salt = b"0123456789abcdef"
    assert hashlib.pbkdf2_hmac("sha256", b"pw", salt, 10) == hashlib.pbkdf2_hmac("sha256", b"pw\x00", salt, 10)
    check = auth.authenticator(users_settings)
    assert check("alice", "alice-password")
    for bad in ("alice-password\x00", "alice-password\x00\x00", "alice-pass\x00word", "alice-password\t",
                "alice-password\n", "alice-password\x1f", "alice-password\x7f"):
        assert not check("alice", bad), repr(bad)
        assert not auth.verify_password(bad, auth.read_users(users_settings.users_file)["alice"])
    token = Settings.from_env({"LMSCOPE_AUTH": "token", "LMSCOPE_AUTH_TOKEN": "shared-token-123"})
    tcheck = auth.authenticator(token)
    assert tcheck("anyone", "shared-token-123")
    for bad in ("shared-token-123\x00", "\x00shared-token-123", "shared-token-123\r"):
        assert not tcheck("anyone", bad), repr(bad)


def test_add_user_refuses_control_characters(tmp_path):
    users = tmp_path / "users.txt"
    with pytest.raises(ValueError, match="control characters"):
        auth.write_user(users, "alice", "alice-password\x00")
    out = subprocess.run([sys.executable, "-m", "app.server.auth", "add-user", "alice", "--file", str(users),
                          "--iterations", "1000"], input="alice-pass\x00word\n", text=True, capture_output=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 2 and "control characters" in out.stderr
    assert not users.exists()


# ----------------------------------------------------------------------------- equal cost

def test_unknown_and_known_names_cost_the_same(tmp_path, monkeypatch):
    """A wrong password for a known name and any password for an unknown one each run one PBKDF2
    derivation of the same size (the file's iteration count, a salt as long), so neither answers
    sooner. What that costs in milliseconds is a machine's number, not this test's."""
    p = tmp_path / "users.txt"
    auth.write_user(p, "alice", "alice-password", iterations=20_000)
    auth.write_user(p, "bob", "bob-password", iterations=20_000)
    assert auth.users_iterations(auth.read_users(p)) == 20_000
    check = auth.authenticator(Settings.from_env({"LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(p)}))
    real, calls = hashlib.pbkdf2_hmac, []

    def counted(name, password, salt, iterations, *rest):
        calls.append((name, len(salt), iterations))
        return real(name, password, salt, iterations, *rest)

    monkeypatch.setattr(hashlib, "pbkdf2_hmac", counted)  # counts the work; the real derivation still runs
    work = {}
    for who in ("alice", "nobody"):
        calls.clear()
        assert not check(who, "wrong-password")
        work[who] = list(calls)
    assert work["alice"] == work["nobody"] == [("sha256", 16, 20_000)], work


# ----------------------------------------------------------------------------- /metrics bearer

def test_bearer_user_password_is_throttled(users_settings):
    from fastapi import HTTPException

    t = _throttle(Clock())
    assert auth.bearer_ok(users_settings, "Bearer alice:alice-password", "10.0.0.1", throttle=t)
    for _ in range(5):
        assert not auth.bearer_ok(users_settings, "Bearer alice:wrong", "10.0.0.1", throttle=t)
    with pytest.raises(HTTPException) as e:
        auth.bearer_ok(users_settings, "Bearer alice:alice-password", "10.0.0.2", throttle=t)
    assert e.value.status_code == 429 and "try again in 1 s" in e.value.detail
    assert e.value.headers["Retry-After"] == "1"


# ----------------------------------------------------------------------------- Gradio's /login, in-process

def test_login_route_is_throttled_in_process(users_settings):
    import gradio as gr
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    clock = Clock()
    t = _throttle(clock, max_failures=3, max_failures_per_address=5)
    api = FastAPI()
    auth.install_login_throttle(api, users_settings, throttle=t)
    with gr.Blocks() as demo:
        gr.Markdown("hi")
    app = gr.mount_gradio_app(api, demo, path="", auth=auth.async_authenticator(users_settings))
    with TestClient(app) as c:
        def login(user, pw, multipart=False):
            if multipart:  # what the browser's login page sends (FormData)
                return c.post("/login", files={"username": (None, user), "password": (None, pw)})
            return c.post("/login", data={"username": user, "password": pw})  # gradio_client

        assert login("alice", "alice-password").status_code == 200
        assert [login(" alice ", "nope", multipart=i % 2 == 1).status_code for i in range(4)] == [400, 400, 400, 429]
        r = login("alice", "alice-password", multipart=True)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json() == {"detail": "Too many failed sign-ins for this account; try again in 1 s."}
        clock.advance(1.01)
        assert login("alice", "alice-password").status_code == 200
        assert [login("bob", "x").status_code for _ in range(3)] == [400, 400, 429]  # 5 from this address
        r = c.post("/login/", data={"username": "carol", "password": "x"})
        assert r.status_code == 429 and "from this address" in r.json()["detail"]
        clock.advance(3600)  # all forgotten
        # a form whose username cannot be read is refused before any password is checked
        for bad in ({"password": "alice-password"}, {"username": "alice", "password": "alice-password",
                                                     **{f"f{i}": "x" for i in range(1001)}}):
            r = c.post("/login", data=bad)
            assert r.status_code == 422, r.text
        r = c.post("/login", files={"username": ("name.txt", b"alice"), "password": (None, "alice-password")})
        assert r.status_code == 422
        assert t.wait("alice", "testclient") == (0, None)
        assert c.get("/config").status_code in (200, 401)  # other routes untouched
