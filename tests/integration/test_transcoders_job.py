"""Circuits of the real default model through the CLI (real Valkey + a real Celery worker):
`lmscope jobs submit transcoders --wait --json` trains a transcoder for every layer of
smollm2-135m-instruct and reports each layer's quality; `lmscope attribute --json` on the saved set
returns a graph whose checks pass and whose target logit is transformers' own logit for the prompt.
(Few tokens: the mechanics and the checks on the real model, not transcoders worth reading.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from tests.helpers.services import LiveServices

    s = LiveServices(tmp_path_factory.mktemp("transcoders-job"), stale_s=6.0).start()
    yield s
    s.stop()


def _cli(svc, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "app.server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **svc.env()})


def test_transcoders_job_then_an_attribution_graph_on_the_real_model(svc):
    out = _cli(svc, "jobs", "submit", "transcoders", "--model", MODEL, "--max-tokens", "2048", "--context", "64",
               "--batch-size", "8", "--k", "16", "--expansion-factor", "2", "--eval-tokens", "256", "--output-name", "smol-tc", "--wait", "--json")
    assert out.returncode == 0, out.stderr[-2000:] + svc.worker_log()
    rec = json.loads(out.stdout)
    assert rec["state"] == "succeeded", rec
    t = rec["transcoders"]
    assert t["name"] == "smol-tc" and t["layers"] == list(range(30))
    q = t["quality"]
    assert sorted(q["per_layer"], key=int) == [str(i) for i in range(30)]
    assert all(isinstance(v["explained"], float) for v in q["per_layer"].values())
    assert 0 <= q["top1_agreement"] <= 1 and q["ce_clean"] < q["ce_zero"]
    assert "mean variance explained" in rec["log"][-1] and "saved as 'smol-tc'" in rec["log"][-1]

    # every node and edge kept (thresholds 1): transcoders trained on 2,048 tokens explain little, so
    # error nodes carry most of the influence and the default pruning would keep few features
    out = _cli(svc, "attribute", PROMPT, "--model", MODEL, "--transcoders", "smol-tc", "--max-feature-nodes", "64",
               "--node-threshold", "1", "--edge-threshold", "1", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    g = json.loads(out.stdout)
    for name in ("logit", "completeness", "pre_activations", "intervention"):
        assert g["checks"][name]["ok"], (name, g["checks"][name])
    # the reference: transformers' own forward of the prompt, in this process
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_core.core.registry import converted_dir

    path = converted_dir(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = ref(**tok(PROMPT, return_tensors="pt")).logits[0, -1]
    assert g["target"] == int(logits.argmax()) and g["target_token"] == " Paris"
    assert abs(g["checks"]["logit"]["frozen"] - float(logits[g["target"]])) < 1e-3
    features = [n for n in g["nodes"] if n["kind"] == "feature"]
    assert features and g["edges"] and all(n["value"] > 0 for n in features)
    assert g["settings"] == {"transcoders": "smol-tc", "max_feature_nodes": 64, "node_threshold": 1.0,
                             "edge_threshold": 1.0}
    assert g["stats"]["rows_computed"] == 65

    bad = _cli(svc, "attribute", PROMPT, "--model", MODEL, "--transcoders", "smol-tc", "--target", " Paris is")
    assert bad.returncode == 2 and "give one token" in bad.stderr

    # the set leaves for circuit-tracer's layout and comes back through the CLI; the graph on the
    # imported copy is the same graph (same nodes, same frozen logit)
    dest = svc.data_dir.parent / "smol-tc-circuit-tracer"
    out = _cli(svc, "transcoders", "export", "smol-tc", str(dest), "--format", "circuit-tracer", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(json.loads(out.stdout)["files"]) == 31 and (dest / "layer_29.safetensors").is_file()
    out = _cli(svc, "transcoders", "import", str(dest), "--name", "smol-tc-back", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    back = json.loads(out.stdout)
    assert back["model"] == MODEL and back["layers"] == list(range(30)) and back["from"]["format"] == "circuit-tracer"
    out = _cli(svc, "attribute", PROMPT, "--model", MODEL, "--transcoders", "smol-tc-back", "--max-feature-nodes",
               "64", "--node-threshold", "1", "--edge-threshold", "1", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    g2 = json.loads(out.stdout)
    assert {n["id"] for n in g2["nodes"]} == {n["id"] for n in g["nodes"]}
    assert abs(g2["checks"]["logit"]["frozen"] - g["checks"]["logit"]["frozen"]) < 1e-4
