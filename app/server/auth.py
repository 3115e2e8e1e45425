"""Sign-in for a hosted lmscope: a users file of salted PBKDF2 hashes, or one shared token.

Users file lines: `name:pbkdf2_sha256$iterations$salt_hex$hash_hex` ('#' starts a comment).
Add or replace a user (password read from stdin, one line):

    echo 's3cret-pass' | python -m app.server.auth add-user alice --file users.txt

`authenticator(settings)` returns the callable Gradio's `auth=` takes: (username, password) -> bool.
Comparisons are constant-time (hmac.compare_digest). An unknown user name costs the same as a known
one with a wrong password: it is checked against a dummy hash with the iteration count of the file's
users. Passwords containing control characters (NUL, tab, newline ... U+001F, DEL) are refused before
hashing: HMAC zero-pads short keys, so PBKDF2 of "pw" and "pw\\0" would be equal.

Failed sign-ins are throttled (`LoginThrottle`, installed on the FastAPI app by
`install_login_throttle`, and used by `bearer_ok` for /metrics' `user:password`): after
LMSCOPE_LOGIN_MAX_FAILURES failures for one user name, or LMSCOPE_LOGIN_MAX_FAILURES_PER_ADDRESS from
one client address, each less than LMSCOPE_LOGIN_WINDOW_S after the previous one, further attempts
are refused without checking the password (HTTP 429 and a sentence saying how long to wait) for
LMSCOPE_LOGIN_LOCK_S, then twice that after the next failure, and so on up to LMSCOPE_LOGIN_MAX_LOCK_S.
A successful sign-in clears its user name's count (not its address's). These six settings are
part of model_core.core.settings.Settings (`login_*`), read and checked with every other one at start.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import sys
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)

ALGO = "pbkdf2_sha256"
ITERATIONS = 200_000
NAME_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
CONTROL_MSG = "Passwords may not contain control characters (NUL, tab, newline ...)."


def password_chars_ok(password: str) -> bool:
    """False for a password with a C0 control character or DEL (refused before any hashing)."""
    return CONTROL_RE.search(password) is None


def hash_password(password: str, iterations: int = ITERATIONS, salt: str | None = None) -> str:
    salt = salt or secrets.token_hex(16)
    dk = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), bytes.fromhex(salt), iterations)
    return f"{ALGO}${iterations}${salt}${dk.hex()}"


def verify_password(password: str, encoded: str) -> bool:
    if not password_chars_ok(password):
        return False
    try:
        algo, iters, salt, want = encoded.split("$")
        if algo != ALGO:
            return False
        dk = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), bytes.fromhex(salt), int(iters))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(dk.hex(), want)


def read_users(path: str | Path) -> dict[str, str]:
    users = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or ":" not in line:
            continue
        name, enc = line.split(":", 1)
        users[name.strip()] = enc.strip()
    return users


def write_user(path: str | Path, name: str, password: str, iterations: int = ITERATIONS) -> None:
    if not NAME_RE.match(name):
        raise ValueError("User names are 1-64 letters, digits or . _ @ -.")
    if len(password) < 8:
        raise ValueError("Passwords need at least 8 characters.")
    if not password_chars_ok(password):
        raise ValueError(CONTROL_MSG)
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    lines = [ln for ln in lines if not ln.strip().startswith(name + ":")]
    lines.append(f"{name}:{hash_password(password, iterations)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.chmod(tmp, 0o600)
    tmp.replace(path)


@functools.lru_cache(maxsize=8)
def _dummy(iterations: int) -> str:
    """A hash no password matches in practice, with this iteration count (one per count, cached)."""
    return hash_password(secrets.token_hex(16), iterations)


def users_iterations(users: dict[str, str]) -> int:
    """The iteration count an unknown name is checked with: the most common one among the file's
    users (the highest on a tie), so that 'no such user' takes as long as 'wrong password'."""
    counts = Counter()
    for enc in users.values():
        parts = enc.split("$")
        if len(parts) == 4 and parts[0] == ALGO and parts[1].isdigit() and 0 < int(parts[1]) <= 10_000_000:
            counts[int(parts[1])] += 1
    if not counts:
        return ITERATIONS
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


def authenticator(settings):
    """Gradio auth callable for settings.auth ('token' or 'users'); None when sign-in is off."""
    if settings.auth == "token":
        token = settings.auth_token

        def check_token(username: str, password: str) -> bool:
            password = password or ""
            if not password_chars_ok(password):
                return False
            return bool(username) and NAME_RE.match(username) is not None and hmac.compare_digest(
                password.encode(), token.encode())
        return check_token
    if settings.auth == "users":
        path = settings.users_file
        try:
            _dummy(users_iterations(read_users(path)))  # built now, not during someone's first sign-in
        except OSError:
            pass

        def check_user(username: str, password: str) -> bool:
            password = password or ""
            if not password_chars_ok(password):
                return False
            users = read_users(path)  # re-read: adding a user needs no restart
            enc = users.get(username or "")
            ok = verify_password(password, enc or _dummy(users_iterations(users)))
            return ok and enc is not None
        return check_user
    return None


def async_authenticator(settings):
    """The same check for Gradio's login route, off the event loop (PBKDF2 takes ~0.1 s by design)."""
    check = authenticator(settings)
    if check is None:
        return None

    async def check_async(username: str, password: str) -> bool:
        import asyncio

        return await asyncio.to_thread(check, username, password)
    return check_async


# ----------------------------------------------------------------------------- throttle

def _wait_text(seconds: float) -> str:
    s = max(1, math.ceil(seconds))
    return f"{s} s" if s < 120 else f"{math.ceil(s / 60)} min"


class _Entry:
    __slots__ = ("fails", "level", "until", "last", "inflight")

    def __init__(self):
        self.fails, self.level, self.until, self.last, self.inflight = 0, 0, 0.0, 0.0, 0


class LoginThrottle:
    """Failed sign-ins per user name and per client address, with exponential lock-outs.

    `begin(user, address)` answers None (go ahead: the attempt is counted as in flight) or the
    sentence to refuse it with and the seconds to wait; every None must be followed by
    `finish(user, address, ok)` with ok True (signed in), False (wrong credentials) or None (neither,
    e.g. a malformed request). Attempts in flight count towards the limits, so a burst of parallel
    guesses cannot slip past them. `clock` (seconds, monotonic) is injectable for tests. Thread-safe.
    """

    USER_MSG = "Too many failed sign-ins for this account; try again in {wait}."
    ADDRESS_MSG = "Too many failed sign-ins from this address; try again in {wait}."

    def __init__(self, max_failures: int = 5, max_failures_per_address: int = 20, window_s: float = 900.0,
                 lock_s: float = 1.0, max_lock_s: float = 300.0, max_keys: int = 10_000, clock=time.monotonic):
        self.max_failures, self.max_failures_per_address = int(max_failures), int(max_failures_per_address)
        self.window_s, self.lock_s, self.max_lock_s = float(window_s), float(lock_s), float(max_lock_s)
        self.max_keys, self.clock = int(max_keys), clock
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()  # oldest change first
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings, **kw) -> LoginThrottle:
        """From a model_core.core.settings.Settings' login_* values (LMSCOPE_LOGIN_*)."""
        return cls(max_failures=settings.login_max_failures,
                   max_failures_per_address=settings.login_max_failures_per_address,
                   window_s=settings.login_window_s, lock_s=settings.login_lock_s,
                   max_lock_s=settings.login_max_lock_s, max_keys=settings.login_max_keys, **kw)

    @classmethod
    def from_env(cls, environ, **kw) -> LoginThrottle:
        """From LMSCOPE_LOGIN_* in the mapping `environ`; SettingsError for a bad value."""
        from model_core.core.settings import Settings

        return cls.from_settings(Settings.from_env(environ, check_files=False), **kw)

    def __len__(self) -> int:
        return len(self._entries)

    def _keys(self, user, address):
        keys = []
        if user is not None:
            keys.append((("user", str(user)[:128]), self.max_failures, self.USER_MSG))
        if address is not None:
            keys.append((("addr", str(address)[:128]), self.max_failures_per_address, self.ADDRESS_MSG))
        return keys

    def _get(self, key, now, create: bool):
        e = self._entries.get(key)
        if e is not None and e.inflight == 0 and e.until <= now and now - e.last > self.window_s:
            del self._entries[key]  # forgotten: no failure for a whole window
            e = None
        if e is None and create:
            e = self._entries[key] = _Entry()
            e.last = now
            self._prune(now)
        return e

    def _prune(self, now) -> None:
        """Keep at most max_keys entries: forget the least recently changed ones first."""
        while len(self._entries) > self.max_keys:
            self._entries.popitem(last=False)

    def wait(self, user=None, address=None) -> tuple[float, str | None]:
        """(seconds to wait, sentence) for a new attempt; (0, None) when it may go ahead."""
        with self._lock:
            return self._wait(self._keys(user, address), self.clock())

    def _wait(self, keys, now):
        best, msg = 0.0, None
        for key, limit, template in keys:
            e = self._get(key, now, create=False)
            if e is None:
                continue
            w = e.until - now
            if w <= 0 and e.inflight > 0 and e.fails + e.inflight >= limit:
                w = self.lock_s  # attempts still being checked would reach the limit: one at a time
            if w > best:
                best, msg = w, template.format(wait=_wait_text(w))
        return best, msg

    def begin(self, user=None, address=None) -> tuple[float, str] | None:
        with self._lock:
            now = self.clock()
            keys = self._keys(user, address)
            w, msg = self._wait(keys, now)
            if w > 0:
                return w, msg
            for key, _, _ in keys:
                self._get(key, now, create=True).inflight += 1
            return None

    def finish(self, user=None, address=None, ok: bool | None = None) -> None:
        with self._lock:
            now = self.clock()
            for key, limit, _ in self._keys(user, address):
                e = self._get(key, now, create=ok is False)
                if e is None:
                    continue
                e.inflight = max(0, e.inflight - 1)
                if ok is False:
                    if now - e.last > self.window_s and e.until <= now:
                        e.fails, e.level = 0, 0  # the previous failures are a window old
                    e.fails += 1
                    e.last = now
                    if e.fails >= limit:
                        e.until = now + min(self.lock_s * 2 ** min(e.level, 60), self.max_lock_s)
                        e.level += 1
                    self._entries.move_to_end(key)
                elif ok and key[0] == "user":
                    e.fails, e.level, e.until = 0, 0, 0.0
                if e.fails == 0 and e.inflight == 0 and e.until <= now:
                    del self._entries[key]

    def record(self, user=None, address=None, ok: bool = False) -> None:
        """One finished attempt that was not announced with begin() (tests, simple callers)."""
        with self._lock:
            now = self.clock()
            for key, _, _ in self._keys(user, address):
                self._get(key, now, create=True).inflight += 1
        self.finish(user, address, ok)


_shared: LoginThrottle | None = None
_shared_lock = threading.Lock()


def shared_throttle(settings=None) -> LoginThrottle:
    """The process's throttle, shared by /login and /metrics: made on first use from `settings`
    (None: model_core.core.settings.current())."""
    global _shared
    with _shared_lock:
        if _shared is None:
            if settings is None:
                from model_core.core.settings import current

                settings = current()
            _shared = LoginThrottle.from_settings(settings)
        return _shared


LOGIN_PATHS = ("/login", "/login/")
MAX_LOGIN_BODY = 64 * 1024


class LoginThrottleMiddleware:
    """Pure ASGI: for POST /login, reads the form's username and the client address, answers 429
    {"detail": sentence} while either is locked, else lets Gradio's login route check the password
    and records its answer (400: failure, 200: success).

    The client address is scope["client"] as the server gives it; X-Forwarded-For is not read here.
    (uvicorn itself rewrites scope["client"] from X-Forwarded-For only for connections from its
    --forwarded-allow-ips, 127.0.0.1 by default; behind any other proxy every client shares the
    proxy's address, and only the per-name limit tells them apart.)"""

    def __init__(self, app, throttle: LoginThrottle | None = None):
        self.app, self.throttle = app, throttle

    @staticmethod
    def _is_login(scope) -> bool:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return False
        path, root = scope.get("path", ""), scope.get("root_path", "") or ""
        return path in LOGIN_PATHS or (bool(root) and path.startswith(root) and path[len(root):] in LOGIN_PATHS)

    async def __call__(self, scope, receive, send):
        if not self._is_login(scope):
            return await self.app(scope, receive, send)
        throttle = self.throttle if self.throttle is not None else shared_throttle()
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > MAX_LOGIN_BODY:
                return await self._answer(send, 413, "A sign-in form is at most 64 KB.")
            if not message.get("more_body", False):
                break
        body = bytes(body)
        client = scope.get("client")
        address = client[0] if client else "unknown"
        user = await self._username(scope, body)
        if user is None:  # Gradio would answer 422 too; never let a password be checked unthrottled
            return await self._answer(send, 422, "Send the form fields username and password.")
        refused = throttle.begin(user, address)
        if refused is not None:
            wait, sentence = refused
            return await self._answer(send, 429, sentence, {"retry-after": str(max(1, math.ceil(wait)))})

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        status = None

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, replay, send_status)
        finally:
            throttle.finish(user, address, True if status == 200 else False if status == 400 else None)

    @staticmethod
    async def _username(scope, body: bytes) -> str | None:
        """The form's username, stripped as Gradio strips it; None when there is none. Parsed by the
        same Starlette parser, with the same limits, as FastAPI's form for Gradio's route, so both
        see the same name."""
        from starlette.requests import Request

        async def once():
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            form = await Request(dict(scope), once).form()
        except Exception:  # noqa: BLE001 - malformed
            return None
        try:
            name = form.get("username")
            return name.strip() if isinstance(name, str) else None
        finally:
            await form.close()

    @staticmethod
    async def _answer(send, status: int, sentence: str, headers: dict | None = None) -> None:
        payload = json.dumps({"detail": sentence}).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": payload})


def install_login_throttle(api, settings, throttle: LoginThrottle | None = None) -> None:
    """Throttle failed sign-ins on POST /login of this FastAPI app (nothing when sign-in is off)."""
    if settings.auth_on:
        api.add_middleware(LoginThrottleMiddleware, throttle=throttle if throttle is not None
                           else shared_throttle(settings))


def bearer_ok(settings, header: str | None, client: str | None = None, throttle: LoginThrottle | None = None) -> bool:
    """Authorization: Bearer <token> for the operator endpoints. With LMSCOPE_AUTH=users the token is
    LMSCOPE_AUTH_TOKEN when set; otherwise 'user:password' of any user is accepted. 'user:password'
    attempts are throttled like sign-ins (per user name and per `client` address): while locked this
    raises fastapi.HTTPException 429 with the sentence saying how long to wait."""
    if not settings.auth_on:
        return True
    if not header or not header.lower().startswith("bearer "):
        return False
    given = header[7:].strip()
    if settings.auth_token and hmac.compare_digest(given.encode(), settings.auth_token.encode()):
        return True
    if settings.auth == "users" and ":" in given:
        u, p = given.split(":", 1)
        throttle = throttle if throttle is not None else shared_throttle()
        refused = throttle.begin(u.strip(), client)
        if refused is not None:
            from fastapi import HTTPException

            wait, sentence = refused
            raise HTTPException(429, detail=sentence, headers={"Retry-After": str(max(1, math.ceil(wait)))})
        ok = None
        try:
            ok = bool(authenticator(settings)(u.strip(), p))
        finally:
            throttle.finish(u.strip(), client, ok)
        return ok
    return False


def main(argv=None) -> int:
    """`python -m app.server.auth add-user NAME`: a process of its own, so it sets up its logging as
    the `lmscope` command does (the message alone, on stderr); the result line goes to stdout."""
    from model_core.core.settings import configure_logging

    configure_logging("INFO", "%(message)s")
    ap = argparse.ArgumentParser(prog="python -m app.server.auth", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add-user", help="add or replace a user; the password is read from stdin")
    a.add_argument("name")
    a.add_argument("--file", default=None, help="the users file (default: LMSCOPE_USERS_FILE, else users.txt)")
    a.add_argument("--iterations", type=int, default=ITERATIONS)
    args = ap.parse_args(argv)
    if args.file is None:
        from model_core.core.settings import Settings, SettingsError

        try:
            args.file = str(Settings.from_env(check_files=False).users_file or "users.txt")
        except SettingsError as e:
            log.error("error: %s", e)
            return 2
    password = sys.stdin.readline().rstrip("\r\n")
    try:
        write_user(args.file, args.name, password, args.iterations)
    except ValueError as e:
        log.error("error: %s", e)
        return 2
    sys.stdout.write(f"user '{args.name}' written to {args.file}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
