"""Training from scratch (model_core/training/pretrain.py) and its jobs (tasks/pretrain_job.py).

In process: the loop lowers held-out loss on a tiny config, its loss equals transformers' own, the
parameter counts are the hand formula, checkpoints register and load, a cancel registers nothing;
the power-law fit recovers a known exponent (and agrees with numpy's polyfit). Then one real
scaling sweep, one depth sweep at equal parameters and one pretrain run through the CLI against a
real Valkey and Celery worker (tests/helpers/services.py), the sweeps' models opened with
model_core.core.registry.load_model.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from model_core.core.errors import LmscopeError
from model_core.training import pretrain as pt
from tests.helpers.services import LiveServices

ROOT = Path(__file__).resolve().parents[2]
TINY = {"width": 32, "layers": 1, "context": 64, "batch_size": 8, "eval_tokens": 1024, "learning_rate": 3e-3}


@pytest.fixture(scope="module")
def docs():
    from tasks import corpus

    return corpus.builtin_docs("train", max_bytes=300_000), corpus.builtin_docs("heldout")[:200]


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path))
    return tmp_path


def test_training_lowers_heldout_loss_and_registers(docs, data_dir):
    from model_core.core.registry import load_model

    rows = []
    res = pt.run_pretrain({**TINY, "max_steps": 60, "keep_checkpoints": 2, "output_name": "tiny"}, *docs,
                          progress=rows.append)
    m = res.info["metrics"]
    # from the uniform guess over 258 byte tokens (ln 258 = 5.553) to a model of the text
    assert abs(m["first_eval_loss"] - math.log(258)) < 0.1, m
    assert m["final_eval_loss"] < m["first_eval_loss"] - 1.5, m
    evals = [r for r in rows if r.get("eval_loss") is not None]
    assert [r["step"] for r in evals] == [0, 6, 12, 18, 24, 30, 36, 42, 48, 54, 60]
    assert all(math.isclose(r["eval_ppl"], math.exp(r["eval_loss"])) for r in evals)
    assert sum(1 for r in rows if r.get("loss") is not None) == 60

    # parameters, each tensor once: the hand formula (tied output = the embedding)
    d, ff = 32, pt.mlp_width(32)
    body = 1 * (4 * d * d + 3 * d * ff + 2 * d) + d  # attention, SwiGLU, two RMSNorm gains per layer, final norm
    assert res.info["non_embedding_parameters"] == body and res.info["parameters"] == body + 258 * d

    # registered: the final model and checkpoints at steps 0 and 30 open like any model
    assert [c["name"] for c in res.checkpoints] == ["tiny-step0", "tiny-step30"]
    lm = load_model("tiny", device="cpu")
    assert lm.source == "finetuned" and lm.meta["from_scratch"] and lm.n_params == body + 258 * d
    init = load_model("tiny-step0", device="cpu")
    # the held-out loss of what was registered, recomputed with transformers' own loss (labels=)
    held = pt.encode_docs(lm.tokenizer, docs[1])
    w = pt.eval_windows(held, TINY["context"], TINY["eval_tokens"])
    with torch.no_grad():
        ref = lm.model(input_ids=w, labels=w).loss.item()
        ref0 = init.model(input_ids=w, labels=w).loss.item()
    assert ref == pytest.approx(m["final_eval_loss"], abs=1e-4)
    assert ref0 == pytest.approx(m["first_eval_loss"], abs=1e-4)
    from model_core.core.registry import list_models

    row = next(r for r in list_models() if r["name"] == "tiny")
    assert row["description"].startswith("trained from scratch")


def test_cancel_registers_nothing(docs, data_dir):
    n = [0]

    def stop():
        n[0] += 1
        return n[0] > 5

    with pytest.raises(pt.PretrainCancelled):
        pt.run_pretrain({**TINY, "max_steps": 50, "keep_checkpoints": 2, "output_name": "gone"}, *docs,
                        should_stop=stop)
    assert not any((data_dir / "models").iterdir())


def test_settings_are_checked():
    with pytest.raises(LmscopeError, match="multiple of 16"):
        pt.validate_settings({"width": 40})
    with pytest.raises(LmscopeError, match="between"):
        pt.validate_settings({"layers": 0})
    with pytest.raises(LmscopeError, match="at least two"):
        pt.parse_widths("64")
    assert pt.parse_widths("256, 64,128") == [64, 128, 256]
    assert pt.checkpoint_steps(100, 4) == [0, 25, 50, 75]
    assert pt.validate_settings({"tokens": 100_000, "batch_size": 16, "context": 128}).steps() == 49


def test_power_law_fit_recovers_exponent():
    ns = [2e4, 6e4, 2e5, 7e5, 2e6, 8e6]
    exact = [5.0 * n ** -0.3 for n in ns]
    f = pt.fit_power_law(ns, exact)
    assert f["alpha"] == pytest.approx(0.3, abs=1e-9) and f["a"] == pytest.approx(5.0, rel=1e-9)
    assert f["r2"] == pytest.approx(1.0) and f["alpha_stderr"] == pytest.approx(0.0, abs=1e-9)
    # with multiplicative noise: still ≈ 0.3, and the same line numpy fits
    rng = np.random.default_rng(0)
    noisy = [y * math.exp(rng.normal(0, 0.02)) for y in exact]
    f = pt.fit_power_law(ns, noisy)
    slope, icpt = np.polyfit(np.log(ns), np.log(noisy), 1)
    assert f["alpha"] == pytest.approx(-slope, abs=1e-12) and f["log_a"] == pytest.approx(icpt, abs=1e-12)
    assert abs(f["alpha"] - 0.3) < 0.02 and f["r2"] > 0.98 and 0 < f["alpha_stderr"] < 0.02
    # with an irreducible loss: the offset fit finds it, the plain power law cannot
    off = [1.5 + 40.0 * n ** -0.3 for n in ns]
    g = pt.fit_power_law_offset(ns, off)
    assert abs(g["alpha"] - 0.3) < 0.02 and abs(g["E"] - 1.5) < 0.02
    assert pt.fit_power_law(ns, off)["alpha"] < 0.2
    assert pt.fit_power_law_offset(ns[:3], off[:3]) is None
    with pytest.raises(LmscopeError):
        pt.fit_power_law([1e5, 1e5], [3.0, 2.0])
    # the published laws as printed: Kaplan's L(N_c) = 1; Chinchilla tends to E
    assert pt.kaplan_loss(8.8e13) == pytest.approx(1.0)
    assert pt.chinchilla_loss(1e30, 1e30) == pytest.approx(1.69, abs=1e-5)


# ---- against a real worker ------------------------------------------------------------------

class Services(LiveServices):
    # one torch thread in the worker: two spinning OpenMP threads on a shared 2-core machine make
    # small training steps several times slower (see tests/integration/test_patching_job.py)
    def env(self) -> dict[str, str]:
        return {**super().env(), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = Services(tmp_path_factory.mktemp("pretrain-jobs"), stale_s=10.0).start()
    yield s
    s.stop()


def _cli(svc, *args, timeout=240):
    env = {**os.environ, **svc.env()}
    out = subprocess.run([sys.executable, "-m", "app.server.cli", "jobs", "submit", *args, "--wait", "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:] + svc.worker_log()
    return json.loads(out.stdout)


@pytest.mark.integration
def test_scaling_sweep_through_cli(svc):
    from model_core.core.registry import load_model
    from tasks.pretrain_job import read_result

    rec = _cli(svc, "scaling", "--widths", "32,48,64", "--layers", "1", "--context", "64", "--batch-size", "8",
               "--tokens", "20480", "--eval-tokens", "1024", "--lr", "3e-3", "--keep-checkpoints", "2",
               "--output-name", "sweep")
    assert rec["state"] == "succeeded" and rec["kind"] == "scaling", rec
    fit = rec["pretrain"]["fit"]
    assert math.isfinite(fit["alpha"]) and fit["n_points"] == 3 and math.isfinite(fit["alpha_stderr"])
    pts = rec["pretrain"]["points"]
    assert [p["width"] for p in pts] == [32, 48, 64] and all(p["tokens"] == 20480 for p in pts)
    # the reported exponent is the least-squares fit of the reported points (recomputed here)
    ref = np.polyfit(np.log([p["n_non_embedding"] for p in pts]), np.log([p["final_eval_loss"] for p in pts]), 1)
    assert fit["alpha"] == pytest.approx(-ref[0], abs=1e-9)
    assert read_result(rec)["fit"]["alpha"] == pytest.approx(fit["alpha"])
    # the live curve: every width's rows, held-out loss at step 0 and at the end
    hist = rec["pretrain"]["history"]
    for w in (32, 48, 64):
        ev = [h for h in hist if h.get("width") == w and h.get("eval_loss") is not None]
        assert ev[0]["step"] == 0 and ev[-1]["step"] == 40 and ev[-1]["eval_loss"] < ev[0]["eval_loss"] - 1
    # every model the sweep registered opens, checkpoints included
    os.environ["LMSCOPE_DATA_DIR"] = str(svc.data_dir)  # svc.start() set it; be explicit for load_model
    for w in (32, 48, 64):
        lm = load_model(f"sweep-d{w}", device="cpu")
        assert lm.model.config.hidden_size == w and lm.meta["from_scratch"]
        assert load_model(f"sweep-d{w}-step20", device="cpu").meta["step"] == 20
    assert "α =" in rec["log"][-1]


@pytest.mark.integration
def test_depth_sweep_through_cli(svc):
    """Two depths at the non-embedding N of width 32 x 1 layer: each at its own width, the same
    tokens, counted parameters within a few % of each other, no fit; bad depths queue nothing."""
    from model_core.core.registry import load_model
    from tasks import jobs, store
    from tasks.pretrain_job import read_result

    rec = _cli(svc, "scaling", "--depths", "1,2", "--width", "32", "--layers", "1", "--context", "64",
               "--batch-size", "8", "--tokens", "10240", "--eval-tokens", "1024", "--lr", "3e-3",
               "--output-name", "deep")
    assert rec["state"] == "succeeded" and rec["kind"] == "scaling", rec
    res = read_result(rec)
    assert res["sweep"] == "depth" and res["fit"] is None and "nothing to fit" in res["fit_note"]
    assert res["params"] == pt.shape_params(32, 1)
    pts = res["points"]
    assert [p["layers"] for p in pts] == [1, 2] and pts[0]["width"] == 32 and pts[1]["width"] < 32
    assert rec["pretrain"]["points"] == pts and rec["pretrain"]["fit"] is None
    os.environ["LMSCOPE_DATA_DIR"] = str(svc.data_dir)
    for p in pts:
        assert p["tokens"] == 10240 and p["model_name"] == f"deep-L{p['layers']}-d{p['width']}"
        assert math.isfinite(p["final_eval_loss"]) and p["final_eval_loss"] < p["first_eval_loss"] - 0.5
        lm = load_model(p["model_name"], device="cpu")
        cfg = lm.model.config
        assert (cfg.num_hidden_layers, cfg.hidden_size) == (p["layers"], p["width"])
        # the recorded N is the registered model's own count
        assert pt.param_counts(lm.model)["non_embedding"] == p["n_non_embedding"]
    ns = [p["n_non_embedding"] for p in pts]
    assert (max(ns) - min(ns)) / res["params"] < 0.07, ns
    assert "no L(N) fit" in rec["log"][-1]
    # a depth sweep the deepest shape cannot match: one sentence, nothing queued
    before = set(store.list_ids(None, 10_000, store.client()))
    with pytest.raises(LmscopeError, match="too few for 8 layers"):
        jobs.submit("scaling", {"depths": "1,8", "params": 5000, "output_name": "never"}, owner="t")
    assert set(store.list_ids(None, 10_000, store.client())) == before


@pytest.mark.integration
def test_pretrain_through_cli_then_cancel(svc):
    from tasks import jobs

    rec = _cli(svc, "pretrain", "--width", "32", "--layers", "1", "--max-steps", "12", "--context", "64",
               "--batch-size", "8", "--eval-tokens", "512", "--output-name", "one")
    assert rec["state"] == "succeeded" and rec["pretrain"]["model_name"] == "one"
    m = rec["pretrain"]["metrics"]
    assert m["final_eval_loss"] < m["first_eval_loss"] and m["steps"] == 12
    assert (svc.data_dir / "models" / "one" / "model.safetensors").exists()
    # the name is taken now: refused at submission, nothing queued
    with pytest.raises(LmscopeError, match="already exists"):
        jobs.submit("pretrain", {"width": 32, "output_name": "one"})
    # a cancel between steps registers nothing
    r = jobs.submit("pretrain", {**TINY, "max_steps": 5000, "output_name": "long"}, owner="t")
    t0 = time.time()
    while True:
        cur = jobs.get_job(r["id"])
        if cur["state"] == "running" and ((cur.get("pretrain") or {}).get("latest") or {}).get("step", 0) >= 2:
            break
        assert cur["state"] in ("queued", "running") and time.time() - t0 < 60, (cur, svc.worker_log())
        time.sleep(0.1)
    assert jobs.cancel_job(r["id"])["state"] == "cancelled"
    time.sleep(1.5)
    assert jobs.get_job(r["id"])["state"] == "cancelled"
    assert not (svc.data_dir / "models" / "long").exists()
