"""Background jobs against a real Valkey server and a real Celery worker process (integration).

Bound for a killed worker here: LMSCOPE_JOB_STALE_SECONDS=6 (production default 30 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model_core.core.errors import LmscopeError
from tests.helpers.services import LiveServices

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"algorithm": "byte-level-bpe", "vocab_size": 500, "corpus_max_mb": 0.3}
# Unigram on the whole built-in corpus takes >10 s here: long enough to cancel or kill mid-run.
SLOW = {"algorithm": "unigram", "vocab_size": 8000}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = LiveServices(tmp_path_factory.mktemp("jobs-data"), stale_s=6.0).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def jobs(svc):
    from tasks import jobs as j

    return j


def wait_state(jobs, job_id, states, timeout=60.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        rec = jobs.get_job(job_id)
        if rec["state"] in states:
            return rec
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still {rec['state']} after {timeout} s: {rec['log']}")


@pytest.fixture(scope="module")
def finished_bytelevel(svc, jobs):
    rec = jobs.submit("tokenizer", dict(SMALL), owner="test-owner")
    assert rec["state"] == "queued"
    seen = []
    done = jobs.wait_job(rec["id"], timeout=90, poll=0.05,
                         on_update=lambda r: seen.append((r["state"], r["progress"]["stage"], r["progress"]["fraction"])))
    return done, seen


def test_jobs_run_below_the_web_servers_priority(svc, finished_bytelevel):
    """The worker's pool processes, which run the jobs, are at nice JOB_NICE: a fine-tuning run on
    the machine the server is on yields the cores to its requests (REQUEST_NICE) and its engine."""
    from model_core.core.cpu_threads import JOB_NICE, REQUEST_NICE

    def stat(pid):  # /proc/<pid>/stat after the command name: state is field 3, ppid 4, nice 19
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()

    pool = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int(stat(d.name)[1]) == svc.worker.pid:
                pool.append(int(stat(d.name)[16]))
        except (OSError, IndexError):  # a process that ended while being read
            continue
    assert pool and all(n >= JOB_NICE > REQUEST_NICE for n in pool), pool
    assert int(stat(svc.worker.pid)[16]) < JOB_NICE  # the main process only takes messages


def test_submit_progress_success_artifacts(svc, jobs, finished_bytelevel):
    rec, seen = finished_bytelevel
    assert rec["state"] == "succeeded", (rec, svc.worker_log())
    assert rec["progress"]["fraction"] == 1.0 and rec["error"] is None
    assert rec["started"] >= rec["created"] and rec["finished"] >= rec["started"]
    running = [s for s in seen if s[0] == "running"]
    assert running, seen
    fractions = [s[2] for s in seen]
    assert fractions == sorted(fractions)  # progress only moves forward
    assert any(0 < s[2] < 1 for s in running)
    names = {a["name"]: a for a in rec["artifacts"]}
    assert set(names) == {"tokenizer.json", "report.json"}
    for a in names.values():
        p = Path(a["path"])
        assert p.exists() and p.stat().st_size == a["bytes"]
        assert p.parent == svc.data_dir / "jobs" / rec["id"]
    rep = json.loads(Path(names["report.json"]["path"]).read_text())
    assert rep["vocab_size"] == 500
    assert len(rep["first_merges"]) == 20 and len(rep["last_merges"]) == 20
    assert rep["first_merges"][0] != rep["last_merges"][-1]
    assert sum(rep["token_length_histogram"]["counts"]) > 400
    c = rep["compression"]
    assert 1.0 < c["chars_per_token"] < 6 and c["tokens_per_word"] > 1
    ref = rep["reference"]
    # The default model's tokenizer is always there (`make test` prepares it): a 49k-token
    # vocabulary compresses the same held-out English better than our 500-token one.
    assert "unavailable" not in ref, ref
    assert ref["chars_per_token"] > c["chars_per_token"], ref
    assert [r["id"] for r in jobs.list_jobs(owner="test-owner")] == [rec["id"]]


def test_bytelevel_roundtrip_on_heldout(finished_bytelevel):
    from tokenizers import Tokenizer

    from tasks import corpus

    rec, _ = finished_bytelevel
    tok = Tokenizer.from_file(next(a["path"] for a in rec["artifacts"] if a["name"] == "tokenizer.json"))
    held = corpus.builtin_docs("heldout")
    train = set(corpus.builtin_docs("train"))
    assert len(held) > 500 and not (set(held) & train)
    extra = ["naïve café — 東京 🙂\ttabs\n\n  double  spaces", "\x01odd\x7f bytes\r\n"]
    for x in held + extra:
        assert tok.decode(tok.encode(x, add_special_tokens=False).ids) == x


def test_cancel_queued_and_running(svc, jobs):
    a = jobs.submit("tokenizer", dict(SLOW), owner="t-cancel")
    b = jobs.submit("tokenizer", dict(SMALL), owner="t-cancel")  # waits behind a (concurrency 1)
    wait_state(jobs, a["id"], ("running",), 60)
    rb = jobs.cancel_job(b["id"])
    assert rb["state"] == "cancelled"
    ra = jobs.cancel_job(a["id"])
    assert ra["state"] == "cancelled" and "was running" in ra["log"][-1]
    # the worker keeps serving: a later job runs, the cancelled ones never finish or start
    c = jobs.submit("tokenizer", dict(SMALL), owner="t-cancel")
    rc = jobs.wait_job(c["id"], timeout=90)
    assert rc["state"] == "succeeded", (rc, svc.worker_log())
    ra, rb = jobs.get_job(a["id"]), jobs.get_job(b["id"])
    assert ra["state"] == "cancelled" and ra["artifacts"] == []
    assert rb["state"] == "cancelled" and not any("started" in l for l in rb["log"])
    assert jobs.cancel_job(c["id"])["state"] == "succeeded"  # finished jobs stay as they are


def test_killed_pool_process_is_retried(svc, jobs):
    """kill -9 of the process running the task: the message comes back (acks_late +
    reject_on_worker_lost) and the job restarts as attempt 2, then succeeds."""
    rec = jobs.submit("tokenizer", {"algorithm": "unigram", "vocab_size": 2000, "corpus_max_mb": 0.4},
                      owner="t-kill")
    r = wait_state(jobs, rec["id"], ("running",), 60)
    pid = r["worker"]["pid"]
    assert pid in svc.worker_children()
    os.kill(pid, 9)
    done = jobs.wait_job(rec["id"], timeout=120)
    assert done["state"] == "succeeded", (done, svc.worker_log())
    assert done["attempts"] == 2 and any("restarting, attempt 2" in l for l in done["log"])


def test_killed_worker_marks_job_failed_within_bound(svc, jobs):
    rec = jobs.submit("tokenizer", dict(SLOW), owner="t-kill")
    wait_state(jobs, rec["id"], ("running",), 60)
    time.sleep(0.5)
    svc.kill9_worker()  # the whole worker: main process and pool child
    r = wait_state(jobs, rec["id"], ("failed",), svc.stale_s + 15)  # the bound: failed by then, or the test fails
    assert r["error"].startswith("worker lost") and "\n" not in r["error"]
    # failed by the heartbeat rule with this deployment's LMSCOPE_JOB_STALE_SECONDS, not by anything else
    assert r["error"] == f"worker lost (no heartbeat for {svc.stale_s:.0f} s)", r["error"]
    svc.start_worker()  # a new worker does not resurrect it
    time.sleep(1)
    assert jobs.get_job(rec["id"])["state"] == "failed"


def test_restart_redis_and_worker_keeps_history(svc, jobs, finished_bytelevel):
    before = {r["id"]: r for r in jobs.list_jobs(limit=1000)}
    assert any(r["state"] == "succeeded" for r in before.values())
    svc.stop_worker()
    svc.stop_redis()
    svc.start_redis()
    svc.start_worker()
    # a fresh "web" process (the CLI) sees the same history and artifacts
    out = subprocess.run([sys.executable, "-m", "app.server.cli", "jobs", "list", "--json", "--limit", "1000"],
                         capture_output=True, text=True, env={**os.environ, **svc.env()}, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    after = {r["id"]: r for r in json.loads(out.stdout)}
    assert set(after) == set(before)
    for i, r in before.items():
        if r["state"] in ("succeeded", "failed", "cancelled"):
            assert after[i]["state"] == r["state"]
            assert after[i]["artifacts"] == r["artifacts"]
            assert all(Path(a["path"]).exists() for a in r["artifacts"])
    rec, _ = finished_bytelevel
    assert jobs.get_job(rec["id"])["state"] == "succeeded"


def _bad_files(tmp: Path) -> dict:
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "blank.jsonl").write_text('{"text": "   "}\n\n')
    (tmp / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (tmp / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    (tmp / "notext.jsonl").write_text('{"body": "x"}\n')
    (tmp / "big.txt").write_text("word " * 400_000)  # 2 MB, over the 1 MB limit set below
    (tmp / "data.csv").write_text("a,b\n")
    return {
        "empty": (tmp / "empty.txt", "is empty"),
        "blank": (tmp / "blank.jsonl", "no text"),
        "binary": (tmp / "binary.txt", "binary"),
        "latin1": (tmp / "latin1.txt", "not valid UTF-8"),
        "notext": (tmp / "notext.jsonl", '"text"'),
        "big": (tmp / "big.txt", "upload limit"),
        "csv": (tmp / "data.csv", ".txt or .jsonl"),
    }


def test_bad_inputs_refused_with_one_line(svc, jobs, tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_UPLOAD_MAX_MB", "1")
    n_before = len(jobs.list_jobs(limit=1000))
    for name, (path, words) in _bad_files(tmp_path).items():
        with pytest.raises(LmscopeError) as e:
            jobs.submit("tokenizer", {"algorithm": "bpe", "vocab_size": 1000}, owner="t-bad", files=[path])
        msg = str(e.value)
        assert words in msg and "\n" not in msg, (name, msg)
    for params, words in [({"vocab_size": 50}, "too small"), ({"vocab_size": 10**6}, "too large"),
                          ({"vocab_size": "lots"}, "whole number"), ({"algorithm": "sentencepiece"}, "Unknown"),
                          ({"min_frequency": 0}, "Minimum frequency")]:
        with pytest.raises(LmscopeError) as e:
            jobs.submit("tokenizer", {"algorithm": "bpe", "vocab_size": 1000, **params}, owner="t-bad")
        assert words in str(e.value) and "\n" not in str(e.value)
    assert len(jobs.list_jobs(limit=1000)) == n_before  # nothing was queued
    with pytest.raises(LmscopeError, match="No job with id"):
        jobs.get_job("nope")


def test_cli_submit_wait_json_end_to_end(svc, tmp_path):
    corpus_file = tmp_path / "mine.jsonl"
    from tasks import corpus

    corpus_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus.builtin_docs("heldout")[:400]))
    # no REDIS_URL: the CLI finds the broker through <data dir>/redis.url, like after `make run`
    env = {**os.environ, **svc.env()}
    env.pop("REDIS_URL")
    cmd = [sys.executable, "-m", "app.server.cli", "jobs"]
    out = subprocess.run(cmd + ["submit", "tokenizer", "--algorithm", "wordpiece", "--vocab-size", "400",
                                "--corpus", str(corpus_file), "--min-frequency", "1", "--wait", "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stderr + svc.worker_log()
    rec = json.loads(out.stdout)
    assert rec["state"] == "succeeded" and rec["params"]["corpus"] == "upload"
    assert all(Path(a["path"]).exists() for a in rec["artifacts"])
    rep = json.loads(Path(next(a["path"] for a in rec["artifacts"] if a["name"] == "report.json")).read_text())
    assert rep["heldout"]["source"] == "every 10th uploaded document" and rep["vocab_size"] == 400
    shown = subprocess.run(cmd + ["show", rec["id"], "--json"], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=120)
    assert json.loads(shown.stdout)["id"] == rec["id"]
    bad = subprocess.run(cmd + ["submit", "tokenizer", "--vocab-size", "10"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "too small" in bad.stderr


def test_ensure_services_embedded_reuse_and_url_file(tmp_path, monkeypatch):
    from tasks import services
    from tests.helpers.services import free_port

    port = free_port()
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("LMSCOPE_REDIS_PORT", str(port))
    h1 = services.ensure_services(tmp_path, start_worker_proc=False)
    password = services.redis_password(tmp_path)
    try:
        assert h1.redis_url == f"redis://:{password}@127.0.0.1:{port}/0" and h1.redis_proc is not None
        assert (tmp_path / "redis.url").read_text().strip() == h1.redis_url
        conf = (tmp_path / "redis" / "valkey.conf").read_text()
        assert "appendonly yes" in conf
        h2 = services.ensure_services(tmp_path, start_worker_proc=False)  # a second run reuses the server
        assert h2.redis_proc is None and h2.redis_url == h1.redis_url
        h2.stop()  # stops nothing it did not start
        assert services._ping("127.0.0.1", port, password)
    finally:
        h1.stop()
    assert not services._ping("127.0.0.1", port, password)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # REDIS_URL set: start nothing
    h3 = services.ensure_services(tmp_path)
    assert h3.redis_proc is None and h3.worker_proc is None and h3.redis_url == "redis://127.0.0.1:1/0"


def test_jobs_tab_callbacks_against_live_worker(svc, jobs):
    """The Jobs tab's callbacks (what the buttons and the timer call), without a browser."""
    import gradio as gr

    from app.tabs.jobs import tab as jobs_tab

    job_id, msg = jobs_tab.submit("bpe", 400, 2, "<unk>, <s>", "builtin", None, 0.1)
    assert job_id in msg and jobs.get_job(job_id)["owner"] == "local"  # a direct call: no request, no browser
    for _ in range(300):
        table, status, prog, log = jobs_tab.refresh(job_id)
        if "data-state='succeeded'" in prog:
            break
        time.sleep(0.2)
    row = table[table["id"] == job_id]  # sign-in off: the list holds everyone's jobs, this one among them
    assert len(row) == 1 and row["state"].iloc[0] == "succeeded" and status == ""
    prog, log, summary, hist, merges, comp, links = jobs_tab.show_selected(job_id)
    assert "vocabulary **400**" in summary and len(merges) == 40
    # downloads are links to the owner-checked /download route, not copies in a temp folder
    assert f"download/{job_id}/tokenizer.json" in links and f"download/{job_id}/report.json" in links
    report = jobs.artifact_path(jobs.get_job(job_id), "report.json")
    assert merges["rank"].iloc[-1] == int(json.loads(report.read_text())["num_merges"])
    html, fig = jobs_tab.compare("Tokenize this, please.", [], job_id)
    assert html.count("<b>") == 2 and html.count("title='id ") > 5
    from tokenizers import Tokenizer

    from tasks.tokenizer_train import hf_pieces, reference_tokenizer, token_pieces

    text = "Tokenize  this,\nplease."
    tok = Tokenizer.from_file(str(jobs.artifact_path(jobs.get_job(job_id), "tokenizer.json")))
    assert "".join(p["text"] for p in token_pieces(tok, text)) == text  # boundaries cover the prompt
    ref, _ = reference_tokenizer()
    if ref is not None:
        assert "".join(p["text"] for p in hf_pieces(ref, text)) == text
    with pytest.raises(gr.Error, match="too small"):
        jobs_tab.submit("bpe", 20, 2, "", "builtin", None, None)


def test_redis_killed_mid_job(svc, jobs, finished_bytelevel):
    """kill -9 Redis while a job runs: callers get one clear sentence (not a traceback) while it is
    down; once it is back (same data dir, append-only file) the running job ends, succeeded or
    failed with its reason, within the stale bound, and finished jobs are all still there."""
    rec = jobs.submit("tokenizer", dict(SLOW), owner="t-redis")
    wait_state(jobs, rec["id"], ("running",), 60)
    time.sleep(1.5)  # let the append-only file (fsync every second) hold the running record
    os.kill(svc.redis.pid, 9)
    svc.redis.wait(10)
    with pytest.raises(jobs.JobError) as e:
        jobs.list_jobs(limit=10)
    assert "\n" not in str(e.value) and "not reachable" in str(e.value)
    time.sleep(2)
    svc.start_redis()
    r = wait_state(jobs, rec["id"], ("succeeded", "failed"), svc.stale_s + 60)
    print(f"job after Redis came back: {r['state']} {r.get('error') or ''}")
    if r["state"] == "failed":
        assert r["error"] and "\n" not in r["error"]
    done, _ = finished_bytelevel
    assert jobs.get_job(done["id"])["state"] == "succeeded"
    # and the worker still serves new jobs
    again = jobs.submit("tokenizer", dict(SMALL), owner="t-redis")
    assert jobs.wait_job(again["id"], timeout=90)["state"] == "succeeded"
