"""Explore's experts panel end to end without a browser: a mixture-of-experts checkpoint the host
added by name (tiny random Mixtral) shows one ● per chosen (token, expert) — k per token, the
experts transformers' own router logits rank top-k — and a load that sums to one; the real default
model (dense) says in one sentence that it has no router, and shows no numbers."""

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from app.shared.trace_store import STORE
from app.tabs.explore.experts_panel import show_experts
from model_core import load_model, trace
from model_core.core import add_model
from model_core.core.tokenization import byte_tokenizer

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "architectures.py"
_spec = importlib.util.spec_from_file_location("bench_architectures_panel", _SCRIPT)
architectures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architectures)


def test_mixtral_routing_in_the_panel(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LMSCOPE_DEVICE", "cpu")
    monkeypatch.setenv("LMSCOPE_DTYPE", "float32")
    folder = tmp_path / "mixtral"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(architectures.tiny_config("mixtral")).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    add_model.add("tiny-mixtral", str(folder))
    lm = load_model("tiny-mixtral", allow_paths=False, allow_hub=False)
    tr = trace(lm, "route me")
    msg, routes, load = show_experts({"key": STORE.put(tr), "model": "tiny-mixtral", "prompt": "route me"}, 1)
    heat = routes.data[0]
    T, k = len(tr.token_ids), lm.model.config.num_experts_per_tok
    assert sum(cell == "●" for row in heat.text for cell in row) == T * k
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([tr.token_ids]), output_router_logits=True).router_logits[1]
    top = torch.topk(logits.reshape(T, -1), k, dim=-1).indices
    marked = {(i, e) for i, row in enumerate(heat.text) for e, cell in enumerate(row) if cell == "●"}
    assert marked == {(i, int(e)) for i in range(T) for e in top[i]}
    assert abs(sum(load.data[0].y) - 1) < 1e-6
    assert msg["visible"] is False


def test_dense_default_model_says_it_has_no_router(default_lm):
    tr = trace(default_lm, "A dense model")
    msg, routes, load = show_experts({"key": STORE.put(tr), "model": default_lm.name, "prompt": "A dense model"}, 3)
    assert "dense" in msg["value"] and "no router" in msg["value"]
    assert not routes.data and not load.data  # a sentence, no numbers
