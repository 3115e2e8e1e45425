"""Issue 15 item 6: a Trace saved as safetensors loads back bit for bit, on the real default model."""

import json

import pytest
import torch
from safetensors.torch import save_file

from model_core import load_trace, save_trace, trace
from model_core.interp.trace_io import TraceFileError, check_size


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes (NaN equals NaN, -0.0 differs from 0.0)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def test_round_trip_is_bit_for_bit(default_lm, tmp_path):
    tr = trace(default_lm, "Mingalaba: မင်္ဂလာပါ 🍕 The capital of France is")
    settings = {"prompt": "…", "layer": 7, "head": 2, "query": 4, "scale": "log", "zoom": "", "temperature": 0.8}
    path = save_trace(tr, tmp_path / "t.safetensors", settings)
    back = load_trace(path)
    assert back.model_name == "smollm2-135m-instruct" and back.settings == settings
    assert back.token_ids == tr.token_ids and back.tokens == tr.tokens and back.n_layers == 30
    assert back.captured_layers == list(range(30))
    checked = 0
    for name in tr.hook_names():
        if name == "logits":
            continue
        if name.endswith(("attn.hook_pattern", "mlp.hook_post")) and not name.startswith("blocks.7."):
            assert name not in back  # other layers' patterns need the model
            continue
        a, b = tr[name], back[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(bits(a), bits(b)), name
        checked += 1
    assert checked == 1 + 30 * 5 + 2 + 1  # embed, 5 residual names per layer, layer 7's two views, ln_final
    for name, a in (("next_logits", tr.next_logits), ("token_logprobs", tr.token_logprobs)):
        assert torch.equal(bits(a), bits(back[name])), name
    assert torch.isnan(back["token_logprobs"][0])
    meta = back.metadata
    assert meta["format"] == "lmscope-trace" and json.loads(meta["captured_layers"]) == list(range(30))


def test_size_cap_and_foreign_files(default_lm, tmp_path):
    tr = trace(default_lm, "The capital of France is")
    n = check_size(tr, 3)
    assert n == sum(t.numel() * t.element_size() for t in
                    [*tr.resid_pre.values(), *tr.attn_out.values(), *tr.mlp_out.values(), tr.ln_final,
                     tr.next_logits, tr.token_logprobs]) + 8 * tr.n_tokens + 4 * (9 * 25 + 5 * 1536)
    with pytest.raises(TraceFileError, match=r"^This trace's tensors are \d+ MB; a tensor export stops at 0.5 MB"):
        save_trace(tr, tmp_path / "big.safetensors", {"layer": 3}, max_mb=0.5)
    assert not (tmp_path / "big.safetensors").exists()
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(TraceFileError, match="not an lmscope trace file"):
        load_trace(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(TraceFileError, match="Could not read"):
        load_trace(tmp_path / "junk.safetensors")
