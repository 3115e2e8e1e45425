"""Reward / DPO / GRPO as background jobs (tasks/preference_job.py) against a real Valkey and a real
Celery worker (tests/helpers/services.py), on the real default model with a few steps each.

- a malformed upload is refused at submission, every bad line named by its number, nothing queued;
- DPO through `lmscope jobs submit dpo ... --wait --json`: succeeds, registers a model the registry
  lists, the record holds the history (step 1's loss is ln 2: policy = reference) and the held-out
  numbers before/after; the after numbers are recomputed here from the registered model and its
  parent with a plain forward pass per sequence;
- a cancelled run (the cancel flag only, so the run itself must notice it) ends cancelled and
  registers nothing;
- Dr. GRPO through the CLI: finite rewards, each completion's reward recomputed by hand (the last
  number equals the sum) and Dr. GRPO's advantages = reward - group mean.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.services import LiveServices

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = LiveServices(tmp_path_factory.mktemp("preference-jobs"), stale_s=30.0).start()
    yield s
    s.stop()
    if TIMES:
        print("\npreference job wall times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in TIMES.items()))




def _submit_wait(svc, name, *args):
    t0 = time.time()
    out = svc.submit(*args, "--wait", "--json")
    TIMES[name] = time.time() - t0
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:] + svc.worker_log()
    return json.loads(out.stdout)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _registered(name: str) -> dict | None:
    from model_core.core.registry import list_models

    return next((r for r in list_models(include_random=False) if r["name"] == name), None)


def _opens_in_the_compare_view(name: str, parent: str, changed: bool = True) -> None:
    """A model a CLI run registered is in the Fine-tune tab's compare menu and its compare view runs
    against its parent; the mean next-token KL the headline states is recomputed here from both
    models' plain transformers forwards of the same tokens."""
    from app.server.page import finetuned_choices
    from app.tabs.finetune import tab as sft_tab
    from model_core.core.registry import load_model
    from model_core.interp.trace import encode_prompt

    assert name in [v for _, v in finetuned_choices()]
    prompt = "Convert 2024-03-15 to DD/MM/YYYY."
    headline = sft_tab.compare(None, name, prompt, False)[0]
    assert f"**{name}** vs **{parent}**" in headline, headline
    base, tuned = load_model(parent), load_model(name)
    ids = torch.tensor([encode_prompt(base, prompt, chat=False)])
    with torch.no_grad():
        lb = torch.log_softmax(base.model(input_ids=ids).logits[0].double(), -1)
        lt = torch.log_softmax(tuned.model(input_ids=ids).logits[0].double(), -1)
    kl = (lt.exp() * (lt - lb)).sum(-1)  # [T]
    assert f"**{float(kl.mean()):.4f}** nats on average" in headline, (float(kl.mean()), headline)
    if changed:  # the run changed the model, or the view compares a model with itself
        assert float(kl.max()) > 0


def _summed_logp(lm, prompt: str, completion: str) -> float:
    """log p(completion | prompt) summed over the completion's tokens, one plain forward pass of the
    unpadded conversation; the completion starts where the chat template's prompt (with the
    generation prompt) and the whole conversation part (as TRL splits them)."""
    tok = lm.tokenizer
    msgs = [{"role": "user", "content": prompt}]
    p = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    full = list(tok.apply_chat_template(msgs + [{"role": "assistant", "content": completion}], tokenize=True,
                                        return_dict=False))
    k = next(i for i, (a, b) in enumerate(zip(p + [None], full)) if a != b)
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([full])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(full[1:]).unsqueeze(-1)).squeeze(-1)
    return float(lp[k - 1:].sum())


# ---- a malformed upload: refused by line number, nothing queued ------------------------------------

@pytest.mark.integration
def test_malformed_upload_is_refused_by_line_and_nothing_is_queued(svc, tmp_path):
    from model_core.training.preference_data import PreferenceDataError
    from tasks import jobs

    lines = [
        json.dumps({"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Well, it is Paris."}),
        '{"prompt": "Capital of Spain?", "chosen": "Madrid."',  # 2: cut off
        json.dumps({"prompt": "Capital of Italy?", "chosen": "Rome.", "rejected": "It might be Rome."}),
        json.dumps({"prompt": "Capital of Peru?", "chosen": "Lima."}),  # 4: no 'rejected'
        json.dumps({"prompt": "2 + 2?", "chosen": "4", "rejected": " 4 "}),  # 5: the same answer
    ]
    bad = tmp_path / "pairs.jsonl"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    before = [r["id"] for r in jobs.list_jobs(limit=1000)]
    job_dirs = sorted(p.name for p in (svc.data_dir / "jobs").iterdir()) if (svc.data_dir / "jobs").exists() else []

    out = svc.submit("dpo", "--model", MODEL, "--dataset", str(bad), "--max-steps", "1", "--json")
    assert out.returncode == 2, out.stdout + out.stderr
    err = out.stderr.strip()
    assert err.startswith("error: 3 of 5 lines in 'pairs.jsonl' are malformed; nothing was run."), err
    assert "Line 2: not valid JSON" in err and "Line 4: missing 'rejected'" in err
    assert "Line 5: 'chosen' and 'rejected' are the same text" in err
    assert "Line 1:" not in err and "Line 3:" not in err and out.stdout == ""

    # the job service itself (what the web's upload calls): the same lines, as data
    with pytest.raises(PreferenceDataError) as e:
        jobs.submit("reward", {"model": MODEL}, owner="t-bad", files=[bad])
    assert [n for n, _ in e.value.lines] == [2, 4, 5]
    tasks_file = tmp_path / "tasks.jsonl"  # GRPO: an answer the 'number' verifier cannot check
    tasks_file.write_text(json.dumps({"prompt": "1 + 1?", "answer": "2", "verifier": "number"}) + "\n"
                          + json.dumps({"prompt": "1 + 2?", "answer": "three", "verifier": "number"}) + "\n")
    with pytest.raises(PreferenceDataError) as e:
        jobs.submit("grpo", {"model": MODEL}, owner="t-bad", files=[tasks_file])
    assert [n for n, _ in e.value.lines] == [2] and "Line 2:" in str(e.value)

    assert [r["id"] for r in jobs.list_jobs(limit=1000)] == before
    after_dirs = sorted(p.name for p in (svc.data_dir / "jobs").iterdir()) if (svc.data_dir / "jobs").exists() else []
    assert after_dirs == job_dirs


# ---- DPO through the CLI ----------------------------------------------------------------------------

@pytest.mark.integration
def test_dpo_job_through_cli_registers_a_better_model(svc):
    from model_core.core.registry import load_model

    beta = 0.1
    rec = _submit_wait(svc, "dpo", "dpo", "--model", MODEL, "--dataset", "builtin", "--beta", str(beta),
                       "--max-steps", "2", "--batch-size", "2", "--train-size", "8", "--eval-examples", "8",
                       "--max-length", "128", "--output-name", "dpo-cli")
    assert rec["state"] == "succeeded" and rec["kind"] == "dpo", rec["log"]
    pref = rec["preference"]
    assert pref["kind"] == "dpo" and pref["model_name"] == "dpo-cli"
    assert rec["params"]["beta"] == beta and rec["params"]["max_steps"] == 2 and rec["params"]["method"] == "full"

    hist = pref["history"]
    assert [h["step"] for h in hist] == [1, 2] and all(h["total"] == 2 for h in hist)
    for h in hist:
        for k in ("loss", "accuracy", "margin", "reward_chosen", "reward_rejected", "tokens_per_s", "elapsed_s"):
            assert _finite(h[k]), (k, h)
        assert h["eta_s"] is not None
    # step 1's batch meets the policy before any update: policy = reference, so every implicit reward is
    # 0 and the loss is -log sigmoid(0) = ln 2
    assert hist[0]["loss"] == pytest.approx(math.log(2), abs=1e-4) and hist[0]["margin"] == pytest.approx(0, abs=1e-5)

    before, after = pref["before"], pref["after"]
    assert before["n"] == after["n"] == 8
    # before training the policy is the reference: implicit-reward accuracy and margin are 0 exactly
    assert before["accuracy"] == 0 and before["margin"] == 0
    assert after["margin"] > before["margin"] and after["accuracy"] > before["accuracy"]
    assert 0 <= before["logp_accuracy"] <= 1 and 0 <= after["logp_accuracy"] <= 1
    assert pref["metrics"]["steps"] == 2 and pref["metrics"]["tokens_seen"] > 0
    assert "implicit-reward margin 0.000 -> " in rec["log"][-1] and "dpo-cli" in rec["log"][-1]
    print(f"\nDPO held-out: implicit accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, margin "
          f"{before['margin']:.4f} -> {after['margin']:.4f}; log-prob accuracy {before['logp_accuracy']:.3f} -> "
          f"{after['logp_accuracy']:.3f}, margin {before['logp_margin']:.2f} -> {after['logp_margin']:.2f}")

    # registered: the registry lists it, and it opens the way every picker opens a model
    row = _registered("dpo-cli")
    assert row is not None and row["source"] == "finetuned" and row["parent"] == MODEL, row
    meta = json.loads((svc.data_dir / "models" / "dpo-cli" / "lmscope.json").read_text())
    assert meta["kind"] == "dpo" and meta["after"]["margin"] == pytest.approx(after["margin"])
    policy, ref = load_model("dpo-cli"), load_model(MODEL)
    assert policy.meta.get("kind") == "dpo"
    # the record's held-out examples, recomputed from the registered weights and the parent's (one torch
    # thread: small forwards, and the worker may still be spinning its OpenMP threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for ex in after["examples"]:
            lc, lr = (_summed_logp(policy, ex["prompt"], ex["chosen"]),
                      _summed_logp(policy, ex["prompt"], ex["rejected"]))
            assert lc == pytest.approx(ex["logp_chosen"], abs=2e-3)
            assert lr == pytest.approx(ex["logp_rejected"], abs=2e-3)
            rc, rr = _summed_logp(ref, ex["prompt"], ex["chosen"]), _summed_logp(ref, ex["prompt"], ex["rejected"])
            assert beta * ((lc - rc) - (lr - rr)) == pytest.approx(ex["margin"], abs=5e-4)
        _opens_in_the_compare_view("dpo-cli", MODEL)
    finally:
        torch.set_num_threads(threads)


# ---- a cancel registers nothing ---------------------------------------------------------------------

@pytest.mark.integration
def test_cancelled_run_registers_nothing(svc):
    from tasks import jobs, store

    rec = jobs.submit("dpo", {"model": MODEL, "max_steps": 40, "batch_size": 1, "builtin_train_size": 8,
                              "eval_examples": 0, "max_length": 128, "output_name": "dpo-cancelled"}, owner="t-cancel")
    t0 = time.time()
    while True:  # wait for a training step, so the run is inside TRL's loop when it is cancelled
        cur = jobs.get_job(rec["id"])
        if cur["state"] != "queued" and (cur.get("preference") or {}).get("history"):
            break
        assert cur["state"] in ("queued", "running") and time.time() - t0 < 240, (cur["log"], svc.worker_log())
        time.sleep(0.2)
    # the flag only (no revoke): the run must notice it itself, through should_stop
    store.request_cancel(rec["id"])
    done = jobs.wait_job(rec["id"], timeout=120, poll=0.2)
    TIMES["dpo cancelled"] = time.time() - t0
    assert done["state"] == "cancelled", (done["log"], svc.worker_log())
    assert done["log"][-1].endswith("cancelled; no model was registered")
    assert len(done["preference"]["history"]) < 40
    assert not (svc.data_dir / "models" / "dpo-cancelled").exists() and _registered("dpo-cancelled") is None
    staging = svc.data_dir / "preference-staging"
    assert not [p for p in staging.iterdir() if p.name.startswith("dpo-cancelled.")] if staging.exists() else True


# ---- GRPO through the CLI ---------------------------------------------------------------------------

def _hand_number_reward(completion: str, a: int, b: int) -> float:
    nums = re.findall(r"-?\d+(?:\.\d+)?", completion)
    return float(bool(nums) and float(nums[-1]) == a + b)


@pytest.mark.integration
def test_grpo_job_through_cli(svc):
    rec = _submit_wait(svc, "grpo", "grpo", "--model", MODEL, "--dataset", "builtin", "--loss-type", "dr_grpo",
                       "--max-steps", "1", "--group-size", "4", "--prompts-per-step", "1",
                       "--max-completion-length", "6", "--train-size", "4", "--eval-examples", "4",
                       "--output-name", "grpo-cli")
    assert rec["state"] == "succeeded" and rec["kind"] == "grpo", rec["log"]
    pref = rec["preference"]
    assert rec["params"]["loss_type"] == "dr_grpo" and rec["params"]["num_generations"] == 4
    assert rec["params"]["batch_size"] == 4 and rec["params"]["method"] == "lora"

    (row,) = pref["history"]
    for k in ("loss", "reward_mean", "reward_std", "completion_length", "tokens_per_s"):
        assert _finite(row[k]), (k, row)
    assert 0 <= row["reward_mean"] <= 1 and 0 < row["completion_length"] <= 6

    # the step's group: each reward is the 'number' verifier (the answer's last number is the sum),
    # recomputed here; Dr. GRPO's advantage is reward - the group's mean (no division by its std)
    groups = pref["groups"]["groups"]
    assert pref["groups"]["step"] == 1 and len(groups) == 1
    g = groups[0]
    a, b = map(int, re.match(r"What is (\d) \+ (\d)\?", g["prompt"]).groups())
    assert len(g["completions"]) == len(g["rewards"]) == len(g["advantages"]) == 4
    assert g["rewards"] == [_hand_number_reward(c, a, b) for c in g["completions"]]
    mean = sum(g["rewards"]) / 4
    assert g["advantages"] == pytest.approx([r - mean for r in g["rewards"]], abs=1e-5)
    assert row["reward_mean"] == pytest.approx(mean, abs=1e-6)

    # held-out mean verifiable reward of greedy answers, before and after: each answer re-verified
    for ev in (pref["before"], pref["after"]):
        assert ev["n"] == 4 and _finite(ev["mean_reward"]) and 0 <= ev["mean_reward"] <= 1
        rs = []
        for ex in ev["examples"]:
            a, b = map(int, re.match(r"What is (\d) \+ (\d)\?", ex["prompt"]).groups())
            assert ex["reward"] == _hand_number_reward(ex["completion"], a, b), ex
            rs.append(ex["reward"])
        assert ev["mean_reward"] == pytest.approx(sum(rs) / len(rs))
    print(f"\nGRPO held-out mean reward {pref['before']['mean_reward']:.3f} -> {pref['after']['mean_reward']:.3f}; "
          f"step 1 sampled reward {row['reward_mean']:.3f}")

    listed = _registered("grpo-cli")
    assert listed is not None and listed["source"] == "finetuned" and listed["parent"] == MODEL
    meta = json.loads((svc.data_dir / "models" / "grpo-cli" / "lmscope.json").read_text())
    assert meta["kind"] == "grpo" and meta["training"]["loss_type"] == "dr_grpo"
    # one LoRA step may leave the weights as they were (a group of equal rewards has no advantage)
    _opens_in_the_compare_view("grpo-cli", MODEL, changed=False)


# ---- a reward model from an uploaded file -----------------------------------------------------------

@pytest.mark.integration
def test_reward_job_on_an_upload(svc, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tasks import jobs

    facts = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Peru", "Lima"), ("Japan", "Tokyo"),
             ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Chile", "Santiago")]
    f = tmp_path / "capitals.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"Capital of {c}?", "chosen": f"{x}.",
                                     "rejected": f"Well, after some thought, I would say that it is {x}, I believe."})
                         + "\n" for c, x in facts), encoding="utf-8")
    t0 = time.time()
    rec = jobs.submit("reward", {"model": MODEL, "max_steps": 1, "batch_size": 2, "eval_fraction": 0.25,
                                 "max_length": 128, "output_name": "rm-upload"}, owner="t-reward", files=[f])
    assert rec["params"]["dataset"] == "upload" and rec["params"]["dataset_file"] == "capitals.jsonl"
    assert rec["preference"]["dataset"]["train"] == 6 and rec["preference"]["dataset"]["test"] == 2
    done = jobs.wait_job(rec["id"], timeout=400, poll=0.5)
    TIMES["reward (upload)"] = time.time() - t0
    assert done["state"] == "succeeded", (done["log"], svc.worker_log())
    pref = done["preference"]
    assert [h["step"] for h in pref["history"]] == [1] and _finite(pref["history"][0]["loss"])
    assert "reward model 'rm-upload' registered" in done["log"][-1]
    # the held-out scores, recomputed from the registered folder with transformers alone: the score of
    # the whole conversation (chat template) at its last token
    folder = svc.data_dir / "models" / "rm-upload"
    rm = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    after = pref["after"]
    assert after["n"] == 2 and len(after["examples"]) == 2
    for ex in after["examples"]:
        for key, answer in (("score_chosen", ex["chosen"]), ("score_rejected", ex["rejected"])):
            ids = tok.apply_chat_template([{"role": "user", "content": ex["prompt"]},
                                           {"role": "assistant", "content": answer}], tokenize=True, return_dict=False)
            with torch.no_grad():
                score = float(rm(input_ids=torch.tensor([list(ids)])).logits[0, 0])
            assert score == pytest.approx(ex[key], abs=1e-3), (key, ex)
    margins = [e["score_chosen"] - e["score_rejected"] for e in after["examples"]]
    assert after["margin"] == pytest.approx(sum(margins) / 2) and after["accuracy"] == sum(m > 0 for m in margins) / 2
    print(f"\nreward model held-out: accuracy {pref['before']['accuracy']:.3f} -> {after['accuracy']:.3f}, margin "
          f"{pref['before']['margin']:.3f} -> {after['margin']:.3f}")
    assert json.loads((folder / "lmscope.json").read_text())["kind"] == "reward"
