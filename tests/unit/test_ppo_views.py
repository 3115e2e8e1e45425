"""PPO on the preference panel (app/tabs/finetune/preference_panel.py) and its pure figures
(app/tabs/finetune/preference_figures.py), on a hand-made record shaped as tasks/preference_job.py writes a
'ppo' job: each figure must show the record's own numbers (curves, per-token advantages, held-out score
beside the task score)."""

from __future__ import annotations

import pytest

from app.tabs.finetune import preference_figures as pf
from app.tabs.finetune import preference_panel as pp
from model_core.training import preference as P


def _row(step, score, std, kl, beta, pl, vl, cf, vcf):
    return {"step": step, "total": 3, "reward_mean": score, "reward_std": std, "kl": kl, "kl_k3": kl * 0.9,
            "beta": beta, "beta_next": beta * 1.01, "non_score_reward": -beta * kl, "policy_loss": pl,
            "value_loss": vl, "clip_fraction": cf, "value_clip_fraction": vcf, "approx_kl": 0.002, "entropy": 2.1,
            "completion_length": 9.0 + step, "value_mean": 0.1 * step, "return_mean": 0.2 * step, "step_s": 1.5,
            "tokens_per_s": 40.0 + step, "eta_s": 1.5 * (3 - step), "lr": 2e-4}


def _sample(prompt, completion, tokens, score, adv):
    n = len(tokens)
    kl = [0.01 * (i + 1) for i in range(n)]
    rewards = [-0.05 * k for k in kl[:-1]] + [score - 0.05 * kl[-1]]
    values = [0.1 * i - 0.2 for i in range(n)]
    returns = [v + a for v, a in zip(values, adv)]
    return {"prompt": prompt, "completion": completion, "score": score, "tokens": tokens, "kl": kl,
            "rewards": rewards, "values": values, "advantages": adv, "returns": returns}


LIVE = {"step": 2, "samples": [_sample("What is 2 + 2?", "4", ["4", "<|im_end|>"], 0.5, [0.3, -0.1])]}
LAST = {"step": 3, "samples": [
    _sample("What is 9 + 7?", "The answer is 16", ["The", " answer", " is", " 16"], 1.25, [0.9, -0.4, 0.2, 1.1]),
    _sample("What is 9 + 6?", "15", ["15", "<|im_end|>"], -0.75, [-1.3, 0.05]),
]}
BEFORE = {"n": 2, "mean_score": -0.5, "mean_reward": 0.5, "mean_length": 3.0, "examples": [
    {"prompt": "What is 9 + 7?", "answer": "16", "completion": "16", "score": -0.4, "reward": 1.0},
    {"prompt": "What is 9 + 6?", "answer": "15", "completion": "14", "score": -0.6, "reward": 0.0}]}
AFTER = {"n": 2, "mean_score": 1.5, "mean_reward": 0.0, "mean_length": 7.5, "examples": [
    {"prompt": "What is 9 + 6?", "answer": "15", "completion": "Great question!!", "score": 1.7, "reward": 0.0},
    {"prompt": "What is 9 + 7?", "answer": "16", "completion": "Great question!", "score": 1.3, "reward": 0.0}]}


def _record(state="succeeded", finished=True):
    hist = [_row(1, -0.5, 0.4, 0.0, 0.05, 0.02, 0.9, 0.0, 0.1), _row(2, 0.2, 0.6, 0.8, 0.051, -0.01, 0.5, 0.25, 0.3),
            _row(3, 1.1, 0.3, 2.4, 0.053, -0.03, 0.2, 0.5, 0.05)]
    pr = {"kind": "ppo", "history": hist, "latest": hist[-1], "model_name": "tiny-ppo", "samples": LIVE,
          "reward_model": "tiny-rm", "before": BEFORE if finished else None, "after": AFTER if finished else None}
    if finished:
        pr["samples_by_step"] = [LIVE, LAST]
    return {"id": "p1", "kind": "ppo", "state": state, "progress": {"stage": "training"},
            "params": {"model": "random-llama-tiny", "method": "lora", "beta": 0.05, "max_steps": 3,
                       "reward_model": "tiny-rm"},
            "preference": pr}


def _trace(fig, name):
    return next(t for t in fig.data if t.name == name)


def test_ppo_curves_are_the_record_values():
    rec = _record()
    hist = rec["preference"]["history"]
    fig = pf.curves_figure("ppo", hist, 0.05)
    assert list(_trace(fig, "reward-model score").y) == [r["reward_mean"] for r in hist]
    assert list(_trace(fig, "KL (nats / sequence)").y) == [r["kl"] for r in hist]
    beta = _trace(fig, "β")
    assert list(beta.y) == [r["beta"] for r in hist] and beta.yaxis != _trace(fig, "KL (nats / sequence)").yaxis
    assert list(_trace(fig, "policy loss").y) == [r["policy_loss"] for r in hist]
    assert list(_trace(fig, "value loss").y) == [r["value_loss"] for r in hist]
    assert list(_trace(fig, "policy clip fraction").y) == [r["clip_fraction"] for r in hist]
    assert list(_trace(fig, "value clip fraction").y) == [r["value_clip_fraction"] for r in hist]
    band = _trace(fig, "± std")  # hi forwards, then lo backwards
    assert list(band.y) == pytest.approx([r["reward_mean"] + r["reward_std"] for r in hist]
                                         + [r["reward_mean"] - r["reward_std"] for r in hist][::-1])
    assert "PPO (against a reward model)" in fig.layout.title.text


def test_tokens_coloured_by_the_records_advantages():
    fig = pf.ppo_tokens_figure(pf.ppo_samples(_record()["preference"]))  # finished: the last of samples_by_step
    hm = fig.data[0]
    width = max(len(s["tokens"]) for s in LAST["samples"])
    for i, s in enumerate(LAST["samples"]):
        n = len(s["tokens"])
        assert list(hm.z[i][:n]) == s["advantages"] and all(v is None for v in hm.z[i][n:width])
        assert list(hm.text[i][:n]) == s["tokens"]
        for j in range(n):
            cell = hm.customdata[i][j]
            got = [float(cell[k]) for k in range(5)]
            want = [s[k][j] for k in pf.PPO_TOKEN_KEYS]
            assert got == pytest.approx(want, abs=1e-4)
            assert cell[5] == s["tokens"][j]
    assert hm.zmax == pytest.approx(1.3) and hm.zmin == pytest.approx(-1.3)  # symmetric, the largest |advantage|
    assert "step 3" in fig.layout.title.text and "+1.25" in hm.y[0]
    # while running: the live samples
    live = pf.ppo_tokens_figure(pf.ppo_samples(_record("running", finished=False)["preference"]))
    assert list(live.data[0].z[0]) == LIVE["samples"][0]["advantages"] and "step 2" in live.layout.title.text
    assert "step **3**" in pf.ppo_samples_caption(LAST)
    assert not pf.ppo_tokens_figure(None).data


def test_held_out_score_beside_task_score_and_the_gaming_sentence():
    t = pf.eval_table("ppo", BEFORE, AFTER)
    by = {r[0]: r for r in t.values.tolist()}
    score = next(v for k, v in by.items() if k.startswith("reward-model score"))
    task = next(v for k, v in by.items() if k.startswith("task score"))
    assert score[1:] == [-0.5, 1.5, "+2.0000"] and task[1:] == [0.5, 0.0, "-0.5000"]
    ex = pf.ppo_examples_table(BEFORE, AFTER)
    assert list(ex.columns) == pf.PPO_EXAMPLE_COLUMNS
    rows = {r[0]: r for r in ex.values.tolist()}  # matched by prompt, not by position
    assert rows["What is 9 + 7?"][1:] == ["16", "16", -0.4, 1.0, "Great question!", 1.3, 0.0]
    assert rows["What is 9 + 6?"][5:] == ["Great question!!", 1.7, 0.0]
    note = pf.ppo_gaming_note(BEFORE, AFTER)
    assert "-0.500 → 1.500 (+2.000)" in note and "0.500 → 0.000 (-0.500)" in note and "fell" in note
    agree = pf.ppo_gaming_note(BEFORE, {**AFTER, "mean_reward": 1.0})
    assert "rose too" in agree and "fell" not in agree
    assert "once the run has evaluated" in pf.ppo_gaming_note(BEFORE, None)


def test_panel_lists_shows_and_submits_ppo(monkeypatch):
    assert "ppo" in pp.KINDS and ("PPO (against a reward model)", "ppo") in pp.KIND_CHOICES
    assert P.KINDS == ("reward", "dpo", "grpo")  # the TRL kinds stay as they were
    rec = _record()
    views = pp._views(rec)
    assert len(views) == pp.N_VIEWS == len(pp._views(None))
    status, curves, *_rest = views
    assert "tiny-rm" in status and "score +1.100" in status and "RM tiny-rm" in pf.job_label(rec)
    assert list(_trace(curves, "policy loss").y) == [r["policy_loss"] for r in rec["preference"]["history"]]
    assert list(views[7].data[0].z[1][:2]) == LAST["samples"][1]["advantages"]
    assert "fell" in views[8] and len(views[9]) == 2
    # a DPO record leaves the PPO views at their placeholders
    dpo = {**rec, "kind": "dpo", "preference": {**rec["preference"], "kind": "dpo"}}
    assert not pp._views(dpo)[7].data and pp._views(dpo)[9].empty
    # a new step of samples redraws
    later = _record("running", finished=False)
    sig = pp.view_signature(later)
    later["preference"]["samples"] = {**LIVE, "step": 3}
    assert pp.view_signature(later) != sig
    # the form: the reward-model menu only with PPO, PPO's settings reach the kind's settings check
    monkeypatch.setattr(pp, "reward_choices", lambda: ["tiny-rm"])
    out = pp.kind_changed("ppo")
    assert out[9]["visible"] is True and out[9]["choices"] == ["tiny-rm"]
    assert out[3]["visible"] is False and out[4]["visible"] is True and out[4]["value"] == P.PPOSettings.num_generations
    assert [v for _, v in out[0]["choices"]] == [v for _, v in pp.DATASETS["grpo"]]
    assert pp.kind_changed("dpo")[9]["visible"] is False and pp.kind_changed("grpo")[9]["visible"] is False
    p = pp.form_params("ppo", "random-llama-tiny", "builtin", "number", "lora", 0.1, "sigmoid", 2, 3, None, 8,
                       "tiny-rm")
    assert p["reward_model"] == "tiny-rm" and "loss_type" not in p and "verifier" not in p
    s = P.validate_settings("ppo", {k: v for k, v in p.items() if k not in ("model", "dataset")})
    assert (s.reward_model, s.beta, s.num_generations, s.max_steps, s.lora_rank) == ("tiny-rm", 0.1, 2, 3, 8)
    assert "reward_model" not in pp.form_params("grpo", "m", "builtin", None, "lora", 0.0, "grpo", 4, 2, None, 8,
                                                "tiny-rm")
    # no reward model picked: one sentence beside the form, nothing queued
    out = pp.submit("ppo", "random-llama-tiny", "builtin", None, None, "lora", 0.05, None, 4, 2, None, 8, None)
    assert out[:3] == [pp.gr.skip()] * 3 and "reward model" in out[3]["value"]
