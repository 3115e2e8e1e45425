"""The messages between the web process and a model process: what is not signed with the shared key is
dropped unread (never unpickled), and processes sharing a data folder agree on one key even when
they start together (docker-compose.yml's web and model services on one volume)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from model_core.serving.model_process_wire import PingCall, key_file, pack, shared_key, unpack

ROOT = Path(__file__).resolve().parents[2]


def test_a_frame_not_signed_with_the_key_is_dropped_unread():
    key, other = os.urandom(32), os.urandom(32)
    frames = pack(b"r1", PingCall(), key)
    assert unpack(frames, key)[0] == b"r1" and isinstance(unpack(frames, key)[1], PingCall)
    assert unpack(frames, other) is None
    rid, mac, payload = frames
    # a payload that would run code when unpickled, with the mac of the real one: refused before loads
    evil = b"cos\nsystem\n(S'touch /tmp/lmscope-pwned'\ntR."
    assert unpack([rid, mac, evil], key) is None
    assert unpack([rid, mac], key) is None


def test_processes_starting_together_share_one_key(tmp_path):
    start = time.time() + 3  # each process waits for this moment, then makes the key: a race on purpose
    code = ("import sys, time; from model_core.serving.model_process_wire import shared_key; "
            f"time.sleep(max(0, {start} - time.time())); print(shared_key(sys.argv[1]).hex())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(8)]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(keys) == 1 and len(next(iter(keys))) == 64
    assert key_file(tmp_path).read_text().strip() == next(iter(keys))
    assert oct(key_file(tmp_path).stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in tmp_path.iterdir()] == [key_file(tmp_path).name]  # no temporary file left
    # a file that is not a key (cut short by a crash) is replaced, and the new key kept
    key_file(tmp_path).write_text("")
    fresh = shared_key(tmp_path)
    assert len(fresh) == 32 and shared_key(tmp_path) == fresh


def test_a_key_made_by_another_process_meanwhile_wins(tmp_path, monkeypatch):
    """The interleaving the race above hopes to hit, made certain: another process writes its key
    after this one found no file and before this one's is in place. Both must end with that key."""
    import model_core.serving.model_process_wire as wire

    theirs = os.urandom(32)
    real = wire.secrets.token_bytes

    def meanwhile(n):
        key_file(tmp_path).write_text(theirs.hex() + "\n")  # the other process finished first
        return real(n)

    monkeypatch.setattr(wire.secrets, "token_bytes", meanwhile)
    assert shared_key(tmp_path) == theirs
    assert key_file(tmp_path).read_text().strip() == theirs.hex()
