"""Loading and the command line without the real default model: unknown, missing and unsupported
models, a local folder's round trip and an offline hub id on tiny random-weight models, the command
line's one-sentence errors, and byte display. The default model's own are tests/reference/test_default_model.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from model_core import load_model, trace
from model_core.core.errors import ModelLoadError
from model_core.core.tokenization import display_bytes


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "app.server.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "LMSCOPE_DEVICE": "cpu"})


def test_cli_error_is_one_sentence():
    r = _cli("trace", "hi", "--model", "no-such-model")
    assert r.returncode == 2
    assert r.stderr.startswith("error: Unknown model 'no-such-model'")
    assert "Traceback" not in r.stderr


def test_cli_bad_settings_stop_it_with_one_sentence_each():
    env = {**os.environ, "LMSCOPE_MAX_BATCH": "lots", "LMSCOPE_AUTH": "magic", "LMSCOPE_DEVICE": "cpu"}
    r = subprocess.run([sys.executable, "-m", "app.server.cli", "models"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: bad configuration: ")
    assert "LMSCOPE_AUTH must be one of off, token, users, not 'magic'." in r.stderr
    assert "LMSCOPE_MAX_BATCH must be a whole number, not 'lots'." in r.stderr


def test_unknown_missing_and_unsupported_models(tmp_path):
    with pytest.raises(ModelLoadError, match="Unknown model"):
        load_model("definitely-not-a-model")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="Architecture 'bert' is not supported"):
        load_model(str(tmp_path))


def test_local_directory_round_trip(tmp_path):
    lm = load_model("random-llama-tiny")
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    local = load_model(str(tmp_path))
    ids = [1, 2, 3, 4, 5]
    torch.testing.assert_close(trace(local, token_ids=ids).next_logits, trace(lm, token_ids=ids).next_logits)


def test_hub_id_offline_gives_a_sentence(monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub reads HF_HUB_OFFLINE once, at import: without its constant the load still tries the
    # network (23 s of retries here, and no bound where connections hang instead of failing)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="hub"):
        load_model("someone/some-model-that-is-not-cached")


def test_display_bytes():
    assert display_bytes(b" a\n") == "␣a↵"
    assert display_bytes("🦜".encode()[:2]) == "<0xF0><0x9F>"
    assert display_bytes("é".encode()) == "é"
