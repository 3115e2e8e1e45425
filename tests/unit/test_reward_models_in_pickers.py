"""A registered reward model (kind 'reward' in its lmscope.json, as model_core.training.preference writes it)
is listed with its kind, kept out of every language-model picker, and refused by load_model with one
sentence (it has a score head, no next-token head: loading it as a causal LM would show its parent
with a reward-trained body, or a random head)."""

from __future__ import annotations

import json

import pytest

from model_core.core.errors import LmscopeError


def test_reward_models_are_listed_with_their_kind_and_never_picked(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path))
    for name, kind in (("rm-dates", "reward"), ("dpo-dates", "dpo")):
        d = tmp_path / "models" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (d / "lmscope.json").write_text(json.dumps({"kind": kind, "parent": "smollm2-135m-instruct"}))
    from app.server.page import model_choices
    from model_core.core.registry import list_models, load_model

    kinds = {r["name"]: r.get("kind") for r in list_models(include_random=False) if r["source"] == "finetuned"}
    assert kinds == {"rm-dates": "reward", "dpo-dates": "dpo"}
    picked = [n for _, n in model_choices("finetuned")]
    assert picked == ["dpo-dates"]
    with pytest.raises(LmscopeError, match="'rm-dates' is a reward model"):
        load_model("rm-dates")
