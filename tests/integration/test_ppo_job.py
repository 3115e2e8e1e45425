"""RLHF with PPO as a background job (kind 'ppo', tasks/preference_job.py -> model_core.training.ppo)
against a real Valkey and a real Celery worker (tests/helpers/services.py), on the real default model:

- a reward model trained by the reward job through `lmscope jobs submit reward ... --wait --json`;
- bad input refused at submission with one sentence and nothing queued: a reward model on another
  tokenizer, a model that is not a reward model, no reward model, a bad PPO setting;
- `lmscope jobs submit ppo --model M --reward-model R --wait --json` succeeds, registers a model that
  load_model opens (what Explore opens), its history has PPO's fields (step 1's KL is 0: the LoRA
  policy starts as the reference), each sampled rollout's per-token rewards equal -beta KL_t with the
  score added at the last token, its held-out reward-model scores are recomputed from the registered
  reward model with transformers alone, and the held-out reward-model score rises.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.services import LiveServices

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
TIMES: dict[str, float] = {}
PPO_FIELDS = ("loss", "policy_loss", "value_loss", "reward_mean", "reward_std", "kl", "kl_k3", "beta",
              "non_score_reward", "clip_fraction", "value_clip_fraction", "approx_kl", "entropy", "value_mean",
              "return_mean", "advantage_std", "completion_length", "grad_norm", "tokens_per_s", "step_s", "elapsed_s")


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = LiveServices(tmp_path_factory.mktemp("ppo-job"), stale_s=60.0).start()
    yield s
    s.stop()
    if TIMES:
        print("\nPPO test wall times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in TIMES.items()))




def _submit_wait(svc, name, *args):
    t0 = time.time()
    out = svc.submit(*args, "--wait", "--json", timeout=900)
    TIMES[name] = time.time() - t0
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:] + svc.worker_log()
    return json.loads(out.stdout)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _refused(svc, words: str, *args) -> None:
    """Refused at submission: exit 2, one sentence naming `words` on stderr, no job recorded or run."""
    from tasks import jobs

    before = [r["id"] for r in jobs.list_jobs(limit=1000)]
    dirs = sorted(p.name for p in (svc.data_dir / "jobs").iterdir()) if (svc.data_dir / "jobs").exists() else []
    out = svc.submit("ppo", *args, "--json", timeout=120)
    err = out.stderr.strip()
    assert out.returncode == 2 and out.stdout == "", (args, out.stdout, err)
    assert err.startswith("error: ") and words in err and "\n" not in err and err.endswith("."), (args, err)
    assert err.count(". ") == 0, err  # one sentence
    assert [r["id"] for r in jobs.list_jobs(limit=1000)] == before
    assert (sorted(p.name for p in (svc.data_dir / "jobs").iterdir()) if (svc.data_dir / "jobs").exists()
            else []) == dirs


def test_ppo_against_a_trained_reward_model(svc):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from model_core.core.registry import list_models, load_model

    # 1. the reward model, by the reward job
    rm_rec = _submit_wait(svc, "reward job", "reward", "--model", MODEL, "--max-steps", "4", "--batch-size", "4",
                          "--train-size", "16", "--eval-examples", "8", "--max-length", "128",
                          "--output-name", "rm-for-ppo")
    assert rm_rec["state"] == "succeeded", rm_rec["log"]

    # 2. bad input: one sentence each, nothing queued or run
    _refused(svc, "uses another tokenizer", "--model", "random-llama-tiny", "--reward-model", "rm-for-ppo")
    _refused(svc, "No reward model named 'no-such-rm'", "--model", MODEL, "--reward-model", "no-such-rm")
    _refused(svc, "PPO needs a reward model", "--model", MODEL)
    _refused(svc, "'ppo_epochs' must be between 1", "--model", MODEL, "--reward-model", "rm-for-ppo",
             "--ppo-epochs", "0")
    _refused(svc, "is a reward model (a score head), not a language model", "--model", "rm-for-ppo",
             "--reward-model", "rm-for-ppo")

    # 3. PPO against it
    beta = 0.05
    rec = _submit_wait(svc, "ppo job", "ppo", "--model", MODEL, "--reward-model", "rm-for-ppo", "--max-steps", "4",
                       "--prompts-per-step", "2", "--group-size", "2", "--max-completion-length", "12",
                       "--ppo-epochs", "2", "--eval-examples", "8", "--beta", str(beta), "--lr", "1e-3",
                       "--output-name", "ppo-cli")
    assert rec["state"] == "succeeded" and rec["kind"] == "ppo", rec["log"]
    pref = rec["preference"]
    assert pref["kind"] == "ppo" and pref["model_name"] == "ppo-cli" and pref["reward_model"] == "rm-for-ppo"
    assert rec["params"]["reward_model"] == "rm-for-ppo" and rec["params"]["method"] == "lora"
    assert rec["params"]["batch_size"] == 4 and rec["params"]["ppo_epochs"] == 2

    hist = pref["history"]
    assert [h["step"] for h in hist] == [1, 2, 3, 4] and all(h["total"] == 4 for h in hist)
    for h in hist:
        for k in PPO_FIELDS:
            assert _finite(h[k]), (k, h)
        assert 0 <= h["clip_fraction"] <= 1 and 0 < h["completion_length"] <= 12 and h["beta"] == beta
    # step 1's rollouts come from the policy before any update, and LoRA's B starts at zero: the policy
    # is the reference, so every token's KL is 0
    assert hist[0]["kl"] == pytest.approx(0, abs=1e-5) and hist[0]["kl_k3"] == pytest.approx(0, abs=1e-5)

    # the per-token view of the sampled rollouts: r_t = -beta KL_t, and the score at the last token
    steps = pref["samples_by_step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for st in steps:
        assert len(st["samples"]) == 3
        for smp in st["samples"]:
            n = len(smp["tokens"])
            assert n >= 1 and all(len(smp[k]) == n for k in ("kl", "rewards", "values", "advantages", "returns"))
            want = [-beta * k for k in smp["kl"]]
            want[-1] += smp["score"]
            assert smp["rewards"] == pytest.approx(want, abs=2e-4), smp
    assert pref["samples"]["step"] == 4 and pref["samples"]["samples"] == steps[-1]["samples"]

    # held-out: greedy answers scored by the reward model; the recorded scores recomputed with
    # transformers alone from the registered reward model's folder
    before, after = pref["before"], pref["after"]
    assert before["n"] == after["n"] == 8
    folder = svc.data_dir / "models" / "rm-for-ppo"
    rm = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    rtok = AutoTokenizer.from_pretrained(str(folder))
    for ev in (before, after):
        for ex in ev["examples"]:
            ids = rtok.apply_chat_template([{"role": "user", "content": ex["prompt"]},
                                            {"role": "assistant", "content": ex["completion"]}], tokenize=True,
                                           return_dict=False)
            with torch.no_grad():
                got = float(rm(input_ids=torch.tensor([list(ids)])).logits[0, 0])
            assert got == pytest.approx(ex["score"], abs=1e-3), ex
    print(f"\nPPO held-out reward-model score {before['mean_score']:.3f} -> {after['mean_score']:.3f}; verifiable "
          f"reward {before['mean_reward']:.3f} -> {after['mean_reward']:.3f}; sampled reward per step "
          f"{[round(h['reward_mean'], 3) for h in hist]}; kl {[round(h['kl'], 3) for h in hist]}; "
          f"s/step {[h['step_s'] for h in hist]}")
    assert after["mean_score"] > before["mean_score"], (before, after)
    assert f"{before['mean_score']:.3f} -> {after['mean_score']:.3f}" in rec["log"][-1]

    # registered, and it opens the way Explore opens a model
    row = next((r for r in list_models(include_random=False) if r["name"] == "ppo-cli"), None)
    assert row is not None and row["source"] == "finetuned" and row["parent"] == MODEL, row
    meta = json.loads((svc.data_dir / "models" / "ppo-cli" / "lmscope.json").read_text())
    assert meta["kind"] == "ppo" and meta["reward_model"] == "rm-for-ppo"
    assert (svc.data_dir / "models" / "ppo-cli" / "value_head.safetensors").exists()
    lm = load_model("ppo-cli")
    assert lm.meta.get("kind") == "ppo" and lm.source == "finetuned"
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([lm.tokenizer("The capital of France is")["input_ids"]])).logits
    assert bool(torch.isfinite(logits).all())

    # a model that is not a reward model, as the reward model: one sentence, nothing queued
    _refused(svc, "'ppo-cli' is not a reward model (it was made by ppo)", "--model", MODEL, "--reward-model", "ppo-cli")
