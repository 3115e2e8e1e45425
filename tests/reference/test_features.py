"""Sparse-autoencoder features on the real default model (SmolLM2-135M-Instruct, CPU, fp32), with a
tiny token budget (a few steps: the numbers are checked, not the quality).

References: the activation the autoencoder reads against transformers' own `output_hidden_states`
(hidden_states[L + 1] is block L's output, resid_post); the autoencoder recomputed by hand from its
weights (ReLU, top-k, decoder); CE by hand from the logits of a transformers forward with the
reconstruction spliced in through a Recorder edit; FVU by hand from those hidden states.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from model_core.core.hook_names import act_name
from model_core.core.hooks import Recorder, instrument, recording
from model_core.interp import features as F

LAYER = 6
SMALL = dict(max_tokens=512, num_latents=1152, k=16, batch_size=4, context=32, eval_tokens=256, context_tokens=256)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    d = tmp_path_factory.mktemp("features-data")
    mp.setenv("LMSCOPE_DATA_DIR", str(d))
    yield d
    mp.undo()


@pytest.fixture(scope="module")
def run(default_lm, data_dir):
    steps = []
    r = F.train_features(default_lm.name, LAYER, "resid_post", "builtin", name="test-l6", seed=1,
                         progress=lambda s, t, m: steps.append((s, t, m)), **SMALL)
    r.progress_rows = steps
    return r


def by_hand(sae, x: torch.Tensor) -> torch.Tensor:
    """The TopK autoencoder from its weights: relu(W_enc (x - b_dec) + b_enc), top k, decode."""
    W_enc, b_enc = sae.encoder.weight.detach(), sae.encoder.bias.detach()
    W_dec, b_dec = sae.W_dec.detach(), sae.b_dec.detach()
    pre = torch.relu((x - b_dec) @ W_enc.T + b_enc)
    top = torch.topk(pre, sae.cfg.k, dim=-1)
    z = torch.zeros_like(pre).scatter_(-1, top.indices, top.values)
    return z @ W_dec + b_dec


def nll_sum(logits, ids) -> tuple[float, int]:
    """Sum of -log p(next token) over every prediction of the batch, and how many."""
    lp = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return float(-lp.sum()), lp.numel()


def ce_by_hand(lm, ids, edits) -> tuple[float, int]:
    """nll_sum of a transformers forward with the edits active."""
    instrument(lm.adapter)
    with torch.no_grad(), recording(Recorder(capture=False, edits=edits)):
        return nll_sum(lm.model(input_ids=ids, use_cache=False).logits, ids)


@pytest.fixture(scope="module")
def held_out(default_lm, run):
    """Per held-out batch: the windows, transformers' hidden state after block LAYER, the clean NLL sum."""
    windows = F.eval_windows(default_lm.tokenizer, "builtin", SMALL["eval_tokens"], SMALL["context"])
    out = []
    for b0 in range(0, windows.shape[0], SMALL["batch_size"]):
        ids = windows[b0:b0 + SMALL["batch_size"]]
        with torch.no_grad():
            o = default_lm.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        out.append((ids, o.hidden_states[LAYER + 1].float(), nll_sum(o.logits, ids)[0]))
    return out


def test_the_autoencoder_reads_transformers_resid_post(default_lm, run, held_out):
    hp = F.hook_point(default_lm, LAYER, "resid_post")
    assert (hp.name, hp.edit_name) == (act_name("resid_post", LAYER), act_name("resid_pre", LAYER + 1))
    ids, hs, _ = held_out[0]
    assert torch.equal(F.capture(default_lm, hp, ids).float(), hs)
    x = hs[:, 1:].reshape(-1, hs.shape[-1])
    torch.testing.assert_close(F.reconstruct(run.features.sae, x), by_hand(run.features.sae, x),
                               rtol=1e-4, atol=1e-4)


def test_reported_ce_equals_a_transformers_forward_with_the_reconstruction_spliced_in(default_lm, run, held_out):
    q = run.record["quality"]
    sae = run.features.sae
    edit_at = act_name("resid_pre", LAYER + 1)  # = resid_post of LAYER

    def splice(fn):
        def edit(name, x):
            y = x.clone()
            y[:, 1:] = fn(x[:, 1:])
            return y
        return {edit_at: edit}

    tot = {"clean": 0.0, "sae": 0.0, "zero": 0.0}
    n = 0
    for ids, _, clean in held_out:
        tot["clean"] += clean
        for key, edits in (("sae", splice(lambda v: by_hand(sae, v))), ("zero", splice(torch.zeros_like))):
            s, c = ce_by_hand(default_lm, ids, edits)
            tot[key] += s
        n += c
    assert n == q["predictions"]
    for key in tot:
        assert abs(tot[key] / n - q[f"ce_{key}"]) < 1e-4, (key, tot[key] / n, q[f"ce_{key}"])
    rec = (tot["zero"] - tot["sae"]) / (tot["zero"] - tot["clean"])
    assert abs(rec - q["ce_recovered"]) < 1e-4


def test_reported_fvu_equals_fvu_from_the_hidden_states(run, held_out):
    sae = run.features.sae
    xs = torch.cat([hs[:, 1:].reshape(-1, hs.shape[-1]) for _, hs, _ in held_out]).double()
    err = (xs - by_hand(sae, xs.float()).double()).pow(2).sum()
    fvu = float(err / (xs - xs.mean(0)).pow(2).sum())
    q = run.record["quality"]
    assert q["activations"] == xs.shape[0]
    assert abs(q["fvu"] - fvu) < 1e-5 * max(1.0, fvu)
    assert abs(q["explained"] - (1 - fvu)) < 1e-5


def test_zero_ablation_is_worse_than_the_reconstruction_which_is_no_better_than_clean(run):
    q = run.record["quality"]
    assert q["ce_zero"] > q["ce_sae"] >= q["ce_clean"] - 0.05
    assert math.isfinite(q["ce_recovered"]) and 0.0 < q["ce_recovered"] <= 1.05
    assert 0.0 < q["explained"] < 1.0
    assert q["l0"] <= SMALL["k"]


def test_activation_buffer_never_exceeds_the_stated_bound(run):
    b, mem = run.buffer, run.record["memory"]
    assert b.limit_rows == SMALL["batch_size"] * SMALL["context"] == mem["limit_rows"]
    assert 0 < b.peak_rows <= b.limit_rows and mem["peak_rows"] == b.peak_rows
    assert b.batches == run.record["steps"] == SMALL["max_tokens"] // (SMALL["batch_size"] * SMALL["context"])
    assert f"at most {b.limit_rows} activations" in mem["statement"]
    assert run.record["tokens"] == SMALL["max_tokens"]


def test_progress_history_and_the_saved_folder(default_lm, run, data_dir):
    rows = [m for s, t, m in run.progress_rows if m.get("phase") == "training"]
    assert [r["step"] for r in rows] == list(range(1, run.record["steps"] + 1))
    assert all({"loss", "fvu", "dead_share", "tokens_per_s"} <= set(r) for r in rows)
    assert [m["phase"] for _, _, m in run.progress_rows[len(rows):]] == ["evaluating", "contexts", "saving"]
    path = data_dir / "features" / "test-l6"
    assert run.path == path
    assert sorted(p.name for p in path.iterdir()) == ["cfg.json", "contexts.safetensors", "features.json",
                                                        "labels.json", "sae.safetensors"]
    assert not list((data_dir / "features-staging").iterdir())
    loaded = F.load_features("test-l6")
    for k, v in run.features.sae.state_dict().items():
        assert torch.equal(loaded.sae.state_dict()[k], v), k
    assert (loaded.layer, loaded.hook, loaded.num_latents) == (LAYER, "resid_post", SMALL["num_latents"])
    labels = json.loads((path / "labels.json").read_text())
    assert len(labels) == SMALL["num_latents"] and all("→" in lab["label"] for lab in labels)


def test_feature_activations_top_contexts_and_promoted_tokens_by_hand(default_lm, run):
    lm, feats = default_lm, run.features
    sae = feats.sae
    got = F.feature_activations(lm, feats, "The function returns a list of strings.", top=3)
    ids = lm.tokenizer("The function returns a list of strings.")["input_ids"]
    with torch.no_grad():
        hs = lm.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[LAYER + 1][0]
    pre = torch.relu((hs - sae.b_dec) @ sae.encoder.weight.T + sae.encoder.bias).detach()
    for row in got["positions"]:
        top = torch.topk(pre[row["position"]], sae.cfg.k)
        want = [(int(i), float(v)) for v, i in zip(top.values[:3], top.indices[:3]) if v > 0]
        assert [f["feature"] for f in row["features"]] == [i for i, _ in want]
        for f, (_, v) in zip(row["features"], want):
            assert abs(f["activation"] - v) < 1e-4

    index = F.FeatureContexts.load(run.path / "contexts.safetensors")
    f = int((index.idx >= 0).sum(1).argmax())  # the feature with the most contexts
    ctx = F.top_contexts(index, lm.tokenizer, f)
    assert ctx and ctx == sorted(ctx, key=lambda c: -c["value"])
    with torch.no_grad():
        w = index.tokens[ctx[0]["window"]][None]
        h = lm.model(input_ids=w, output_hidden_states=True).hidden_states[LAYER + 1][0]
    pre = torch.relu((h - sae.b_dec) @ sae.encoder.weight.T + sae.encoder.bias).detach()
    assert abs(float(pre[ctx[0]["position"], f]) - ctx[0]["value"]) < 1e-4

    g = lm.adapter.final_norm.weight.float()  # RMSNorm: the gain itself
    logits = (sae.W_dec[f].detach() * g) @ lm.adapter.unembed.weight.float().T
    want = torch.topk(logits, 5).indices.tolist()
    assert [r["id"] for r in F.promoted_tokens(lm, feats, f, 5)["promoted"]] == want
    lab = F.label(lm, feats, index, f)
    from model_core.core.tokenization import byte_safe_decode

    # the tokenizer's decode, or <0xNN> for a token that is part of a character (this set's top one is)
    assert lab["promotes"][0] == byte_safe_decode(lm.tokenizer, [want[0]]) and lab["contexts"] == len(ctx)
    assert "\ufffd" not in lab["label"]
    # the label shows tokens as the views do (␣ for a space, <0xNN> for a stray byte), each quoted
    from model_core.core.tokenization import display_bytes, token_bytes

    assert f"“{display_bytes(token_bytes(lm.tokenizer, want[0]))}”" in lab["label"].split(" → ")[1]


def test_density_and_histogram_count_every_activation_of_the_scan(default_lm, run):
    """The feature page's density and histogram against the encoder formula applied by hand to
    transformers' hidden_states over the scanned windows (top-k of relu pre-activations, position 0
    of each window skipped), binned with numpy."""
    import numpy as np

    lm, sae = default_lm, run.features.sae
    index = F.FeatureContexts.load(run.path / "contexts.safetensors")
    assert index.hist is not None and index.hist.shape == (SMALL["num_latents"], F.HIST_BINS)
    with torch.no_grad():
        h = lm.model(input_ids=index.tokens, output_hidden_states=True).hidden_states[LAYER + 1][:, 1:]
    pre = torch.relu((h - sae.b_dec) @ sae.encoder.weight.T + sae.encoder.bias).detach()  # [N, W-1, M]
    top = torch.topk(pre, sae.cfg.k, dim=-1)
    kept = torch.zeros_like(pre).scatter_(-1, top.indices, top.values)  # [N, W-1, M]: what the encoder keeps
    fired = (kept > 0).sum((0, 1))  # [M]
    assert index.hist.sum(1).tolist() == fired.tolist()
    assert index.scanned == index.tokens.shape[0] * (index.tokens.shape[1] - 1)
    f = int(fired.argmax())
    d = F.density(index, f)
    assert d["fired"] == int(fired[f]) and d["density"] == pytest.approx(int(fired[f]) / index.scanned)
    v = kept[..., f][kept[..., f] > 0].numpy()
    edges = np.array(d["edges"])
    # a value within 1e-4 (log10) of an edge may fall either side (the encoder sums in another order)
    near = np.abs(np.log10(v)[:, None] - np.log10(edges)[None]).min(1) <= 1e-4
    want = np.histogram(np.clip(v, edges[0], edges[-1]), edges)[0]
    assert np.abs(np.array(d["counts"]) - want).sum() <= 2 * int(near.sum()), (d["counts"], want.tolist())
    assert np.bincount(F._hist_bins(torch.tensor(v[~near])).numpy(), minlength=F.HIST_BINS).tolist() == \
        np.histogram(np.clip(v[~near], edges[0], edges[-1]), edges)[0].tolist()
    assert sum(d["counts"]) == d["fired"] and len(d["counts"]) == len(edges) - 1
    assert F.density(F.FeatureContexts(index.tokens, index.vals, index.idx), f) == {}  # an older set


def test_labels_of_contexts_cut_inside_a_character_show_bytes_not_replacement_marks(default_lm, run):
    """Burmese: SmolLM2 spells each character in 3 byte tokens, so an n-gram ending at the activating
    token often starts or ends inside one. The label shows those bytes as <0xNN> (as the views do);
    whole characters decode as the tokenizer decodes them."""
    from model_core.core.tokenization import byte_safe_decode

    lm = default_lm
    ids = lm.tokenizer("မြန်မာ စာ", add_special_tokens=False)["input_ids"]
    assert "\ufffd" in lm.tokenizer.decode(ids[:2])  # the reason for this test
    assert byte_safe_decode(lm.tokenizer, ids[:2]) == "<0xE1><0x80>"
    assert byte_safe_decode(lm.tokenizer, ids) == lm.tokenizer.decode(ids) == "မြန်မာ စာ"
    W = 8
    windows = torch.tensor([(ids + ids)[:W], (ids[1:] + ids)[:W]])  # [2, W]
    M = run.features.num_latents
    vals = torch.full((M, 2), float("-inf"))
    idx = torch.full((M, 2), -1, dtype=torch.int64)
    vals[0], idx[0] = torch.tensor([2.0, 1.0]), torch.tensor([4, W + 4])  # two contexts, each mid-character
    index = F.FeatureContexts(tokens=windows, vals=vals, idx=idx)
    lab = F.label(lm, run.features, index, 0, promoted=[ids[0]])
    assert "\ufffd" not in lab["label"] and "<0x" in lab["label"], lab
    assert lab["promotes"] == ["<0xE1>"]
    for r in lab["reads"]:
        assert r["text"].encode("utf-8") and "\ufffd" not in r["text"]


def test_bad_layer_hook_and_width_are_one_sentence(default_lm):
    lm = default_lm
    cases = [lambda: F.hook_point(lm, 99, "resid_post"), lambda: F.hook_point(lm, 29, "resid_post"),
             lambda: F.hook_point(lm, 3, "pattern"), lambda: F.hook_point(lm, 3, "blocks.4.hook_mlp_out"),
             lambda: F.train_features(lm.name, 99, max_tokens=512)]
    for case in cases:
        with pytest.raises(F.FeatureError) as e:
            case()
        msg = str(e.value)
        assert msg.endswith(".") and "\n" not in msg, msg
    with pytest.raises(F.FeatureError, match="from 0 to 29"):
        F.hook_point(lm, 99, "resid_post")
    other = F.Features(sae=F.new_sae(64, num_latents=128, k=4), model=lm.name, layer=LAYER, hook="resid_post")
    with pytest.raises(F.FeatureError, match="width 64.*width 576"):
        F.feature_activations(lm, other, "hello there")


def test_a_cancelled_run_leaves_nothing(default_lm, data_dir):
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 1  # after the first step

    with pytest.raises(F.FeaturesCancelled):
        F.train_features(default_lm.name, 2, "mlp_out", name="cancelled", should_stop=stop, **SMALL)
    assert not (data_dir / "features" / "cancelled").exists()
    assert not list((data_dir / "features-staging").iterdir())


def test_builtin_texts_are_the_job_corpus():
    from tasks.corpus import builtin_docs

    for split in ("train", "heldout"):
        assert F.builtin_texts(split) == builtin_docs(split)
