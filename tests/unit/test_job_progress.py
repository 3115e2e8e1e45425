"""The Jobs tab's progress (issue 15 item 10): the ETA says nothing until it can say something true,
and a job has a cancel button only while it can stop."""

import time

from app.shared import job_views as jf


def _rec(state="running", fraction=0.05, eta=0.2, started_ago=1.0):
    now = time.time()
    return {"id": "j1", "kind": "tokenizer", "state": state, "started": now - started_ago, "created": now - 2,
            "progress": {"fraction": fraction, "stage": "training", "eta_seconds": eta}, "params": {}}


def test_eta_is_said_only_when_it_means_something():
    # the old panel said "about 0 s left" at 5%, one second in
    assert jf.eta_text(_rec()) == "" and "left" not in jf.progress_html(_rec())
    assert jf.eta_text(_rec(fraction=0.5, eta=3.0, started_ago=3.0)) == ""  # too soon after the start
    assert jf.eta_text(_rec(fraction=0.5, eta=3.0, started_ago=10)) == "a few seconds left"
    assert jf.eta_text(_rec(fraction=0.4, eta=42, started_ago=30)) == "about 40 s left"
    assert jf.eta_text(_rec(fraction=0.2, eta=600, started_ago=150)) == "about 10 min left"
    assert "about 40 s left" in jf.progress_html(_rec(fraction=0.4, eta=42, started_ago=30))
    assert jf.eta_text(_rec(state="succeeded", fraction=1.0, eta=0, started_ago=30)) == ""
    table = jf.jobs_table([_rec(), _rec(fraction=0.4, eta=42, started_ago=30)])
    assert list(table["eta"]) == ["", "about 40 s"]


def test_cancel_button_only_while_a_job_can_stop():
    from app.tabs.jobs.tab import _cancel_button

    for state, shown in [("queued", True), ("running", True), ("succeeded", False), ("failed", False),
                         ("cancelled", False)]:
        assert _cancel_button(jf.progress_html(_rec(state=state)))["visible"] is shown, state
    assert _cancel_button(jf.progress_html(None))["visible"] is False
