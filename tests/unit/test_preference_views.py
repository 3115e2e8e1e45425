"""The reward / DPO / GRPO panel (app/tabs/finetune/preference_panel.py) and its pure figures
(app/tabs/finetune/preference_figures.py): figures read a job record shaped as tasks/preference_job.py writes it
(rows with the keys a real 2-step run on random-llama-tiny logged), a malformed upload is refused by
line number before anything is queued, and the per-token log pi/pi_ref of a perturbed copy of
random-llama-tiny sums to the sequence log-ratio computed here with a plain transformers forward."""

from __future__ import annotations

import json
import math

import pytest
import torch

from app.tabs.finetune import preference_figures as pf
from app.tabs.finetune import preference_panel as pp

BETA = 0.1


def _dpo_row(step, total, loss, acc, lc, lr_, rc, rr):
    # the keys model_core.training.preference._callback writes for a DPO step (seen in a real run)
    return {"step": step, "total": total, "loss": loss, "grad_norm": 0.65, "lr": 1e-5, "tokens_seen": 458.0 * step,
            "accuracy": acc, "margin": rc - rr, "reward_chosen": rc, "reward_rejected": rr, "logp_chosen": lc,
            "logp_rejected": lr_, "entropy": 5.5, "tokens_per_s": 90.0 + step, "elapsed_s": 5.0 * step,
            "eta_s": 5.0 * (total - step)}


def _dpo_record(state="running"):
    hist = [_dpo_row(1, 4, 0.6931, 0.5, -65.9, -65.8, -0.0004, -0.0003),
            _dpo_row(2, 4, 0.61, 0.75, -60.0, -70.0, 0.3, -0.7)]
    return {"id": "abc123", "kind": "dpo", "state": state, "progress": {"stage": "training", "fraction": 0.5},
            "params": {"model": "random-llama-tiny", "method": "full", "beta": BETA, "max_steps": 4},
            "preference": {"kind": "dpo", "history": hist, "latest": hist[-1], "model_name": "tiny-dpo",
                           "before": {"n": 4, "logp_accuracy": 0.75, "logp_margin": 385.5, "accuracy": 0.0,
                                      "margin": 0.0},
                           "after": {"n": 4, "logp_accuracy": 1.0, "logp_margin": 390.0, "accuracy": 0.75,
                                     "margin": 0.42}}}


def _group(prompt, comps, rewards):
    m = sum(rewards) / len(rewards)
    sd = math.sqrt(sum((r - m) ** 2 for r in rewards) / (len(rewards) - 1))
    adv = [(r - m) / (sd + 1e-4) for r in rewards]  # TRL's scale_rewards="group"
    return {"prompt": prompt, "completions": comps, "rewards": rewards, "advantages": adv, "mean": m, "std": sd}


def _grpo_record():
    hist = [{"step": s, "total": 3, "loss": 0.01 * s, "reward_mean": rm, "reward_std": sd, "kl": 0.001 * s,
             "completion_length": ln, "reward_group_std": 0.3, "tokens_per_s": 50.0, "eta_s": 3.0}
            for s, rm, sd, ln in ((1, 0.25, 0.4, 11.5), (2, 0.5, 0.5, 9.0))]
    groups = [_group("What is 9 + 7?", ["16", "15", "16", "17"], [1.0, 0.0, 1.0, 0.0]),
              _group("What is 9 + 6?", ["15", "15", "14", "15"], [1.0, 1.0, 0.0, 1.0])]
    return {"id": "g1", "kind": "grpo", "state": "running", "params": {"model": "m", "loss_type": "dr_grpo",
                                                                        "beta": 0.04, "max_steps": 3},
            "preference": {"kind": "grpo", "history": hist, "groups": {"step": 2, "groups": groups}}}


def _trace(fig, name):
    return next(t for t in fig.data if t.name == name)


def test_dpo_curves_are_the_record_values():
    rec = _dpo_record()
    fig = pf.curves_figure("dpo", rec["preference"]["history"], BETA)
    margin = _trace(fig, "log π(chosen) − log π(rejected)")
    assert list(margin.x) == [1, 2]
    assert list(margin.y) == pytest.approx([-65.9 + 65.8, -60.0 + 70.0])
    assert list(_trace(fig, "accuracy").y) == [0.5, 0.75]
    # the drift panel: implicit reward / beta = the sequence log-ratio log pi/pi_ref on the pairs
    assert list(_trace(fig, "log π/π_ref (chosen)").y) == pytest.approx([-0.004, 3.0])
    assert list(_trace(fig, "log π/π_ref (rejected)").y) == pytest.approx([-0.003, -7.0])
    assert list(pf.throughput_figure(rec["preference"]["history"]).data[0].y) == [91.0, 92.0]


def test_status_eval_and_empty_states():
    rec = _dpo_record()
    md = pf.status_markdown(rec)
    assert "step 2/4" in md and "loss 0.6100" in md and "92 tokens/s" in md and "ETA 10 s" in md
    done = _dpo_record("succeeded")
    assert "ETA" not in pf.status_markdown(done) and "registered as **tiny-dpo**" in pf.status_markdown(done)
    t = pf.eval_table("dpo", rec["preference"]["before"], rec["preference"]["after"])
    row = t[t["held-out"] == "implicit-reward accuracy"].iloc[0]
    assert (row["before"], row["after"], row["change"]) == (0.0, 0.75, "+0.7500")
    assert len(t) == 4
    assert pf.eval_table("dpo", None, None).empty
    # the timer redraws only when the record changed (a finished run's plots are not re-sent every tick)
    sig = pp.view_signature(rec)
    assert sig == pp.view_signature(_dpo_record()) and sig != pp.view_signature(done)
    more = _dpo_record()
    more["preference"]["history"].append(_dpo_row(3, 4, 0.5, 1.0, -50.0, -80.0, 1.0, -2.0))
    assert pp.view_signature(more) != sig and pp.view_signature(None) == ""
    # nothing yet: a figure with a sentence, not an error
    assert not pf.curves_figure("dpo", [], BETA).data and not pf.curves_figure(None, None).data


def test_grpo_curves_groups_and_length():
    rec = _grpo_record()
    fig = pf.curves_figure("grpo", rec["preference"]["history"])
    band = _trace(fig, "± std")
    assert list(band.y) == pytest.approx([0.65, 1.0, 0.0, -0.15])  # (mean + std) forward, (mean - std) back
    assert list(_trace(fig, "mean completion length").y) == [11.5, 9.0]
    assert list(_trace(fig, "KL").y) == pytest.approx([0.001, 0.002])
    t = pf.groups_table(rec["preference"]["groups"])
    assert len(t) == 8 and list(t.columns) == pf.GROUP_COLUMNS
    g1 = t[t["prompt"] == "What is 9 + 7?"]
    # a group of rewards [1, 0, 1, 0]: mean 0.5, sample std 0.5774, advantages +-0.866
    assert list(g1["advantage"]) == pytest.approx([0.866, -0.866, 0.866, -0.866], abs=1e-3)
    assert g1["group"].iloc[0] == "1 (mean 0.50, std 0.58)"
    assert "no division by the std" in pf.groups_caption(rec["preference"]["groups"], "dr_grpo")


def test_form_params_map_onto_the_kind_settings():
    from tasks import preference_job as pj

    p = pp.form_params("grpo", "random-llama-tiny", "builtin", "number", "lora", 0.0, "dr_grpo", 4.0, 2.0, None)
    v = pj.validate_params("grpo", p)
    assert (v["loss_type"], v["num_generations"], v["max_steps"], v["beta"], v["method"]) == ("dr_grpo", 4, 2, 0.0,
                                                                                               "lora")
    assert v["verifier"] is None  # the verifier only goes with an upload
    p = pp.form_params("reward", "random-llama-tiny", "builtin", None, "full", 0.5, "grpo", 8, 3, 1e-4, 16)
    assert "beta" not in p and "loss_type" not in p and pj.validate_params("reward", p)["learning_rate"] == 1e-4
    assert "lora_rank" not in p  # the rank goes with LoRA only
    # DPO: its loss type (TRL's names) and the LoRA rank reach the job's settings
    p = pp.form_params("dpo", "random-llama-tiny", "builtin", None, "lora", 0.2, "ipo", None, 3, None, 16)
    v = pj.validate_params("dpo", p)
    assert (v["loss_type"], v["lora_rank"], v["method"], v["beta"]) == ("ipo", 16, "lora", 0.2)
    assert [k for _, k in pp.DPO_LOSS_CHOICES] == ["sigmoid", "ipo", "hinge"]
    # the kind switch offers the kind's own loss types; the method switch shows the rank with LoRA
    out = pp.kind_changed("grpo")
    assert [k for _, k in out[3]["choices"]] == ["grpo", "dr_grpo", "dapo"] and out[3]["value"] == "grpo"
    assert out[8]["visible"] is True  # GRPO's default method is LoRA
    out = pp.kind_changed("dpo")
    assert out[3]["value"] == "sigmoid" and out[3]["label"] == "DPO loss" and out[8]["visible"] is False
    assert pp.kind_changed("reward")[3]["visible"] is False
    assert pp.method_changed("lora")["visible"] is True and pp.method_changed("full")["visible"] is False
    with pytest.raises(Exception, match="(?i)lora_rank|rank"):
        pj.validate_params("dpo", pp.form_params("dpo", "random-llama-tiny", "builtin", None, "lora", 0.1, "sigmoid",
                                                 None, 2, None, 0.5))


def _upload(tmp_path_factory, text: str):
    from pathlib import Path

    from gradio.utils import get_upload_folder

    d = Path(get_upload_folder()) / tmp_path_factory.mktemp("x").name
    d.mkdir(parents=True, exist_ok=True)
    f = d / "pairs.jsonl"
    f.write_text(text)
    return str(f)


def test_submit_refuses_a_malformed_upload_by_line(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path))
    good = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
    f = _upload(tmp_path_factory, good + "\n" + '{"prompt": "p", "chosen": "a"}\n' + good + "\n")
    out = pp.submit("dpo", "random-llama-tiny", "upload", f, None, "full", 0.1, "sigmoid", None, 2, None)
    assert out[:3] == [pp.gr.skip()] * 3  # no job id, the menu and status untouched
    msg = out[3]["value"]
    assert out[3]["visible"] and "Line 2: missing 'rejected'" in msg and "nothing was run" in msg
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())
    # a bad value: one sentence beside the form, nothing else changes
    out = pp.submit("dpo", "random-llama-tiny", "builtin", None, None, "full", -1, "sigmoid", None, 2, None)
    assert out[:3] == [pp.gr.skip()] * 3
    assert out[3]["value"] == "⚠️ Setting 'beta' must be between 0.0001 and 100.0, got -1."
    # a GRPO loss type sent with DPO (a stale form): one sentence naming DPO's own
    out = pp.submit("dpo", "random-llama-tiny", "builtin", None, None, "full", 0.1, "dr_grpo", None, 2, None)
    assert out[:3] == [pp.gr.skip()] * 3 and "DPO loss type must be one of sigmoid, ipo, hinge" in out[3]["value"]
    out = pp.submit("grpo", "random-llama-tiny", "upload", None, "number", "lora", None, "dapo", 4, 2, None)
    assert "Upload a .jsonl" in out[3]["value"]


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """random-llama-tiny and a copy with every weight nudged, registered as a DPO-made fine-tuned model."""
    import os

    from model_core.training import sft

    d = tmp_path_factory.mktemp("data")
    old = os.environ.get("LMSCOPE_DATA_DIR")
    os.environ["LMSCOPE_DATA_DIR"] = str(d)
    try:
        model, tok, _ = sft.load_trainable("random-llama-tiny", "cpu")
        sft.ensure_chat_template(tok)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
            model.get_output_embeddings().weight.mul_(20.0)  # sharper next-token distributions: a visible change
        out = d / "models" / "tiny-dpo-perturbed"
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        (out / "lmscope.json").write_text(json.dumps({"kind": "dpo", "parent": "random-llama-tiny"}))
        yield "tiny-dpo-perturbed"
    finally:
        if old is None:
            os.environ.pop("LMSCOPE_DATA_DIR", None)
        else:
            os.environ["LMSCOPE_DATA_DIR"] = old


def _seq_logp(lm, prompt, completion):
    """log p(completion | prompt) by hand: the conversation through the chat template, one forward."""
    from model_core.training import sft

    tok = lm.tokenizer
    if not getattr(tok, "chat_template", None):
        import copy

        tok = copy.deepcopy(tok)
        sft.ensure_chat_template(tok)
    msgs = [{"role": "user", "content": prompt}]
    n = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    ids = torch.tensor([tok.apply_chat_template(msgs + [{"role": "assistant", "content": completion}],
                                                tokenize=True, return_dict=False)])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(ids).logits[0, :-1].double(), -1)
    return float(logp[torch.arange(n - 1, ids.shape[1] - 1), ids[0, n:]].sum()), ids.shape[1] - n


def test_logratio_view_sums_to_the_sequence_logratio(perturbed):
    from model_core.core.registry import load_model

    assert perturbed in {v for _, v in pp.trained_choices()}
    prompt, completion = pp.default_example("dpo")
    head, chips, fig = pp.what_changed(perturbed, None, prompt, completion)
    tuned, ref = load_model(perturbed, device="cpu"), load_model("random-llama-tiny", device="cpu")
    lp, n = _seq_logp(tuned, prompt, completion)
    lr, _ = _seq_logp(ref, prompt, completion)
    per_token = list(fig.data[0].y)
    assert len(per_token) == n
    assert abs(lp - lr) > 0.05  # the perturbation moved the sequence: the check below is not 0 = 0
    assert sum(per_token) == pytest.approx(lp - lr, abs=1e-3)
    assert f"{lp - lr:+.4f}" in head and "✓ sum of per-token" in head and "random-llama-tiny" in head
    assert chips.count("class='pref-tok'") == n
    # the check can fail: a per-token view that does not add up is flagged
    r = {"tokens": [{"logratio": v} for v in per_token], "logp": lp, "logp_ref": lr}
    seq = {"logp": lp, "logp_ref": lr, "sequence_logratio": lp - lr, "completion_tokens": n, "dtype": "float32"}
    assert pp.check_logratios(r, seq)["max_abs_diff"] < 1e-3
    r["tokens"][0]["logratio"] += 0.5
    bad = pp.check_logratios(r, seq)
    assert bad["max_abs_diff"] == pytest.approx(0.5, abs=1e-3)
    assert "failed" in pf.logratio_headline({**r, "total": sum(t["logratio"] for t in r["tokens"])}, bad, "a", "b")


def test_reward_score_of_a_typed_response(perturbed):
    """A reward model (random-llama-tiny's body + a seeded score head) registered in the same data
    folder: the panel's score equals the score head applied by hand to the last hidden state."""
    import os
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification

    from model_core.training import preference as P
    from model_core.training import sft

    model, tok, _ = sft.load_trainable("random-llama-tiny", "cpu")
    sft.ensure_chat_template(tok)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    out = Path(os.environ["LMSCOPE_DATA_DIR"]) / "models" / "tiny-reward"
    P.init_reward_model(model, tok, seed=1).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "lmscope.json").write_text(json.dumps({"kind": "reward", "parent": "random-llama-tiny"}))
    assert pp.reward_choices() == ["tiny-reward"] and "tiny-reward" not in {v for _, v in pp.trained_choices()}
    prompt, response = "What is 2 + 3?", "5."
    md = pp.score_response("tiny-reward", prompt, response)
    rm = AutoModelForSequenceClassification.from_pretrained(out).eval()
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": response}],
                                                tokenize=True, return_dict=False)])
    with torch.no_grad():
        h = rm.model(input_ids=ids).last_hidden_state[0, -1]
        want = float(rm.score.weight[0] @ h)
    got = float(md.split("**")[3])
    assert abs(want) > 1e-3 and got == pytest.approx(want, abs=1e-4)
    with pytest.raises(Exception, match="registered reward model"):
        pp.score_response("/etc/passwd", prompt, response)
