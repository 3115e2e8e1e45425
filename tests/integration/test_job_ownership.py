"""Job ownership with sign-in, against a real Valkey + Celery worker: another user's job is not
revealed, cancelled or listed, the Jobs tab and its download show each viewer only their own, and
the per-hour job limit holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.integration
def test_jobs_belong_to_their_owner(tmp_path, monkeypatch):
    from model_core.core.errors import LmscopeError
    from tests.helpers.services import LiveServices

    svc = LiveServices(tmp_path / "data").start()
    try:
        from app.tabs.jobs import tab as jobs_tab
        from tasks import jobs

        slow = {"algorithm": "unigram", "vocab_size": 8000}
        a = jobs.submit("tokenizer", slow, owner="alice")
        assert jobs.get_job(a["id"], owner="alice")["owner"] == "alice"
        with pytest.raises(LmscopeError, match="No job with id"):
            jobs.get_job(a["id"], owner="bob")  # not revealed
        with pytest.raises(LmscopeError, match="No job with id"):
            jobs.cancel_job(a["id"], owner="bob")
        assert jobs.get_job(a["id"])["state"] in ("queued", "running")
        assert [r["id"] for r in jobs.list_jobs(owner="bob")] == []

        class Req:  # what Gradio passes when sign-in is on
            def __init__(self, username):
                self.username, self.session_hash = username, "s-" + username

        # the Jobs tab with sign-in: bob sees nothing of alice's
        monkeypatch.setenv("LMSCOPE_AUTH", "users")  # a users file is named, as sign-in needs; never read here
        monkeypatch.setenv("LMSCOPE_USERS_FILE", str(tmp_path / "users.txt"))
        table, _, prog, log = jobs_tab.refresh(a["id"], Req("bob"))
        assert a["id"] not in table.to_string() and log == ""
        # the job list download holds what each viewer's table holds (app.shared.job_views.write_jobs)
        def listed(user):
            files = {Path(f).name: Path(f) for f in jobs_tab.export_jobs(Req(user))["value"]}
            return [j["id"] for j in json.loads(files["jobs.json"].read_text())["jobs"]], files["jobs.csv"].read_text()

        alice_ids, alice_csv = listed("alice")
        assert alice_ids == [a["id"]] and a["id"] in alice_csv
        assert listed("bob")[0] == []
        import gradio as gr

        with pytest.raises(gr.Error):
            jobs_tab.show_selected(a["id"], Req("bob"))
        with pytest.raises(gr.Error):
            jobs_tab.cancel(a["id"], Req("bob"))
        html, _ = jobs_tab.compare("hello", [a["id"]], None, Req("bob"))
        assert "No job with id" in html
        # alice cancels her own
        assert "cancelled" in jobs_tab.cancel(a["id"], Req("alice"))
        # jobs per hour
        monkeypatch.setenv("LMSCOPE_JOBS_PER_HOUR", "2")
        jobs.submit("tokenizer", {"algorithm": "byte-level-bpe", "vocab_size": 300, "corpus_max_mb": 0.05},
                    owner="alice")
        with pytest.raises(LmscopeError, match="limit is 2"):
            jobs.submit("tokenizer", slow, owner="alice")
    finally:
        svc.stop()
