"""The real default model (SmolLM2-135M-Instruct) loaded, traced and reported: the command line's
trace and model list, its config, empty and over-long prompts, odd Unicode shown byte-safe, hooks
kept apart between threads, and its weights exactly gguf-py's dequantisation of the packaged Q4_1
file (issue 18 fix 9: a reference lmscope did not write)."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from conftest import DEFAULT
from model_core import load_model, trace
from model_core.core.errors import PromptError


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


def test_loaded_default_model_matches_its_config(default_lm):
    s = default_lm.summary()
    assert (s["layers"], s["heads"], s["kv_heads"], s["d_model"], s["vocab_size"]) == (30, 9, 3, 576, 49152)
    assert s["device"] == "cpu" and s["dtype"] == "float32" and s["chat_template"] is True
    assert s["parameters"] == sum(p.numel() for p in default_lm.model.parameters())


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


def test_default_weights_are_the_q4_1_gguf_dequantised():
    """The model line says where the weights come from, and the loaded tensors are exactly
    gguf-py's dequantisation of the packaged Q4_1 file (a reference lmscope did not write)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from app.server.page import model_info
    from model_core.core.registry import REGISTRY, _gguf_path

    lm = load_model(DEFAULT)
    assert "Q4_1.gguf" in lm.summary()["weights"] and "210 × Q4_1 (4-bit)" in lm.summary()["weights"]
    assert "1 × Q8_0 (8-bit: the token embedding)" in lm.summary()["weights"]
    line = model_info(DEFAULT)
    assert "weights: the quantised GGUF SmolLM2-135M-Instruct.Q4_1.gguf" in line and "dequantised to float32" in line
    assert "random (seed 0), never trained" in model_info("random-gpt2-tiny")
    tensors = {t.name: t for t in GGUFReader(str(_gguf_path(REGISTRY[DEFAULT]))).tensors}
    layers = lm.model.model.layers
    for name, w, kind in [("blk.0.ffn_down.weight", layers[0].mlp.down_proj.weight, "Q4_1"),
                          ("blk.7.attn_v.weight", layers[7].self_attn.v_proj.weight, "Q4_1"),
                          ("token_embd.weight", lm.model.model.embed_tokens.weight, "Q8_0"),
                          ("blk.0.attn_norm.weight", layers[0].input_layernorm.weight, "F32")]:
        t = tensors[name]
        assert t.tensor_type.name == kind
        ref = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(w.shape)
        assert torch.equal(ref, w.detach().cpu().float()), name
    # a 4-bit block of 32 has at most 16 distinct values
    row = layers[0].mlp.down_proj.weight[0, :32]
    assert len(torch.unique(row)) <= 16
