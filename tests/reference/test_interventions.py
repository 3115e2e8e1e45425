"""Interventions and attribution checked against transformers itself.

References used:
- ablation: the plain transformers forward with a forward_pre_hook written here on the attention
  output projection (o_proj / c_proj) that zeroes one head's slice of its input; and, for the
  default model, the plain forward with that head's o_proj weight COLUMNS set to zero (a change
  transformers computes through by itself, no hook involved);
- neuron ablation: a pre-hook on the MLP down projection zeroing one input column;
- patching: the clean forward's logits (patching the whole clean residual into the last layer
  must reproduce them);
- attribution: the model's own final logit (summed direct attributions + embedding term).
"""

import threading

import pytest
import torch

from conftest import DEFAULT
from model_core import load_model
from model_core.core.errors import PromptError, SettingsError
from model_core.interp.attribution import direct_logit_attribution
from model_core.interp.interventions import (
    Ablation,
    Metric,
    ablate,
    ablation_edits,
    compare_prompts,
    head_ablation_sweep,
    last_logits,
    make_metric,
    patch_heads,
    patch_residual,
    trace_with_edits,
)

MODELS = [DEFAULT, "random-gpt2-tiny", "random-gemma3-tiny"]
CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"


def _plain(lm, ids):
    with torch.inference_mode():
        return lm.model(torch.tensor([ids])).logits[0, -1]


def _metric(lm):
    if lm.name == DEFAULT:
        return make_metric(lm, " Paris", " Rome")
    return Metric(target=ord("P"), other=ord("R"), kind="logit_diff")


def _prompts(lm):
    if lm.name == DEFAULT:
        return CLEAN, CORRUPT
    return "Eiffel is in Paris", "Colosse is in Rome"  # byte tokenizer: same length


@pytest.mark.parametrize("name", MODELS)
def test_ablating_nothing_equals_the_clean_run(name):
    lm = load_model(name)
    res = ablate(lm, _prompts(lm)[0], Ablation())
    ref = _plain(lm, res.token_ids)
    assert torch.equal(res.ablated.next_logits, res.clean.next_logits)
    torch.testing.assert_close(res.ablated.next_logits, ref, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(last_logits(lm, torch.tensor([res.token_ids]), {})[0], ref, atol=2e-4, rtol=1e-4)


def _zero_head_hook(lm, layer, head):
    dh = lm.shape.d_head
    mod = lm.adapter.attn_z_module(lm.adapter.layers[layer])

    def pre(module, args):
        x = args[0].clone()
        x[..., head * dh:(head + 1) * dh] = 0
        return (x, *args[1:])
    return mod.register_forward_pre_hook(pre)


@pytest.mark.parametrize("name", MODELS)
def test_head_ablation_equals_a_hand_built_forward(name):
    lm = load_model(name)
    prompt = _prompts(lm)[0]
    layer, head = 1, 2
    res = ablate(lm, prompt, Ablation(heads=((layer, head),)))
    h = _zero_head_hook(lm, layer, head)
    try:
        ref = _plain(lm, res.token_ids)
    finally:
        h.remove()
    torch.testing.assert_close(res.ablated.next_logits, ref, atol=2e-4, rtol=1e-4)
    assert (res.ablated.next_logits - res.clean.next_logits).abs().max() > 1e-3  # it did something


def test_head_ablation_equals_zeroed_output_weights(default_lm):
    """No hook at all in the reference: o_proj's weight columns for that head set to zero."""
    lm = default_lm
    layer, head, dh = 5, 4, lm.shape.d_head
    res = ablate(lm, CLEAN, Ablation(heads=((layer, head),)))
    w = lm.adapter.layers[layer].self_attn.o_proj.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[:, head * dh:(head + 1) * dh] = 0
        ref = _plain(lm, res.token_ids)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    torch.testing.assert_close(res.ablated.next_logits, ref, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(_plain(lm, res.token_ids), res.clean.next_logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["random-gpt2-tiny", "random-gemma3-tiny"])
def test_mlp_and_neuron_ablation_match_plain_hooks(name):
    lm = load_model(name)
    ids = lm.tokenizer(_prompts(lm)[0])["input_ids"]
    layer, neuron = 2, 7
    mlp = lm.adapter.layers[layer].mlp
    down = mlp.down_proj if hasattr(mlp, "down_proj") else mlp.c_proj

    def pre(module, args):
        x = args[0].clone()
        x[..., neuron] = 0
        return (x, *args[1:])
    h = down.register_forward_pre_hook(pre)
    try:
        ref = _plain(lm, ids)
    finally:
        h.remove()
    got = ablate(lm, ids, Ablation(neurons=((layer, neuron),))).ablated.next_logits
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    # whole MLP layer, zero vs mean
    out = lm.adapter.mlp_out_module(lm.adapter.layers[layer])
    h = out.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    try:
        ref = _plain(lm, ids)
    finally:
        h.remove()
    torch.testing.assert_close(ablate(lm, ids, Ablation(mlps=(layer,))).ablated.next_logits, ref, atol=2e-4, rtol=1e-4)
    h = out.register_forward_hook(lambda m, i, o: o.mean(dim=1, keepdim=True).expand_as(o))
    try:
        ref = _plain(lm, ids)
    finally:
        h.remove()
    torch.testing.assert_close(ablate(lm, ids, Ablation(mlps=(layer,), mode="mean")).ablated.next_logits, ref,
                               atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_patching_the_whole_clean_residual_at_the_last_layer_gives_the_clean_logits(name):
    lm = load_model(name)
    clean, corrupt = _prompts(lm)
    c_ids = lm.tokenizer(clean)["input_ids"]
    k_ids = lm.tokenizer(corrupt)["input_ids"]
    assert len(c_ids) == len(k_ids)
    L = lm.shape.n_layers
    clean_tr = trace_with_edits(lm, c_ids)
    src = clean_tr.resid_pre[L - 1]
    got = last_logits(lm, torch.tensor([k_ids]), {f"blocks.{L - 1}.hook_resid_pre": lambda n, x: src[None].clone()})[0]
    torch.testing.assert_close(got, _plain(lm, c_ids), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_residual_patching_sweep(name):
    lm = load_model(name)
    clean, corrupt = _prompts(lm)
    m = _metric(lm)
    fractions = []
    L = lm.shape.n_layers
    layers = [0, L - 1] if name == DEFAULT else list(range(L))  # the full default sweep is the bench's job
    res = patch_residual(lm, clean, corrupt, m, layers=layers, progress=fractions.append, batch_size=7)
    T = len(res.corrupted_ids)
    assert res.values.shape == (len(layers), T) and not torch.isnan(res.values).any()
    assert fractions[-1] == 1.0 and fractions == sorted(fractions)
    assert res.n_forward == 2 + -(-len(layers) * T // 7)  # batched: ceil(cells / batch) patched passes
    # the corrupted and clean ends of the scale
    assert res.clean_value == pytest.approx(float(m(_plain(lm, res.clean_ids))), abs=1e-3)
    assert res.corrupted_value == pytest.approx(float(m(_plain(lm, res.corrupted_ids))), abs=1e-3)
    # positions where the prompts agree, at layer 0, change nothing (same token, same embedding)
    same = [p for p in range(T) if res.clean_ids[p] == res.corrupted_ids[p]]
    torch.testing.assert_close(res.normalized[0, same], torch.zeros(len(same)), atol=1e-3, rtol=0)
    # a single cell equals the same patch done one at a time without batching
    l, p = L - 1, T - 1
    src = trace_with_edits(lm, res.clean_ids).resid_pre[l][p]

    def one(n, x):
        x = x.clone()
        x[:, p] = src
        return x
    single = float(m(last_logits(lm, torch.tensor([res.corrupted_ids]), {f"blocks.{l}.hook_resid_pre": one})[0]))
    assert float(res.values[-1, p]) == pytest.approx(single, abs=1e-3)
    # and batching does not change any cell
    res1 = patch_residual(lm, clean, corrupt, m, layers=[L - 1], positions=[0, 3, T - 1], batch_size=1)
    torch.testing.assert_close(res1.values[0], res.values[-1, [0, 3, T - 1]], atol=1e-3, rtol=1e-4)


def test_default_model_patching_story(default_lm):
    """Eiffel/Colosseum: at the first layer the subject tokens carry the answer; at the last layer the
    final position does."""
    m = make_metric(default_lm, " Paris", " Rome")
    res = patch_residual(default_lm, CLEAN, CORRUPT, m, layers=[0, 29])
    assert res.clean_value > 0 > res.corrupted_value
    n = res.normalized
    assert n[0, 1:4].max() > 0.2  # " E" "iffel" " Tower" vs " Col" "osse" "um"
    assert n[1, -1] > 0.5


@pytest.mark.parametrize("name", MODELS)
def test_head_patching(name):
    lm = load_model(name)
    clean, corrupt = _prompts(lm)
    m = _metric(lm)
    layers = [1] if name == DEFAULT else None
    res = patch_heads(lm, clean, corrupt, m, layers=layers, batch_size=5)
    assert res.values.shape == (1 if layers else lm.shape.n_layers, lm.shape.n_heads)
    # reference for one cell: a plain pre-hook on o_proj copying the clean head slice
    l, h, dh = 1, 1, lm.shape.d_head
    mod = lm.adapter.attn_z_module(lm.adapter.layers[l])
    seen = {}

    def keep(module, args):
        seen["z"] = args[0].clone()
    hk = mod.register_forward_pre_hook(keep)
    try:
        _plain(lm, res.clean_ids)
    finally:
        hk.remove()

    def pre(module, args):
        x = args[0].clone()
        x[..., h * dh:(h + 1) * dh] = seen["z"][..., h * dh:(h + 1) * dh]
        return (x, *args[1:])
    hk = mod.register_forward_pre_hook(pre)
    try:
        ref = float(m(_plain(lm, res.corrupted_ids)))
    finally:
        hk.remove()
    assert float(res.values[res.rows.index(l), h]) == pytest.approx(ref, abs=1e-3)


def test_different_lengths_error_or_align(default_lm):
    m = make_metric(default_lm, " Paris", " Rome")
    with pytest.raises(PromptError, match="same length|last token"):
        patch_residual(default_lm, "The Eiffel Tower in Paris is in the city of", CORRUPT, m, layers=[0])
    res = patch_residual(default_lm, "The famous Eiffel Tower is in the city of", CORRUPT, m, layers=[29],
                         align="right")
    assert res.aligned.startswith("aligned")
    assert not torch.isnan(res.values[0, -1])
    with pytest.raises(SettingsError):
        make_metric(default_lm, " Parisian Eiffel")
    with pytest.raises(SettingsError):
        ablation_edits(default_lm, Ablation(heads=((30, 0),)))


@pytest.mark.parametrize("name", MODELS)
def test_direct_logit_attribution_sums_to_the_logit(name):
    lm = load_model(name)
    clean = _prompts(lm)[0]
    m = _metric(lm)
    a = direct_logit_attribution(lm, clean, m.target)
    ref = _plain(lm, a.token_ids)
    assert a.logit == pytest.approx(float(ref[m.target]), abs=2e-4)
    assert a.total == pytest.approx(a.logit, abs=1e-3)
    torch.testing.assert_close(a.heads.sum(1) + a.attn_bias, a.attn, atol=1e-4, rtol=1e-4)
    d = direct_logit_attribution(lm, clean, m)  # logit difference
    assert d.total == pytest.approx(float(ref[m.target] - ref[m.other]), abs=1e-3)
    # an earlier position works too
    e = direct_logit_attribution(lm, clean, m.target, position=2)
    with torch.inference_mode():
        mid = lm.model(torch.tensor([a.token_ids])).logits[0, 2, m.target]
    assert e.total == pytest.approx(float(mid), abs=1e-3)


def test_interventions_do_not_leak_between_threads(default_lm):
    lm = default_lm
    ids = lm.tokenizer(CLEAN)["input_ids"]
    clean = _plain(lm, ids)
    started, release = threading.Event(), threading.Event()
    results = {}

    def slow_edit(name, x):
        started.set()
        release.wait(10)
        return torch.zeros_like(x)

    def worker():
        results["ablated"] = last_logits(lm, torch.tensor([ids]), {"blocks.3.hook_mlp_out": slow_edit})[0]

    t = threading.Thread(target=worker)
    t.start()
    started.wait(10)
    results["plain"] = last_logits(lm, torch.tensor([ids]), {})[0]  # while the other one is mid-forward
    release.set()
    t.join()
    torch.testing.assert_close(results["plain"], clean, atol=2e-4, rtol=1e-4)
    assert (results["ablated"] - clean).abs().max() > 1e-2
    torch.testing.assert_close(_plain(lm, ids), clean)


def test_compare_prompts_and_head_sweep(default_lm):
    c = compare_prompts(default_lm, CLEAN, CORRUPT, k=5)
    assert c.top["a"]["tokens"][0] == " Paris" and c.top["b"]["tokens"][0] == " Rome"
    assert c.resid_diff_norm.shape == (30,) and (c.resid_diff_norm > 0).all()  # the last token is the same,
    assert float(c.resid_rel_diff[0]) < float(c.resid_rel_diff[-1])  # the prompts' difference flows into it
    same = compare_prompts(default_lm, CLEAN, CLEAN)
    assert float(same.resid_diff_norm.abs().max()) == 0
    lm = load_model("random-gpt2-tiny")
    m = _metric(lm)
    sweep = head_ablation_sweep(lm, _prompts(lm)[0], m, batch_size=5)
    one = ablate(lm, _prompts(lm)[0], Ablation(heads=((2, 3),)), metric=m)
    assert float(sweep[2, 3]) == pytest.approx(one.ablated_metric - one.clean_metric, abs=1e-4)
