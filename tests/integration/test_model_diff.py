"""What fine-tuning changed (issue 43), on the real default model and an SFT model trained by the
app's own job through a real worker: `lmscope diff` on a prompt gives per-token KL(base || tuned)
equal to one computed from transformers' own logits of the two checkpoints (AutoModelForCausalLM,
float64 softmax) within 1e-4, a model against itself gives exactly 0, and the corpus job ranks
contexts whose KL is transformers' at that context. The SFT job kept two checkpoints and computed its
own short diff when it finished; `lmscope diff --across-run` gives the KL at each checkpoint, each
transformers' for that checkpoint's weights, 0 at the base and the plain diff's at the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = "smollm2-135m-instruct"
PROMPT = "Reformat the date 2024-03-15 as DD/MM/YYYY."


def _cli(*args: str, timeout: float = 300) -> dict:
    out = subprocess.run([sys.executable, "-m", "app.server.cli", *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _kl_from_transformers(base_hf, tuned_hf, ids: list[int]) -> torch.Tensor:
    """[T] KL(base || tuned) from transformers' logits of the two checkpoints."""
    with torch.no_grad():
        x = torch.tensor([ids])
        lb = torch.log_softmax(base_hf(x).logits[0].double(), -1)
        lt = torch.log_softmax(tuned_hf(x).logits[0].double(), -1)
    return (lb.exp() * (lb - lt)).sum(-1)


def test_diff_on_a_prompt_and_over_the_corpus(tmp_path):
    from model_core import load_model
    from tests.helpers.services import LiveServices

    svc = LiveServices(tmp_path / "data", stale_s=20.0).start()
    try:
        # an SFT model trained by the app's own job (LoRA, merged into a plain checkpoint)
        rec = _cli("jobs", "submit", "sft", "--model", DEFAULT, "--lora-rank", "8", "--max-steps", "6",
                   "--batch-size", "4", "--lr", "2e-3", "--output-name", "diff-tuned", "--keep-checkpoints", "2",
                   "--wait", "--timeout", "600", "--json", timeout=660)
        assert rec["state"] == "succeeded", svc.worker_log()
        base_lm = load_model(DEFAULT)

        # per prompt, through the CLI
        d = _cli("diff", "--base", DEFAULT, "--tuned", "diff-tuned", "--prompt", PROMPT, "--json")
        ids = base_lm.tokenizer(PROMPT)["input_ids"]
        assert len(d["kl"]) == len(ids) == len(d["tokens"]) and d["vocabulary"] == "same"
        from model_core.core.registry import converted_dir, finetuned_path

        base_hf, tuned_hf = _hf(converted_dir(DEFAULT)), _hf(finetuned_path("diff-tuned"))
        ref = _kl_from_transformers(base_hf, tuned_hf, ids)
        assert torch.allclose(torch.tensor(d["kl"], dtype=torch.float64), ref, atol=1e-4, rtol=0), (d["kl"], ref)
        assert max(d["kl"]) > 1e-3  # the run changed something this test can see
        # the largest KL's gained/lost tokens are the largest probability changes, with their signs
        t = max(range(len(ids)), key=lambda i: d["kl"][i])
        assert d["gained"][t] and all(v > 0 for _, v in d["gained"][t]) and all(v < 0 for _, v in d["lost"][t])
        # LoRA leaves the embeddings: the streams are equal there and part at a layer
        assert len(d["resid_diff"]) == base_lm.shape.n_layers + 1 and set(d["resid_diff"][0]) == {0.0}
        assert any(p is not None and p > 0 for p in d["parted_at"])
        # the job's own diff, computed as it finished, follows the run through its checkpoints
        own = json.loads((svc.data_dir / "jobs" / rec["id"] / "diff.json").read_text())
        assert own["meta"]["precomputed"] and own["tokens"] == 2048 and own["contexts"][0]["kl"] > 0
        assert own["across_run"]["steps"] == [0, 2, 4, 6] and own["across_run"]["models"][-1] == "diff-tuned"
        # when did it change, through the CLI: each point is transformers' KL for that checkpoint
        run = _cli("diff", "--base", DEFAULT, "--tuned", "diff-tuned", "--prompt", PROMPT, "--across-run", "--json")
        assert run["steps"] == [0, 2, 4, 6] and set(run["kl"][0][0]) == {0.0}
        assert run["kl"][-1][0] == d["kl"]  # the final model's point is the plain diff's KL
        mid = _kl_from_transformers(base_hf, _hf(finetuned_path(run["models"][1])), ids)
        assert torch.allclose(torch.tensor(run["kl"][1][0], dtype=torch.float64), mid, atol=1e-4, rtol=0)
        assert 0 < run["mean_kl"][1][0] != run["mean_kl"][3][0]
        same = _cli("diff", "--base", DEFAULT, "--tuned", DEFAULT, "--prompt", PROMPT, "--json")
        assert set(same["kl"]) == {0.0} and all(p is None for p in same["parted_at"])
        assert all(v == 0.0 for row in same["head_js"] for v in row)

        # over the corpus, as a job: contexts ranked by KL, each KL transformers' at that context
        job = _cli("jobs", "submit", "diff", "--tuned", "diff-tuned", "--max-tokens", "512", "--window", "32",
                   "--wait", "--timeout", "600", "--json", timeout=660)
        assert job["state"] == "succeeded", svc.worker_log()
        assert job["params"]["base"] == DEFAULT  # the tuned model's parent
        report = json.loads((svc.data_dir / "jobs" / job["id"] / "diff.json").read_text())
        kls = [c["kl"] for c in report["contexts"]]
        assert len(kls) >= 10 and kls == sorted(kls, reverse=True) and kls[0] > 0
        from model_core.interp.neurons import corpus_windows
        from tasks.corpus import builtin_docs

        windows = corpus_windows(base_lm.tokenizer, builtin_docs("heldout"), 512, 32)
        top = report["contexts"][0]
        ref = _kl_from_transformers(base_hf, tuned_hf, windows[top["window"]].tolist())
        assert abs(float(ref[top["position"]]) - top["kl"]) < 1e-4
        assert report["kl_by_next_token"][0]["kl_sum"] >= report["kl_by_next_token"][-1]["kl_sum"]
        assert len(report["head_js"]) == base_lm.shape.n_layers and len(report["head_js"][0]) == base_lm.shape.n_heads
    finally:
        svc.stop()


def test_different_tokenizers_refused_before_any_forward():
    out = subprocess.run([sys.executable, "-m", "app.server.cli", "diff", "--base", DEFAULT, "--tuned",
                          "random-gpt2-tiny", "--prompt", "hi"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode != 0
    assert "use different tokenizers" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
