"""Sign-in for a hosted lmscope: a users file of salted PBKDF2 hashes, or one shared token.

Users file lines: `name:pbkdf2_sha256$iterations$salt_hex$hash_hex` ('#' starts a comment).
Add or replace a user (password read from stdin, one line):

    echo 's3cret-pass' | python -m app.auth add-user alice --file users.txt

`authenticator(settings)` returns the callable Gradio's `auth=` takes: (username, password) -> bool.
Comparisons are constant-time (hmac.compare_digest).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import re
import secrets
import sys
from pathlib import Path

ALGO = "pbkdf2_sha256"
ITERATIONS = 200_000
NAME_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


def hash_password(password: str, iterations: int = ITERATIONS, salt: str | None = None) -> str:
    salt = salt or secrets.token_hex(16)
    dk = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), bytes.fromhex(salt), iterations)
    return f"{ALGO}${iterations}${salt}${dk.hex()}"


def verify_password(password: str, encoded: str) -> bool:
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
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    lines = [ln for ln in lines if not ln.strip().startswith(name + ":")]
    lines.append(f"{name}:{hash_password(password, iterations)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.chmod(tmp, 0o600)
    tmp.replace(path)


_DUMMY = hash_password("not-a-user", 1000)


def authenticator(settings):
    """Gradio auth callable for settings.auth ('token' or 'users'); None when sign-in is off."""
    if settings.auth == "token":
        token = settings.auth_token

        def check_token(username: str, password: str) -> bool:
            return bool(username) and NAME_RE.match(username) is not None and hmac.compare_digest(
                (password or "").encode(), token.encode())
        return check_token
    if settings.auth == "users":
        path = settings.users_file

        def check_user(username: str, password: str) -> bool:
            users = read_users(path)  # re-read: adding a user needs no restart
            enc = users.get(username or "")
            ok = verify_password(password or "", enc or _DUMMY)
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


def bearer_ok(settings, header: str | None) -> bool:
    """Authorization: Bearer <token> for the operator endpoints. With LMSCOPE_AUTH=users the token is
    LMSCOPE_AUTH_TOKEN when set; otherwise 'user:password' of any user is accepted."""
    if not settings.auth_on:
        return True
    if not header or not header.lower().startswith("bearer "):
        return False
    given = header[7:].strip()
    if settings.auth_token and hmac.compare_digest(given.encode(), settings.auth_token.encode()):
        return True
    if settings.auth == "users" and ":" in given:
        u, p = given.split(":", 1)
        return authenticator(settings)(u, p)
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.auth", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add-user", help="add or replace a user; the password is read from stdin")
    a.add_argument("name")
    a.add_argument("--file", default=os.environ.get("LMSCOPE_USERS_FILE") or "users.txt")
    a.add_argument("--iterations", type=int, default=ITERATIONS)
    args = ap.parse_args(argv)
    password = sys.stdin.readline().rstrip("\r\n")
    try:
        write_user(args.file, args.name, password, args.iterations)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"user '{args.name}' written to {args.file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
