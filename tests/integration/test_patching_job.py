"""Patching sweeps as background jobs, against a real Valkey server and a real Celery worker.

random-llama-tiny (3 layers, byte tokenizer: one character = one token) keeps the sweeps fast;
batch_size=1 makes one progress step per patched run, so progress is visible while it runs.
"""

from __future__ import annotations

import contextlib
import json
import math
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
CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of xy"  # same length in bytes (34 tokens)
MODEL = "random-llama-tiny"


def params(n: int = 1, **kw) -> dict:
    return {"model": MODEL, "clean": CLEAN * n, "corrupted": CORRUPT * n, "target": "P", "other": "R",
            "batch_size": 1, **kw}


class Services(LiveServices):
    # one torch thread in the worker: on a shared 2-core machine two spinning OpenMP threads make
    # these tiny batch-of-1 forwards ~30x slower (measured 70 s vs 2.5 s for 408 runs)
    def env(self) -> dict[str, str]:
        return {**super().env(), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = Services(tmp_path_factory.mktemp("patch-jobs"), stale_s=6.0).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def jobs(svc):
    from tasks import jobs as j

    return j


def wait_state(jobs, job_id, states, timeout=60.0):
    t0 = time.time()
    rec = None
    while time.time() - t0 < timeout:
        rec = jobs.get_job(job_id)
        if rec["state"] in states:
            return rec
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {rec and rec['state']} after {timeout} s: {rec and rec['log']}")


@contextlib.contextmanager
def one_thread():
    """The in-process reference with one torch thread too (see Services), restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _same(a, b, tol=1e-5) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def test_residual_job_matches_in_process(svc, jobs):
    from model_core import load_model
    from model_core.interp.interventions import make_metric, patch_residual
    from tasks.patching_job import read_result

    p = params(4)  # 136 tokens x 3 layers = 408 patched runs, one per batch
    rec = jobs.submit("patching", p, owner="t-patch")
    seen = []
    done = jobs.wait_job(rec["id"], timeout=120, poll=0.02,
                         on_update=lambda r: seen.append((r["state"], r["progress"]["stage"], r["progress"]["fraction"])))
    assert done["state"] == "succeeded", (done, svc.worker_log())
    fr = [s[2] for s in seen]
    assert fr == sorted(fr)
    mid = {round(s[2], 3) for s in seen if s[0] == "running" and s[1] == "patching" and 0.05 < s[2] < 0.97}
    assert len(mid) >= 2, seen  # progress moved during the sweep, not only at start and end
    assert [a["name"] for a in done["artifacts"]] == ["patching.json"]
    out = read_result(done)

    lm = load_model(MODEL, device="cpu")
    with one_thread():
        ref = patch_residual(lm, p["clean"], p["corrupted"], make_metric(lm, "P", "R"), batch_size=1).to_dict()
    assert out["kind"] == "resid" and out["rows"] == ref["rows"] == [0, 1, 2] and out["cols"] == list(range(136))
    assert out["clean_ids"] == ref["clean_ids"] and out["corrupted_ids"] == ref["corrupted_ids"]
    assert _same(out["clean_value"], ref["clean_value"]) and _same(out["corrupted_value"], ref["corrupted_value"])
    for key in ("values", "normalized"):
        for ra, rb in zip(out[key], ref[key], strict=True):
            assert all(_same(a, b) for a, b in zip(ra, rb, strict=True)), key
    assert out["n_forward"] == ref["n_forward"] == 408 + 2
    assert out["row_labels"] == ["L0", "L1", "L2"] and out["col_labels"][0] == "0:T"
    assert out["metric_description"] == "logit['P'] - logit['R']"


def test_heads_job(svc, jobs):
    from model_core import load_model
    from model_core.interp.interventions import make_metric, patch_heads
    from tasks.patching_job import read_result

    p = params(1, sweep="heads", other=None, batch_size=None)
    done = jobs.wait_job(jobs.submit("patching", p, owner="t-patch")["id"], timeout=120)
    assert done["state"] == "succeeded", (done, svc.worker_log())
    out = read_result(done)
    lm = load_model(MODEL, device="cpu")
    with one_thread():
        ref = patch_heads(lm, CLEAN, CORRUPT, make_metric(lm, "P")).to_dict()
    assert out["kind"] == "heads" and out["col_labels"] == ["H0", "H1", "H2", "H3"]
    assert out["metric"]["kind"] == "logprob"
    for ra, rb in zip(out["values"], ref["values"], strict=True):
        assert all(_same(a, b) for a, b in zip(ra, rb, strict=True))


def test_cancel_mid_run_then_worker_keeps_serving(svc, jobs):
    rec = jobs.submit("patching", params(12), owner="t-patch")  # 408 tokens x 3 layers, one run per batch
    t0 = time.time()
    while True:
        r = jobs.get_job(rec["id"])
        if r["state"] == "running" and r["progress"]["stage"] == "patching" and r["progress"]["fraction"] > 0.06:
            break
        assert r["state"] in ("queued", "running") and time.time() - t0 < 90, (r, svc.worker_log())
        time.sleep(0.05)
    c = jobs.cancel_job(rec["id"])
    # the worker checks the cancel flag per layer, so its own "cancelled during the sweep" may be the
    # ending (written before cancel_job's record update, which then leaves the final record alone)
    assert c["state"] == "cancelled", c
    assert any("was running" in line or "cancelled during the sweep" in line for line in c["log"][-2:]), c["log"]
    time.sleep(2)
    r = jobs.get_job(rec["id"])
    assert r["state"] == "cancelled" and r["artifacts"] == []
    assert not (svc.data_dir / "jobs" / rec["id"] / "patching.json").exists()
    after = jobs.wait_job(jobs.submit("patching", params(1), owner="t-patch")["id"], timeout=120)
    assert after["state"] == "succeeded", (after, svc.worker_log())


def test_bad_input(svc, jobs):
    n = len(jobs.list_jobs(limit=1000))
    with pytest.raises(LmscopeError, match="needs 'target'"):
        jobs.submit("patching", {**params(), "target": ""})
    with pytest.raises(LmscopeError, match="Unknown sweep"):
        jobs.submit("patching", params(sweep="neurons"))
    assert len(jobs.list_jobs(limit=1000)) == n
    # a multi-token target is only known to the model: the job fails with the one-sentence reason
    done = jobs.wait_job(jobs.submit("patching", params(target=" Paris"))["id"], timeout=120)
    assert done["state"] == "failed" and "is 6 tokens" in done["error"], done


def test_cli_submit_patching_wait_json(svc):
    env = {**os.environ, **svc.env()}
    cmd = [sys.executable, "-m", "app.server.cli", "jobs", "submit", "patching", "--model", MODEL,
           "--clean", CLEAN, "--corrupted", CORRUPT, "--target", "P", "--other", "R", "--kind", "heads",
           "--wait", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stderr + svc.worker_log()
    rec = json.loads(out.stdout)
    assert rec["state"] == "succeeded" and rec["kind"] == "patching" and rec["params"]["sweep"] == "heads"
    res = json.loads(Path(rec["artifacts"][0]["path"]).read_text())
    assert len(res["values"]) == 3 and len(res["values"][0]) == 4


def test_interventions_tab_offers_and_runs_the_job(svc, jobs, monkeypatch, tmp_path):
    """The tab's callbacks end to end: over the interactive cap -> job offer -> submit -> poll until
    the heatmap is drawn from the job's patching.json."""
    from app.tabs.interventions import tab

    monkeypatch.setattr(tab, "MAX_SWEEP_CELLS", 50)  # 3 layers x 34 positions is over it
    summary, plot, offer, _ = tab.run_patching(MODEL, CLEAN, CORRUPT, "P", "R", "logit_diff", "resid", False,
                                            progress=lambda *a, **k: None)
    assert "background job" in summary and "102 patched runs" in summary and offer["visible"] is True
    job_id, bar, timer, msg = tab.submit_patch_job(MODEL, CLEAN, CORRUPT, "P", "R", "logit_diff", "resid", False)
    assert job_id in msg and "data-state='queued'" in bar
    assert jobs.get_job(job_id)["owner"] == "local"  # from the request (none here), never from the browser
    t0 = time.time()
    while True:
        bar, summary, heat, timer, data = tab.poll_patch_job(job_id)
        if not isinstance(heat, dict):  # gr.skip() while it runs
            break
        assert time.time() - t0 < 120, svc.worker_log()
        time.sleep(0.2)
    assert "data-state='succeeded'" in bar and "Strongest cell" in summary
    from tasks.patching_job import read_result

    z = heat.data[0].z
    want = read_result(jobs.get_job(job_id))["normalized"]
    assert len(z) == 3 and len(z[0]) == 34
    assert all(_same(a, b) for ra, rb in zip(z, want) for a, b in zip(ra, rb))
    # the job's grid is what the tab's results download writes (issue 15 item 6)
    from app.shared.exports import write_interventions

    csv_path, json_path = write_interventions(None, data, None, tmp_path)
    lines = csv_path.read_text().splitlines()
    assert csv_path.name == "patching.csv" and lines[0] == "layer,position,label,value,delta,normalized"
    assert len(lines) == 1 + 3 * 34 and lines[1].startswith("0,0,0:")
    # a bad target fails in the page, before anything is queued
    n = len(jobs.list_jobs(limit=1000))
    with pytest.raises(Exception, match="6 tokens"):
        tab.submit_patch_job(MODEL, CLEAN, CORRUPT, " Paris", "R", "logit_diff", "resid", False)
    assert len(jobs.list_jobs(limit=1000)) == n
