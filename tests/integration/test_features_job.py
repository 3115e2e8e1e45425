"""The 'features' job end to end (real Valkey + a real Celery worker): `lmscope jobs submit features
... --wait --json` trains a sparse autoencoder on the worker, saves it under <data dir>/features, and
its held-out numbers are what model_core.interp.features.evaluate gives here for the saved weights; a bad
setting is refused before queueing, a bad layer fails the job with one sentence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

MODEL = "random-llama-tiny"  # 3 layers, width 64: the job's mechanics, not a real model's features


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from tests.helpers.services import LiveServices

    s = LiveServices(tmp_path_factory.mktemp("features-job"), stale_s=6.0).start()
    yield s
    s.stop()


def _cli(svc, *args):
    return subprocess.run([sys.executable, "-m", "app.server.cli", "jobs", "submit", "features", *args, "--wait", "--json"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **svc.env()})


def test_features_job_through_the_cli_saves_what_it_reports(svc):
    from model_core import load_model
    from model_core.interp import features as F
    from tasks.lifecycle import artifact_path

    out = _cli(svc, "--model", MODEL, "--layer", "1", "--dataset", "builtin", "--max-tokens", "2048",
               "--context", "32", "--batch-size", "8", "--k", "8", "--eval-tokens", "256", "--context-tokens", "256",
               "--output-name", "tiny-l1")
    assert out.returncode == 0, out.stderr[-2000:] + svc.worker_log()
    rec = json.loads(out.stdout)
    assert rec["state"] == "succeeded", rec
    assert "saved as 'tiny-l1'" in rec["log"][-1]
    saved = json.loads(artifact_path(rec, "features.json").read_text())
    f = rec["features"]
    assert f["name"] == saved["name"] == "tiny-l1"
    assert [h["step"] for h in f["history"]] == list(range(1, saved["steps"] + 1)) and saved["steps"] == 8
    assert {"loss", "fvu", "dead_share"} <= set(f["latest"])
    assert f["memory"]["peak_rows"] <= f["memory"]["limit_rows"] == 8 * 32
    # the Jobs tab's progress panel reads the same record: the last step's numbers and the quality
    from app.shared.job_views import progress_html

    shown = progress_html(rec)
    assert f"step 8: loss {f['latest']['loss']:.4g}, FVU {f['latest']['fvu']:.3f}" in shown
    assert f"CE loss recovered {f['quality']['ce_recovered']:.3f}" in shown

    lm = load_model(MODEL)
    feats = F.load_features("tiny-l1")
    assert (feats.layer, feats.hook, feats.num_latents) == (1, "resid_post", 8 * 64)
    here = F.evaluate(lm, feats, F.eval_windows(lm.tokenizer, "builtin", 256, 32), batch_size=8)
    for key in ("fvu", "ce_clean", "ce_sae", "ce_zero", "ce_recovered"):
        assert abs(here[key] - f["quality"][key]) < 1e-4, (key, here[key], f["quality"][key])


def test_bad_settings_are_refused_and_a_bad_layer_fails_with_one_sentence(svc):
    from model_core.core.errors import LmscopeError
    from tasks import jobs

    with pytest.raises(LmscopeError, match="'k' must be a whole number"):
        jobs.submit("features", {"model": MODEL, "layer": 1, "k": 0})
    with pytest.raises(LmscopeError, match="needs 'layer'"):
        jobs.submit("features", {"model": MODEL})
    out = _cli(svc, "--model", MODEL, "--layer", "7", "--max-tokens", "512", "--context", "32")
    rec = json.loads(out.stdout)
    assert rec["state"] == "failed" and rec["error"] == "The layer must be a whole number from 0 to 2 for random-llama-tiny."
