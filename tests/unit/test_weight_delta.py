"""Where fine-tuning changed the weights: ‖ΔW‖_F / ‖W‖_F per layer and module, checked against a
hand computation on a known edit, on three architectures, on a real merged LoRA run, and the heatmap
that draws it."""

from __future__ import annotations

import copy
import math
import uuid

import pytest
import torch

from app.tabs.finetune.figures import weight_delta_figure
from model_core import load_model
from model_core.anatomy.weight_delta import weight_delta
from model_core.core.errors import SettingsError
from model_core.training import sft

TINY = "random-llama-tiny"
LLAMA_KINDS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm",
               "post_attention_layernorm"]


def _copy(name):
    m = copy.deepcopy(load_model(name).model)  # never edit the cached model other tests use
    m.requires_grad_(False)
    return m


@pytest.mark.parametrize("name", ["random-llama-tiny", "random-gpt2-tiny", "random-gemma3-tiny"])
def test_a_model_against_itself_is_all_zeros_and_counts_every_weight_once(name):
    lm = load_model(name)
    rows = weight_delta(lm, _copy(name))
    assert rows and all(r["delta"] == 0.0 and r["rel"] == 0.0 and r["norm"] > 0 for r in rows)
    # every parameter once: tied lm_head is the embedding, counted under it
    assert sum(r["numel"] for r in rows) == sum(p.numel() for p in lm.model.parameters())
    names = [n for r in rows for n in r["params"]]
    assert len(names) == len(set(names)) and "lm_head.weight" not in names
    assert [r["also"] for r in rows if r["also"]] == [["lm_head.weight"]]
    layers = {r["layer"] for r in rows if r["layer"] is not None}
    assert layers == set(range(lm.shape.n_layers))
    # Gemma's RMSNorm scales by (1 + w) with w stored (zeros here): its norm is ‖1 + w‖ = sqrt(size)
    gemma_norms = [r for r in rows if r["offset"]]
    assert bool(gemma_norms) == (name == "random-gemma3-tiny")
    assert all(r["kind"].endswith("norm") and r["norm"] == pytest.approx(math.sqrt(r["numel"])) for r in gemma_norms)


def test_one_known_edit_is_measured_at_its_layer_and_module():
    parent = load_model(TINY)
    tuned = _copy(TINY)
    w = tuned.model.layers[1].mlp.down_proj.weight
    before = [w[3, 5].item(), w[0, 0].item()]
    w[3, 5] += 0.25
    w[0, 0] -= 0.5
    after = [w[3, 5].item(), w[0, 0].item()]
    W = parent.model.model.layers[1].mlp.down_proj.weight.flatten().tolist()
    delta = math.sqrt(sum((a - b) ** 2 for a, b in zip(after, before)))
    norm = math.sqrt(math.fsum(x * x for x in W))
    rows = weight_delta(parent, tuned)
    changed = [r for r in rows if r["delta"] != 0]
    assert [(r["layer"], r["module"], r["kind"]) for r in changed] == [(1, "mlp.down_proj", "down_proj")]
    r = changed[0]
    assert r["params"] == ["model.layers.1.mlp.down_proj.weight"]
    assert r["delta"] == pytest.approx(delta, rel=1e-12) and r["norm"] == pytest.approx(norm, rel=1e-12)
    assert r["rel"] == pytest.approx(delta / norm, rel=1e-12)
    assert 0.3 < r["rel"] < 3  # 0.56 against a small random matrix: a visible change

    # the figure: layers x module kinds, the change at (L1, down_proj), named in the title
    fig = weight_delta_figure(rows)
    main, outside = fig.data
    assert list(main.y) == ["L0", "L1", "L2"] and list(main.x) == LLAMA_KINDS
    assert len(main.z) == 3 and all(len(row) == len(LLAMA_KINDS) for row in main.z)
    assert main.z[1][LLAMA_KINDS.index("down_proj")] == r["rel"]
    assert sum(v for row in main.z for v in row) == r["rel"]
    assert list(outside.x) == ["embed_tokens (tied: lm_head.weight)", "norm"] and list(outside.z[0]) == [0.0, 0.0]
    assert fig.layout.title.text.endswith(f"max {r['rel']:.3g} at L1 down_proj")


def test_a_tied_embedding_edit_is_one_row():
    parent = load_model(TINY)
    tuned = _copy(TINY)
    tuned.model.embed_tokens.weight[7] += 1.0  # also moves lm_head: the same tensor
    assert torch.equal(tuned.lm_head.weight[7], tuned.model.embed_tokens.weight[7])
    changed = [r for r in weight_delta(parent, tuned) if r["delta"] != 0]
    assert len(changed) == 1 and changed[0]["module"] == "embed_tokens" and changed[0]["layer"] is None
    assert changed[0]["delta"] == pytest.approx(math.sqrt(64), rel=1e-6)  # +1 on 64 entries
    assert "embed_tokens (tied: lm_head.weight)" in weight_delta_figure([changed[0]]).layout.title.text


def test_neither_model_is_modified_even_in_float64():
    """.double() of a float64 tensor is the tensor itself: nothing may be computed in place."""
    parent, tuned = _copy(TINY).double(), _copy(TINY).double()
    tuned.model.layers[0].self_attn.q_proj.weight[1, 2] += 0.125
    before = [{n: p.clone() for n, p in m.state_dict().items()} for m in (parent, tuned)]
    rows = weight_delta(parent, tuned)
    assert [r["module"] for r in rows if r["delta"]] == ["self_attn.q_proj"]
    assert rows[1]["delta"] == 0.125  # exact in float64
    for m, b in zip((parent, tuned), before):
        assert all(torch.equal(p, b[n]) for n, p in m.state_dict().items())


def test_models_of_other_shapes_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_core.core.registry import RANDOM_CONFIGS

    with pytest.raises(SettingsError, match="different parameters"):
        weight_delta(load_model(TINY), load_model("random-gemma3-tiny"))
    cfg = dict(RANDOM_CONFIGS[TINY], vocab_size=300)
    other = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    with pytest.raises(SettingsError, match=r"model.embed_tokens.weight has shape \(258, 64\) in one model"):
        weight_delta(load_model(TINY), other)


def test_a_merged_lora_run_moves_the_linear_layers_only(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path / "data"))
    name = f"tiny-lora-delta-{uuid.uuid4().hex[:6]}"
    sft.run_sft({"model": TINY, "method": "lora", "lora_rank": 4, "max_steps": 2, "learning_rate": 1e-2,
                 "batch_size": 8, "accuracy_examples": 0, "output_name": name})
    rows = weight_delta(load_model(TINY), load_model(name))
    projections = [r for r in rows if r["kind"].endswith("_proj")]
    others = [r for r in rows if not r["kind"].endswith("_proj")]
    assert len(projections) == 3 * 7 and all(r["rel"] > 0 for r in projections)
    assert {r["kind"] for r in others} == {"embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"}
    assert all(r["delta"] == 0 for r in others)
    fig = weight_delta_figure(rows)
    top = max(projections, key=lambda r: r["rel"])
    assert f"max {top['rel']:.3g} at L{top['layer']} {top['kind']}" in fig.layout.title.text


def test_empty_and_unchanged_figures_say_why():
    fig = weight_delta_figure([])
    assert not fig.data and "Pick a fine-tuned model" in fig.layout.annotations[0].text
    same = weight_delta(load_model(TINY), _copy(TINY))
    assert weight_delta_figure(same).layout.title.text.endswith("no weight changed")
