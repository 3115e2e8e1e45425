"""Mixture-of-experts routing (model_core.interp.experts) checked against transformers' own
`output_router_logits=True` on tiny random MoE checkpoints of four families: the router logits
equal, the chosen experts are the top-k of those logits, and the load sums to one; a dense model
has no routed layer."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_core import load_model
from model_core.core.tokenization import byte_tokenizer
from model_core.interp.experts import moe_layers, routing

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "architectures.py"
_spec = importlib.util.spec_from_file_location("bench_architectures_experts", _SCRIPT)
architectures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architectures)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe", "granitemoe"])
def test_routing_equals_transformers_router_logits(model_type, tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(architectures.tiny_config(model_type)).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), device="cpu", dtype="float32", allow_hub=False)
    ids = list(b"experts route each token")
    got = routing(lm, ids)
    assert sorted(got) == moe_layers(lm) == list(range(lm.shape.n_layers))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
    k = ref.config.num_experts_per_tok
    for layer, r in got.items():
        torch.testing.assert_close(r.logits, want[layer].reshape(len(ids), -1), atol=1e-5, rtol=1e-5)
        top = torch.topk(want[layer].reshape(len(ids), -1), k, dim=-1).indices
        assert torch.equal(r.experts.sort(-1).values, top.sort(-1).values)
        torch.testing.assert_close(r.load().sum(), torch.tensor(1.0))
        assert r.probs.shape == (len(ids), r.n_experts)


def test_dense_model_has_no_router():
    lm = load_model("random-llama-tiny", device="cpu", dtype="float32")
    assert moe_layers(lm) == [] and routing(lm, [1, 2, 3]) == {}
