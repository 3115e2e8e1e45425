"""What the web process and a model process say to each other, and how it travels.

The transport is ZeroMQ (pyzmq): the model process binds a ROUTER socket, each web process connects one
DEALER. ZeroMQ is what vLLM's engine core speaks for the same boundary; here it gives three things a
plain socket would make us write: many requests multiplexed over one connection (a frame per message,
the request id in the first frame), reconnection by itself when a model process is restarted at the
same address, and a socket monitor that says at once when the connection drops (a killed process's
socket is closed by the kernel), so the requests in flight end in a sentence without a timeout.

Every message is a dataclass below, pickled, and signed: frames are [request id, HMAC-SHA256 of the
payload, payload] under a key only the two ends hold (a file of mode 0600 in the data folder, or
LMSCOPE_MODEL_PROCESS_KEY for a model process on another host). An unsigned or wrongly signed frame is
dropped before anything unpickles it: the port is reachable by other local users, and a pickle is code.

What crosses, and its size: a GenerateCall holds the request's settings and prompt (prompts are capped
at LMSCOPE_MAX_PROMPT_TOKENS tokens before they are sent). Each Steps message holds the new Steps
(the packed record: TOP_K_RECORDED candidates before and after the filters, ~100 floats each; no
logits, probabilities or attention: a request asking for those is refused on this path) and the text
so far; Started and Finished hold the Generation without its steps (prompt ids, the KV-cache series).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
from dataclasses import dataclass
from pathlib import Path

from model_core.core import errors as errors_module
from model_core.core.errors import LmscopeError

KEY_BYTES = 32
MIN_KEY_BYTES = 16  # LMSCOPE_MODEL_PROCESS_KEY's least (32 hex digits); a key file holding less is remade
MAX_MESSAGE_BYTES = 64 << 20  # ZeroMQ drops a larger message before it is read (ZMQ_MAXMSGSIZE)
DRAIN_AT_MOST = 256  # messages either end's I/O loop moves per turn before it looks at pings and requests again
RESTARTED = "The model process restarted while this ran; run it again."


# ---------------------------------------------------------------------------------------------
# Web process -> model process

@dataclass(frozen=True)
class GenerateCall:
    model: str  # a name the web process has already checked against the server's allowed models
    request: object  # model_core.serving.generation_request.GenerateRequest (no callables, no tensors)


@dataclass(frozen=True)
class CancelCall:
    pass


@dataclass(frozen=True)
class PingCall:
    pass


# ---------------------------------------------------------------------------------------------
# Model process -> web process

@dataclass(frozen=True)
class Pong:
    pid: int
    device: str
    models: tuple[str, ...]  # loaded, most recent last


@dataclass(frozen=True)
class Started:
    generation: object  # Generation without steps, token ids or KV series


@dataclass(frozen=True)
class Steps:
    steps: list  # [Step] in order
    text: str  # the continuation so far
    kv_points: list  # [(tokens cached, bytes)] per step


@dataclass(frozen=True)
class Finished:
    generation: object  # the finished Generation without its steps


@dataclass(frozen=True)
class Failed:
    kind: str  # the LmscopeError subclass's name ("SettingsError", ...); "" for any other error
    message: str

    def error(self) -> LmscopeError:
        """The error to raise in the web process: the same LmscopeError subclass, the same sentence."""
        cls = getattr(errors_module, self.kind, None) if self.kind else None
        if not (isinstance(cls, type) and issubclass(cls, LmscopeError)):
            cls = LmscopeError
        return cls(self.message)

    @classmethod
    def of(cls, e: BaseException) -> Failed:
        if isinstance(e, LmscopeError):
            return cls(type(e).__name__, str(e))
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return cls("", f"The model process could not run this request ({first}).")


# ---------------------------------------------------------------------------------------------
# Frames

def pack(request_id: bytes, message, key: bytes) -> list[bytes]:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return [request_id, hmac.new(key, payload, hashlib.sha256).digest(), payload]


def unpack(frames: list[bytes], key: bytes):
    """(request id, message) from [request id, mac, payload], or None for a frame not signed with key."""
    if len(frames) != 3:
        return None
    request_id, mac, payload = frames
    if not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()):
        return None
    return request_id, pickle.loads(payload)


def new_request_id() -> bytes:
    return secrets.token_bytes(8)


def key_file(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / "model-process.key"


def shared_key(data_dir: str | os.PathLike, given_hex: str | None = None) -> bytes:
    """The key given (Settings.model_process_key, hex: a model process on another host), else the data
    folder's key file, made once (mode 0600) and reused by every process that shares the folder. Made
    by linking a finished file into place, so processes starting together (a web and a model service
    on one volume) all end up with the first one's key, never with two."""
    if given_hex:
        return bytes.fromhex(given_hex)  # checked by Settings.from_env
    path = key_file(data_dir)
    try:
        key = bytes.fromhex(path.read_text().strip())
        if len(key) >= MIN_KEY_BYTES:
            return key
        corrupt = True  # cut short (a crash while it was written): no process can be using it
    except FileNotFoundError:
        corrupt = False
    except ValueError:
        corrupt = True  # not hex: likewise
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_bytes(KEY_BYTES).hex() + "\n")
    try:
        if corrupt:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails when another process linked its key first: that one is used
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return bytes.fromhex(path.read_text().strip())
