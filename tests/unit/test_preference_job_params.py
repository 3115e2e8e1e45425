"""Settings of the reward / DPO / GRPO jobs (tasks/preference_job.py) checked before anything is
queued: one sentence per bad value, the CLI's flags mapped onto the settings, uploads parsed with
preference_data's parser. No broker is needed: everything here fails (or passes) before the queue."""

from __future__ import annotations

import argparse
import json

import pytest

from model_core.core.errors import SettingsError
from model_core.training import preference as P
from model_core.training.preference_data import PreferenceDataError
from tasks import preference_job as pj

MODEL = "smollm2-135m-instruct"


def _one_sentence(msg: str) -> None:
    assert "\n" not in msg and msg.endswith(".") and msg[0].isupper(), msg


@pytest.mark.parametrize("kind, params, expected", [
    ("dpo", {"beta": 0}, "Setting 'beta' must be between 0.0001 and 100.0, got 0."),
    ("dpo", {"beta": -0.5}, "Setting 'beta' must be between 0.0001 and 100.0, got -0.5."),
    ("dpo", {"beta": "strong"}, "Setting 'beta' must be a number, got 'strong'."),
    ("grpo", {"beta": -1}, "Setting 'beta' must be between 0.0 and 100.0, got -1."),
    ("dpo", {"loss_type": "kto"}, "DPO loss type must be one of sigmoid, ipo, hinge, got 'kto'."),
    ("grpo", {"loss_type": "ppo"}, "GRPO loss type must be one of grpo, dr_grpo, dapo, got 'ppo'."),
    ("grpo", {"num_generations": 1}, "Setting 'num_generations' must be between 2 and 256, got 1."),
    ("reward", {"max_steps": 0}, "Setting 'max_steps' must be between 1 and 1000000, got 0."),
    ("reward", {"method": "qlora"}, "Method must be 'full' or 'lora', got 'qlora'."),
    ("dpo", {"model": "no-such-model"}, "Unknown model 'no-such-model'; pick a registry or fine-tuned model."),
    ("dpo", {"reference": "gone"}, "Unknown reference model 'gone'; pick a registry or fine-tuned model."),
    ("grpo", {"verifier": "vibes"}, "Unknown verifier 'vibes'; use one of exact, number, date."),
    ("dpo", {"dataset": "builtin:arithmetic"}, "Unknown built-in set arithmetic; use date, style."),
    ("grpo", {"dataset": "builtin:style"}, "Unknown built-in set style; use arithmetic, date."),
    ("dpo", {"dataset": "/etc/passwd"},
     "Dataset must be 'builtin', 'builtin:<set>' or an uploaded JSONL file, got '/etc/passwd'."),
    ("reward", {"device": "cuda"}, "Setting 'device' is chosen by the worker, not by a job."),
    ("dpo", {"num_generations": 4}, "Unknown dpo setting(s): num_generations."),
    ("dpo", {"output_name": "../up"}, None),  # the name rule's own sentence
])
def test_bad_settings_are_one_sentence(kind, params, expected):
    with pytest.raises(SettingsError) as e:
        pj.validate_params(kind, {"model": MODEL, **params})
    msg = str(e.value)
    _one_sentence(msg)
    if expected is not None:
        assert msg == expected


def test_unknown_kind():
    with pytest.raises(SettingsError, match="Unknown kind 'a2c'; use reward, dpo, grpo, ppo."):
        pj.validate_params("a2c", {})


def test_valid_params_are_the_core_settings():
    v = pj.validate_params("dpo", {"model": MODEL, "beta": 0.25, "max_steps": 3, "learning_rate": None})
    s = P.validate_settings("dpo", {k: x for k, x in v.items() if k not in ("model", "dataset", "dataset_file")})
    assert v["model"] == MODEL and v["dataset"] == "builtin" and v["dataset_file"] is None
    assert v["beta"] == 0.25 and v["max_steps"] == 3 and v["loss_type"] == "sigmoid"
    assert v["learning_rate"] == P.default_lr("dpo", "full") == s.learning_rate
    json.dumps(v)  # what the record stores
    assert "device" not in v
    # validating what the worker reads back changes nothing (GRPO's batch = prompts x group)
    g = pj.validate_params("grpo", {"model": MODEL, "num_generations": 4, "prompts_per_step": 3, "loss_type": "dapo"})
    assert g["batch_size"] == 12 and g["epsilon_high"] == 0.28 and g["method"] == "lora"
    assert pj.validate_params("grpo", g) == g
    assert pj.validate_params("dpo", {"model": MODEL, "dataset": "builtin:style"})["dataset"] == "builtin:style"


def test_reward_model_is_no_parent(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path))
    d = tmp_path / "models" / "rm"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "lmscope.json").write_text(json.dumps({"kind": "reward"}))
    with pytest.raises(SettingsError) as e:
        pj.validate_params("dpo", {"model": "rm"})
    assert str(e.value) == ("'rm' is a reward model (a score head), not a language model; pick a language model as "
                            "the model.")


def _parse(*argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("kind")
    pj.add_preference_arguments(ap)
    return pj.preference_params_from_args(ap.parse_args(list(argv)))


def test_cli_flags_map_onto_settings(tmp_path):
    params, files = _parse("dpo", "--beta", "0.1", "--max-steps", "5", "--loss-type", "ipo", "--lr", "2e-5")
    assert params == {"model": MODEL, "dataset": "builtin", "beta": 0.1, "max_steps": 5, "loss_type": "ipo",
                      "learning_rate": 2e-5} and files == []
    params, _ = _parse("grpo", "--group-size", "4", "--loss-type", "dr_grpo", "--prompts-per-step", "1",
                       "--max-completion-length", "6", "--dataset", "builtin:date")
    assert params["num_generations"] == 4 and params["loss_type"] == "dr_grpo" and params["prompts_per_step"] == 1
    assert params["max_completion_length"] == 6 and params["dataset"] == "builtin:date"
    params, _ = _parse("reward", "--lora-rank", "4")
    assert params["method"] == "lora" and params["lora_rank"] == 4
    f = tmp_path / "pairs.jsonl"
    params, files = _parse("dpo", "--dataset", str(f))
    assert params["dataset"] == "upload" and files == [str(f)]
    with pytest.raises(SettingsError, match=r"^--group-size is not an option of a 'dpo' job\.$"):
        _parse("dpo", "--group-size", "4")
    with pytest.raises(SettingsError, match=r"^--reference is not an option of a 'grpo' job\.$"):
        _parse("grpo", "--reference", MODEL)


def test_malformed_upload_fails_before_the_queue(tmp_path):
    """submit parses the file before it asks for the broker: no queue is needed to be refused."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n[1]\n{\"prompt\": 3}\n")
    with pytest.raises(PreferenceDataError) as e:
        pj.submit_preference("dpo", {"model": MODEL}, files=[f])
    assert [n for n, _ in e.value.lines] == [2, 3]
    assert str(e.value).startswith("2 of 3 lines in 'p.jsonl' are malformed; nothing was run. Line 2: expected a "
                                   "JSON object, got a list.")
    with pytest.raises(PreferenceDataError, match="does not exist"):
        pj.submit_preference("dpo", {"model": MODEL}, files=[tmp_path / "missing.jsonl"])
    with pytest.raises(SettingsError, match="beta"):  # settings are checked before the file is read
        pj.submit_preference("dpo", {"model": MODEL, "beta": 0}, files=[f])


def test_a_server_path_is_the_clis_only(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("{oops\n")
    with pytest.raises(SettingsError, match=r"^Dataset must be 'builtin', 'builtin:<set>' or an uploaded JSONL file"):
        pj.submit_preference("dpo", {"model": MODEL, "dataset": str(f)}, owner="someone")
    with pytest.raises(PreferenceDataError, match="Line 1: not valid JSON"):  # the CLI may name a file
        pj.submit_preference("dpo", {"model": MODEL, "dataset": str(f)}, owner="cli")
