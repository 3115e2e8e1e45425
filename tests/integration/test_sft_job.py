"""One SFT job through a real Celery worker and a real Valkey server: bad data refused before the
queue, a tiny full run that registers a loadable model, and the command line's LoRA run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_core.training import sft

TINY = "random-llama-tiny"
TINY_RUN = {"model": TINY, "dataset": "builtin", "batch_size": 8,
            "learning_rate": 3e-3, "accuracy_examples": 4, "eval_fraction": 0.1}


@pytest.mark.integration
def test_sft_job_through_a_real_worker(tmp_path):
    from tests.helpers.services import LiveServices

    svc = LiveServices(tmp_path / "jobs-data", stale_s=6.0).start()
    try:
        from tasks import jobs

        assert "sft" in jobs.KINDS
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "q", "completion": "a"}\n{"prompt": "q"}\n')
        with pytest.raises(sft.DatasetError, match="line 2"):
            jobs.submit("sft", {"model": TINY}, owner="t", files=[bad])
        assert jobs.list_jobs(owner="t") == []
        rec = jobs.submit("sft", {**TINY_RUN, "max_steps": 12, "eval_every": 6}, owner="t")
        done = jobs.wait_job(rec["id"], timeout=120, poll=0.2)
        assert done["state"] == "succeeded", (done, svc.worker_log())
        s = done["sft"]
        name = s["model_name"]
        assert [h["step"] for h in s["history"] if h.get("loss") is not None] == list(range(1, 13))
        assert s["accuracy_before"]["n"] == 4 and s["accuracy_after"]["n"] == 4
        assert (svc.data_dir / "models" / name / "model.safetensors").exists()
        # diff.json: the run against its base, computed as it finished ("What changed" on its page)
        assert {a["name"] for a in done["artifacts"]} == {"lmscope.json", "model.safetensors", "tensorboard.zip",
                                                          "diff.json"}
        assert jobs.read_json_artifact(done, "diff.json")["tuned"] == done["sft"]["model_name"]
        from model_core import load_model, trace

        lm = load_model(name)
        assert lm.meta["parent"] == TINY and trace(lm, "hello").n_tokens == 5
        # the CLI: lmscope jobs submit sft ... --wait --json
        import subprocess
        import sys

        out = subprocess.run([sys.executable, "-m", "app.server.cli", "jobs", "submit", "sft", "--model", TINY,
                              "--lora-rank", "4", "--max-steps", "3", "--batch-size", "4", "--output-name",
                              "tiny-cli", "--wait", "--timeout", "120", "--json"],
                             capture_output=True, text=True, timeout=180, cwd=Path(__file__).resolve().parents[2])
        rec = json.loads(out.stdout)
        assert out.returncode == 0 and rec["state"] == "succeeded", (out.stderr[-2000:], svc.worker_log())
        assert rec["params"]["method"] == "lora" and rec["sft"]["model_name"] == "tiny-cli"
        assert (svc.data_dir / "models" / "tiny-cli" / "model.safetensors").exists()
    finally:
        svc.stop()
