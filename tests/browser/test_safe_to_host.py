"""Safe to host: a live `lmscope serve` with sign-in (users user-a and user-b), a real Valkey and a
real Celery worker, driven with raw `queue/join` requests the way an attacker with an account
would (tests/helpers/raw_client.py), plus checks over every event of the page.

Each hole this module closes was open before (issue 13): a server file read through an upload
slot, an owner taken from the browser, an uncapped prompt, one user filling the shared queue,
downloads not bound to their owner, temporary folders left behind. Sign-in throttling and equal
login cost: tests/unit/test_auth.py (a live server's throttle: tests/browser/test_hosted_server.py); service supervision and /healthz: tests/integration/test_supervision.py.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import threading
import time
import uuid
from pathlib import Path

import gradio as gr
import pytest

from app.server import auth

ROOT = Path(__file__).resolve().parents[2]
TINY = "random-llama-tiny"  # the queue and ownership rules are the same for any model; this one is instant
MODEL = "smollm2-135m-instruct"
SECRET = f"SECRET-{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- every event, statically

@pytest.fixture(scope="module")
def demo():
    from app.server.page import build_demo

    return build_demo()


def test_every_event_goes_through_the_endpoint_door(demo):
    """A new callback cannot skip the caps, the slots and the one-sentence errors: every event with a
    Python function is wrapped by app.shared.context.endpoint, every one that loads a model or runs a
    trace holds a model slot, and no event takes an owner (or any browser-side state) as input."""
    checked = 0
    for fn in demo.fns.values():
        if fn.fn is None:
            continue  # JS-only (the URL mirror) and the Stop button's cancel
        marker = getattr(fn.fn, "__lmscope_endpoint__", None)
        assert marker is not None, f"{fn.name} is not wrapped by app.shared.context.endpoint"
        source = inspect.getsource(inspect.unwrap(fn.fn))
        if re.search(r"\b(get_model|_trace|run_trace)\(", source.split(":", 1)[1]):
            assert marker["model"] or "run_trace(" in source, f"{fn.name} touches a model without a model slot"
        params = inspect.signature(inspect.unwrap(fn.fn)).parameters
        assert "owner" not in params, f"{fn.name} takes an owner from the browser"
        assert not any(isinstance(b, gr.BrowserState) for b in fn.inputs), f"{fn.name} reads browser state"
        checked += 1
    assert checked > 60


def test_public_api_matches_the_readme(demo):
    """The public endpoints are exactly PUBLIC_API, and the README's table lists exactly those."""
    from app.server.api import PUBLIC_API

    public = {fn.api_name for fn in demo.fns.values() if fn.api_visibility == "public"}
    assert public == set(PUBLIC_API)
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Public API", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `/(\w+)` \|", section, re.M))
    assert documented == set(PUBLIC_API), (documented ^ set(PUBLIC_API))


def test_uploaded_file_accepts_only_the_upload_folder(tmp_path, monkeypatch):
    from gradio.utils import get_upload_folder

    from app.shared.context import uploaded_file

    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    with pytest.raises(gr.Error, match="Only files uploaded"):
        uploaded_file(str(secret))
    up = Path(get_upload_folder()) / f"test-{uuid.uuid4().hex}"
    up.mkdir(parents=True)
    try:
        good = up / "corpus.txt"
        good.write_text("hello")
        assert uploaded_file(str(good)) == good.resolve()
        link = up / "link.txt"  # a symlink inside the folder that points out of it
        link.symlink_to(secret)
        with pytest.raises(gr.Error, match="Only files uploaded"):
            uploaded_file(str(link))
        with pytest.raises(gr.Error, match="Only files uploaded"):
            uploaded_file(str(up) + "/" + os.path.relpath(secret, up))  # climbs out with ../
        with pytest.raises(gr.Error, match="not a file"):
            uploaded_file({"path": 3})
    finally:
        import shutil

        shutil.rmtree(up)


def test_text_caps_and_slots(monkeypatch):
    from app.shared import context

    monkeypatch.setenv("LMSCOPE_MAX_PROMPT_TOKENS", "100")

    @context.endpoint
    def echo_len(text, items=()):
        return len(text)

    assert echo_len("x" * 1600) == 1600
    with pytest.raises(gr.Error, match="1,601 characters; this server takes at most 1,600"):
        echo_len("x" * 1601)
    with pytest.raises(gr.Error, match="at most 4,096"):
        echo_len("x", ["a"] * 5000)
    # a waiting request gets a slot as soon as one frees; past the wait it gets one sentence
    monkeypatch.setenv("LMSCOPE_MAX_CONCURRENT_PER_USER", "1")

    class Req:
        username, session_hash = "carol", "s"

    with context.user_slot(Req()):
        with pytest.raises(gr.Error, match="already have 1 requests running"):
            with context.user_slot(Req(), wait_s=0.05):
                pass
        done = []

        def later():
            with context.user_slot(Req(), wait_s=10):
                done.append(True)
        t = threading.Thread(target=later)
        t.start()
        time.sleep(0.1)
        assert not done
    t.join(10)
    assert done == [True]


def test_scratch_folders_are_bounded():
    """Export (and any callback handing files to Gradio) reuses one bounded scratch area."""
    from app.shared import context

    dirs = [context.scratch_dir("export") for _ in range(context.SCRATCH_KEEP + 9)]
    left = [d for d in dirs if d.exists()]
    assert len(left) == context.SCRATCH_KEEP and left == dirs[-context.SCRATCH_KEEP:]


# ----------------------------------------------------------------------------- live signed-in server

@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    """user-a and user-b on a live server with a real Valkey + worker; Gradio's temp folder and the
    data folder are this test's own, so a planted secret can be searched for afterwards."""
    from tests.helpers.browser import LiveServer
    from tests.helpers.services import LiveServices

    base = tmp_path_factory.mktemp("hosted13")
    users = base / "users.txt"
    auth.write_user(users, "user-a", "user-a-password", iterations=2000)
    auth.write_user(users, "user-b", "user-b-password", iterations=2000)
    secret = base / "outside" / "users-copy.txt"
    secret.parent.mkdir()
    secret.write_text(f"{SECRET}\nuser-a:pbkdf2_sha256$2000$00$00\n")
    svc = LiveServices(base / "data").start()
    server = LiveServer(extra_env={**svc.env(), "LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(users),
                                   "GRADIO_TEMP_DIR": str(base / "gradio"), "LMSCOPE_MAX_PROMPT_TOKENS": "256"})
    try:
        yield {"server": server, "svc": svc, "base": base, "secret": secret}
    finally:
        server.stop()
        svc.stop()


def _client(hosted, user):
    from tests.helpers.raw_client import RawClient

    return RawClient(hosted["server"].url, user, f"{user}-password")


def _fn_for(c, elem_id: str, event: str) -> int:
    comp = next(i for i, x in c.components.items() if x.get("props", {}).get("elem_id") == elem_id)
    return next(i for i, d in c.deps.items() if [comp, event] in d["targets"])


@pytest.mark.integration
@pytest.mark.browser
def test_upload_slots_never_read_server_files(hosted):
    c = _client(hosted, "user-b")
    fd = {"path": str(hosted["secret"]), "meta": {"_type": "gradio.FileData"}}
    attempts = {
        "jobs_submit_tokenizer": ["bpe", 400, 2, "", "upload", [fd], None],
        "jobs_submit_sft": [TINY, "upload", fd, False, "full", 8, None, 2, 8, 256, 0, "", 0, 0],
        "loss_mask": [TINY, "upload", fd, 0],
    }
    for name, data in attempts.items():
        out = c.call(name, data)
        assert out.get("error") == "Only files uploaded through this page are accepted.", (name, out)
    # a real upload through the page's own route is accepted (and stays inside the upload folder)
    up = c.upload("corpus.txt", ("the quick brown fox jumps over the lazy dog\n" * 200).encode())
    out = c.call("jobs_submit_tokenizer", ["byte-level-bpe", 300, 2, "", "upload", [up], None])
    assert "Queued job" in out["data"][1], out
    # nothing anywhere under the server's data or Gradio folders holds the secret
    hits = [p for p in hosted["base"].rglob("*") if p.is_file() and p != hosted["secret"]
            and SECRET.encode() in p.read_bytes()]
    assert hits == []


@pytest.mark.integration
@pytest.mark.browser
def test_owner_is_the_signed_in_user(hosted):
    from tasks import jobs

    a, b = _client(hosted, "user-a"), _client(hosted, "user-b")
    out = b.call("jobs_submit_tokenizer", ["unigram", 8000, 2, "", "builtin", None, None])  # slow enough to cancel
    job = re.search(r"\*\*(\w+)\*\*", out["data"][1]).group(1)
    assert jobs.get_job(job)["owner"] == "user-b"
    # user-a cannot see it, cancel it or read it, even naming its id in a hand-made request
    listed = a.call("jobs_list", [None])["data"][0]
    assert job not in str(listed)
    cancel = _fn_for(a, "job-cancel", "click")
    out = a.call(cancel, [job])
    assert out["error"] == f"No job with id '{job}'.", out
    show = _fn_for(a, "job-selected", "change")
    out = a.call(show, [job])
    assert out["error"] == f"No job with id '{job}'.", out
    assert jobs.get_job(job)["state"] in ("queued", "running")
    out = b.call(cancel, [job])
    assert "cancelled" in out["data"][0]
    # no record was ever written under another name than its submitter's
    assert {r["owner"] for r in jobs.list_jobs(limit=1000)} <= {"user-a", "user-b"}


@pytest.mark.integration
@pytest.mark.browser
def test_long_text_is_refused_at_once_everywhere(hosted):
    c = _client(hosted, "user-a")

    def work_done():
        """What the server has loaded and traced so far, from its own /metrics."""
        r = c.http.get("/metrics", headers={"Authorization": "Bearer user-a:user-a-password"})
        assert r.status_code == 200, r.text
        m = r.json()
        return sorted(x["name"] for x in m["models"]), m["trace_cache"]["items"]

    before = work_done()
    big = "lorem ipsum " * 90_000  # ~1 MB
    for name, data in {"tokenize": [big, [], None],
                       "trace": [TINY, big, False, False, 0, 0, None, "probability", 1.0, 0, 1.0, 0.0, 1.0],
                       "anatomy_tree": [TINY, big, False],
                       "attribute": [TINY, big, " Paris", " Rome", "logit_diff"]}.items():
        out = c.call(name, data)
        # the character cap's sentence: refused at the endpoint's door, before any tokenizing (over
        # the token cap instead, the sentence would be "the limit is 256", as below). Explore's trace
        # answers it as the sentence under the prompt (its message output), not as an error.
        said = out.get("error", "") if name != "trace" else json.dumps(out, ensure_ascii=False)
        assert "this server takes at most 4,096" in said, (name, out)
    # refused at once: no model was loaded and nothing was traced for any of them
    assert work_done() == before
    # under the character cap but over the token cap (LMSCOPE_MAX_PROMPT_TOKENS=256): every text
    # endpoint counts tokens the same way, not only the trace
    words = "word " * 600
    for name, data in {"anatomy_tree": [TINY, words, False],
                       "compare_prompts": [TINY, words, "short"]}.items():
        out = c.call(name, data)
        assert "the limit is 256" in out.get("error", ""), (name, out)


@pytest.mark.integration
@pytest.mark.browser
@pytest.mark.real_model
def test_one_users_burst_leaves_the_others_answered(hosted):
    """user-a holds both her model slots with two generations, then fires 40 attributions at once:
    the queue takes only her share (16 places in all), the rest are refused with one sentence, and
    user-b's trace is answered meanwhile. (The 90-call burst of issue 13 filled all 64 places.)"""
    a, b = _client(hosted, "user-a"), _client(hosted, "user-b")
    gen = [MODEL, "Once upon a time", False, 96, 0.0, 0, 1.0, 0.0, 1.0, 0, "", "prob"]
    gens = [a.join(a.fn("generate"), gen) for _ in range(2)]
    assert all(code == 200 for code, _, _ in gens)
    attribute = a.fn("attribute")
    joined = []

    def burst():
        joined.append(a.join(attribute, [MODEL, "The Eiffel Tower is in the city of", " Paris", " Rome",
                                         "logit_diff"]))
    threads = [threading.Thread(target=burst) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    accepted = [s for code, _, s in joined if code == 200]
    refused = [text for code, text, _ in joined if code != 200]
    # 16 - 2 places were free when the burst began. An attribution that finds both her model slots busy
    # is answered at once and frees its place, so on a busy machine a thread that starts late can find
    # one free: 14 accepted when all 40 arrive together, a few more otherwise, and most still refused.
    assert len(accepted) + len(refused) == 40 and 16 - 2 <= len(accepted) <= 20, (len(accepted), refused[:1])
    assert all("requests waiting or running (the limit is 16)" in t for t in refused), refused[:2]
    out = b.call("trace", [MODEL, "Hello there", False, False, 0, 0, None, "probability", 1.0, 0, 1.0, 0.0, 1.0])
    assert MODEL in out["data"][1], out
    for s in accepted:  # each either ran, or waited its turn for one of her slots and said so
        out = a.result(s)
        assert "data" in out or "already have 2 requests running" in out["error"], out
    for _, _, s in gens:
        assert "data" in a.result(s)


@pytest.mark.integration
@pytest.mark.browser
def test_downloads_are_bound_to_their_owner(hosted):
    import httpx

    from tasks import jobs

    b = _client(hosted, "user-b")
    out = b.call("jobs_submit_tokenizer", ["byte-level-bpe", 300, 2, "", "builtin", None, 0.05])
    job = re.search(r"\*\*(\w+)\*\*", out["data"][1]).group(1)
    assert jobs.wait_job(job, timeout=120)["state"] == "succeeded"
    url = f"/download/{job}/tokenizer.json"
    r = b.http.get(url)
    assert r.status_code == 200 and '"model"' in r.text
    a = _client(hosted, "user-a")
    assert a.http.get(url).status_code == 404  # as if it did not exist
    assert a.http.get(f"/download/{job}/..%2F..%2Fredis.url").status_code == 404
    assert httpx.get(hosted["server"].url.rstrip("/") + url).status_code == 401
    # the Jobs tab shows links, and writes no copies into temporary folders
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("lmscope-*"))
    shown = b.call(_fn_for(b, "job-selected", "change"), [job])  # what selecting the row shows
    assert url.lstrip("/") in str(shown["data"]), shown
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("lmscope-*")) <= before | set(
        Path(os.environ.get("TMPDIR", "/tmp")).glob("lmscope-scratch-*"))
