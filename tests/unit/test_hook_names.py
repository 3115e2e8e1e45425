"""model_core.core.hook_names: the one place TransformerLens-style names are built and read.

References: the names written out by hand below (they are external API: saved trace files, URLs,
tests), the shapes the module documents evaluated with each model's own sizes, and the names the
real forward's hooks call edits with.
"""

import re

import pytest
import torch

from conftest import RANDOM_MODELS
from model_core import load_model, load_trace, save_trace, trace
from model_core.core.hook_names import (
    KINDS,
    LAYER_KINDS,
    TRACE_LAYER_KINDS,
    UnknownHookName,
    act_name,
    layer_of,
    parse,
)
from model_core.interp.interventions import last_logits, trace_with_edits

PROMPT = "The animal didn't cross the street because it was too tired"

# Written out, not built: what each kind is called in layer 7 (model-wide kinds have no layer).
SPELLED = {
    "resid_pre": "blocks.7.hook_resid_pre",
    "z": "blocks.7.attn.hook_z",
    "pattern": "blocks.7.attn.hook_pattern",
    "attn_out": "blocks.7.hook_attn_out",
    "resid_mid": "blocks.7.hook_resid_mid",
    "post": "blocks.7.mlp.hook_post",
    "mlp_out": "blocks.7.hook_mlp_out",
    "resid_post": "blocks.7.hook_resid_post",
    "embed": "hook_embed",
    "ln_final": "ln_final.hook_normalized",
    "logits": "logits",
}


def test_every_kind_has_its_transformerlens_name():
    assert set(KINDS) == set(SPELLED)
    for kind, name in SPELLED.items():
        got = act_name(kind, 7) if KINDS[kind].per_layer else act_name(kind)
        assert got == name, kind
        assert parse(name) == (kind, 7 if KINDS[kind].per_layer else None)
        # the name's own suffix works as a kind too ("attn.hook_pattern", "hook_attn_out" ...)
        suffix = name.removeprefix("blocks.7.")
        assert (act_name(suffix, 7) if KINDS[kind].per_layer else act_name(suffix)) == name


@pytest.mark.parametrize("layer", [0, 1, 9, 10, 29, 123])
def test_round_trip_for_every_kind_and_layer(layer):
    for kind in LAYER_KINDS:
        name = act_name(kind, layer)
        assert name == SPELLED[kind].replace("blocks.7.", f"blocks.{layer}.")
        assert parse(name) == (kind, layer)
        assert layer_of(name) == layer
    for kind in set(KINDS) - set(LAYER_KINDS):
        assert parse(act_name(kind)) == (kind, None) and layer_of(act_name(kind)) is None


@pytest.mark.parametrize("name", [
    "", "blocks", "blocks.3", "blocks.3.hook_resid", "blocks.3.hook_resid_pre.x", "blocks.-1.hook_resid_pre",
    "blocks.03.hook_resid_pre", "blocks.x.hook_resid_pre", "blocks.3.attn_hook_pattern", "blocks.3.hook_pattern",
    "blocks.3.hook_embed", "blocks.3.logits", "hook_resid_pre", "ln_final", "BLOCKS.3.hook_resid_pre",
    " blocks.3.hook_resid_pre", "blocks.3.hook_resid_pre\n", "next_logits", None, 3,
])
def test_unknown_names_are_refused_with_one_sentence(name):
    with pytest.raises(UnknownHookName) as e:
        parse(name)
    assert isinstance(e.value, KeyError)  # a mapping's miss, as Trace[name] always raised
    assert str(e.value) == f"unknown hook name '{name}'"


@pytest.mark.parametrize("kind, layer", [
    ("resid", 3), ("hook_pattern", 3), ("pattern", None), ("pattern", -1), ("pattern", True), ("pattern", "3"),
    ("pattern", 3.0), ("logits", 0), ("embed", 2),
])
def test_act_name_refuses_unknown_kinds_and_wrong_layers(kind, layer):
    with pytest.raises(UnknownHookName):
        act_name(kind, layer)


def _dims(lm, T):
    s = lm.shape
    return {"T": T, "d_model": s.d_model, "n_heads": s.n_heads, "d_head": s.d_head, "d_mlp": s.d_mlp,
            "vocab": s.vocab_size}


def _documented_shape(kind, dims):
    """'[n_heads*d_head, T]' -> (dims['n_heads'] * dims['d_head'], dims['T'])."""
    out = []
    for part in re.fullmatch(r"\[(.*)\]", KINDS[kind].shape).group(1).split(","):
        n = 1
        for f in part.strip().split("*"):
            n *= dims[f]
        out.append(n)
    return tuple(out)


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_every_name_a_trace_serves_parses_and_has_the_documented_shape(name):
    lm = load_model(name)
    zs = {}
    tr = trace_with_edits(lm, lm.tokenizer(PROMPT)["input_ids"], {}, capture_z=True, store=zs)
    L, dims = lm.shape.n_layers, _dims(lm, tr.n_tokens)
    names = tr.hook_names()
    # hook_embed, 7 names per layer, ln_final, logits: written out for layer 0
    assert names[:8] == ["hook_embed", "blocks.0.hook_resid_pre", "blocks.0.attn.hook_pattern",
                         "blocks.0.hook_attn_out", "blocks.0.hook_resid_mid", "blocks.0.mlp.hook_post",
                         "blocks.0.hook_mlp_out", "blocks.0.hook_resid_post"]
    assert names[-2:] == ["ln_final.hook_normalized", "logits"] and len(names) == 3 + 7 * L
    seen = set()
    for n in names:
        kind, layer = parse(n)
        assert act_name(kind, layer) == n
        assert tuple(tr[n].shape) == _documented_shape(kind, dims), n
        seen.add(kind)
    assert seen == {k for k in KINDS if KINDS[k].in_trace} and seen == set(KINDS) - {"z"}
    # hook_z is an edit point only: the trace refuses it, its captured value has the documented shape
    with pytest.raises(KeyError):
        tr[act_name("z", 0)]
    assert sorted(zs) == sorted(act_name("z", l) for l in range(L))
    assert all(tuple(z.shape) == _documented_shape("z", dims) for z in zs.values())
    assert list(TRACE_LAYER_KINDS) == [parse(n)[0] for n in names[1:8]]


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_the_forward_calls_edits_by_these_names(name):
    """An identity edit under every name of every kind: the hooks call exactly the edit points,
    each once per layer, with the name it was registered under; the output is unchanged."""
    lm = load_model(name)
    L = lm.shape.n_layers
    called = []

    def spy(n, x):
        called.append(n)
        return x
    every = {act_name(k, l): spy for k in LAYER_KINDS for l in range(L)}
    every.update({act_name(k): spy for k in KINDS if not KINDS[k].per_layer})
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]])
    plain = last_logits(lm, ids)
    edited = last_logits(lm, ids, every)
    assert torch.equal(plain, edited)
    expected = [f"blocks.{l}.{h}" for l in range(L)
                for h in ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "mlp.hook_post", "hook_mlp_out")]
    assert sorted(called) == sorted(expected + ["ln_final.hook_normalized"])


def test_a_saved_trace_serves_the_same_names(tmp_path):
    lm = load_model("random-llama-tiny")
    tr = trace(lm, PROMPT)
    back = load_trace(save_trace(tr, tmp_path / "t.safetensors", {"layer": 1}))
    names = back.hook_names()
    for n in names:
        if n not in ("next_logits", "token_logprobs"):
            parse(n)
            assert torch.equal(back[n], tr[n]), n
    # every layer's residual names; the pattern and MLP activation of layer 1 only
    assert {parse(n) for n in names if n.startswith("blocks.")} == (
        {(k, l) for k in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post") for l in tr.captured_layers}
        | {("pattern", 1), ("post", 1)})
    with pytest.raises(KeyError, match="not in this file"):
        back[act_name("pattern", 0)]
    with pytest.raises(UnknownHookName):
        back["blocks.1.hook_nothing"]
