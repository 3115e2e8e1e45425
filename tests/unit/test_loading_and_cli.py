import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from model_core import load_model, trace
from model_core.core.errors import ModelLoadError, PromptError
from model_core.core.tokenization import display_bytes


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "app.server.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "LMSCOPE_DEVICE": "cpu"})


def test_cli_trace_json_paris():
    r = _cli("trace", "The capital of France is", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == "smollm2-135m-instruct"
    assert out["next_tokens"][0]["token"] == " Paris"
    assert out["next_tokens"][0]["prob"] > 0.5
    probs = [t["prob"] for t in out["next_tokens"]]
    assert probs == sorted(probs, reverse=True)
    assert [t["text"] for t in out["tokens"]] == ["The", " capital", " of", " France", " is"]
    assert [row["layer"] for row in out["logit_lens"]] == list(range(30))
    assert out["logit_lens"][-1]["token"] == " Paris"


def test_cli_models_json():
    r = _cli("models", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    d = rows["smollm2-135m-instruct"]
    assert d["ready"] is True and d["architecture"] == "llama"
    assert d["parameters"] == 134_515_008
    assert rows["random-gpt2-tiny"]["architecture"] == "gpt2"


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


def test_loaded_default_model_matches_its_config(default_lm):
    s = default_lm.summary()
    assert (s["layers"], s["heads"], s["kv_heads"], s["d_model"], s["vocab_size"]) == (30, 9, 3, 576, 49152)
    assert s["device"] == "cpu" and s["dtype"] == "float32" and s["chat_template"] is True
    assert s["parameters"] == sum(p.numel() for p in default_lm.model.parameters())


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
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="hub"):
        load_model("someone/some-model-that-is-not-cached")


def test_bad_prompts(default_lm):
    for bad in ["", "   \n\t "]:
        with pytest.raises(PromptError, match="empty"):
            trace(default_lm, bad)
    long = "word " * 2000
    with pytest.raises(PromptError, match="limit is 1024"):
        trace(default_lm, long)
    tr = trace(default_lm, long, truncate=True)
    assert tr.n_tokens == 1024


def test_odd_unicode_is_traced_and_shown_byte_safe(default_lm):
    prompt = "emoji 🦜, e\u0301, שלום, \x07bell\nnew"
    tr = trace(default_lm, prompt)
    assert default_lm.tokenizer.decode(tr.token_ids) == prompt
    from model_core.core.tokenization import token_bytes

    assert b"".join(token_bytes(default_lm.tokenizer, i) for i in tr.token_ids) == prompt.encode()
    shown = "".join(t["display"] for t in tr.tokens)
    assert "↵" in shown and "<0x07>" in shown
    # the parrot is split over byte tokens: each one's own bytes are kept (raw), the views show the
    # parrot with the token's part of it, never a replacement char
    assert "<0xF0><0x9F><0xA6><0x9C>" in "".join(t["raw"] for t in tr.tokens) and "\ufffd" not in shown
    assert "🦜·1/" in shown and "<0xF0>" not in shown


def test_display_bytes():
    assert display_bytes(b" a\n") == "␣a↵"
    assert display_bytes("🦜".encode()[:2]) == "<0xF0><0x9F>"
    assert display_bytes("é".encode()) == "é"


def test_hooks_do_not_leak_between_threads(default_lm):
    prompts = ["The capital of France is", "One two three four five six"]
    expected = {p: trace(default_lm, p) for p in prompts}
    results, errors = {}, []

    def run(p):
        try:
            for _ in range(3):
                results.setdefault(p, []).append(trace(default_lm, p))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    for p in prompts:
        for tr in results[p]:
            assert tr.token_ids == expected[p].token_ids
            torch.testing.assert_close(tr.resid_post(29), expected[p].resid_post(29))
    # and a plain forward with no active trace records nothing anywhere
    from model_core.core.hooks import _ACTIVE
    assert _ACTIVE.get() is None
