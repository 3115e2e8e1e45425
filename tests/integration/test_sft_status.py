"""What the Fine-tune tab says about a run, from the run's real record (real Valkey + Celery worker):
a cancelled run shows no ETA and no 'running' anywhere, an eval row never blanks the train loss,
steps are whole numbers, and the runs comparison overlays several runs."""

from __future__ import annotations

import re
import time

import pytest

from app.shared import job_views as jf
from app.tabs.finetune import figures as sf

pytestmark = pytest.mark.integration

TINY = "random-llama-tiny"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from tests.helpers.services import LiveServices

    s = LiveServices(tmp_path_factory.mktemp("sft-status") / "data", stale_s=60).start()
    yield s
    s.stop()


def test_cancel_clears_eta_and_state_everywhere(svc):
    from app.tabs.finetune import tab as sft_tab
    from tasks import jobs

    rec = jobs.submit("sft", {"model": TINY, "method": "full", "max_steps": 5000, "batch_size": 2,
                              "max_length": 256, "builtin_train_size": 64, "accuracy_examples": 0,
                              "eval_every": 50}, owner="local")
    deadline = time.time() + 120
    while True:
        live = jobs.get_job(rec["id"])
        last = (live.get("sft") or {}).get("latest") or {}
        if live["state"] == "running" and last.get("eta_s"):
            break
        assert live["state"] in ("queued", "running"), live.get("error")
        assert time.time() < deadline, svc.worker_log()[-2000:]
        time.sleep(0.2)
    assert "ETA" in sf.status_markdown(live)  # it does show while running
    # the bar says the time left once the estimate means something (10% done, 5 s in)
    later = dict(live, progress=dict(live.get("progress") or {}, fraction=0.2, eta_seconds=60.0),
                 started=time.time() - 30)
    assert "left" in jf.progress_html(later)
    jobs.cancel_job(rec["id"])
    done = jobs.wait_job(rec["id"], timeout=60)
    assert done["state"] == "cancelled"
    assert "ETA" not in sf.status_markdown(done)
    assert "left" not in jf.progress_html(done) and "data-state='cancelled'" in jf.progress_html(done)
    row = jf.jobs_table([done]).iloc[0]
    assert row["state"] == "cancelled" and row["eta"] == ""
    assert "→" not in row["details"]  # a cancelled run points to no model
    # the tab's menus, from the same refresh the timer runs
    out = sft_tab.refresh(rec["id"], None)
    labels = [label for label, _ in out[6]]  # info, progress, 2 plots, examples, samples, then the menu list
    mine = next(label for label in labels if label.startswith(rec["id"]))
    assert "cancelled" in mine and "running" not in mine and "(full)" in mine


def test_status_and_curves_from_real_runs(svc):
    from tasks import jobs

    runs = [jobs.submit("sft", {"model": TINY, "method": m, "lora_rank": 4 if m == "lora" else None,
                                "max_steps": 4, "batch_size": 2, "max_length": 256, "builtin_train_size": 16,
                                "accuracy_examples": 0, "eval_every": 2}, owner="local") for m in ("full", "lora")]
    done = [jobs.wait_job(r["id"], timeout=240) for r in runs]
    assert [d["state"] for d in done] == ["succeeded", "succeeded"], [d.get("error") for d in done]
    hist = done[0]["sft"]["history"]
    assert any(h.get("eval_loss") is not None for h in hist)
    md = sf.status_markdown(done[0])
    train_loss = [h["loss"] for h in hist if h.get("loss") is not None][-1]
    assert f"loss {train_loss:.4f}" in md and "loss –" not in md  # the eval row did not blank it
    fig = sf.loss_figure(hist)
    assert fig.layout.xaxis.tickformat == "d" and fig.layout.xaxis.dtick >= 1
    assert "every model menu" in md and "reload" not in md
    # two runs overlaid: a train and an eval curve each, and one table row each with its method
    fig = sf.runs_figure(done)
    assert len(fig.data) == 4 and len({t.line.color for t in fig.data}) == 2
    table = sf.runs_table(done)
    assert list(table["method"]) == ["full", "lora"] and list(table["rank"]) == ["", 4]
    assert all(re.search(r"-sft-(full|lora)-", n) for n in table["run"])
