"""Transcoder sets in the ecosystem's formats (model_core.interp.transcoder_formats), on a
random-weight Llama: each test writes the files itself the way the other library lays them out
(SAELens' cfg.json + sae_weights.safetensors, circuit-tracer's layer_<l>.safetensors + config.yaml,
sparsify's layers.<l>.mlp/), imports them, and checks lmscope's coder against that library's own
equations computed here from the raw tensors (SAELens: relu(x W_enc + b_enc) * (pre > threshold)
W_dec + b_dec + x W_skip^T; circuit-tracer: the same with W_enc stored transposed; sparsify: its own
SparseCoder's output). An imported set then builds an attribution graph whose checks pass, and a
set trained here exports to each format and reads back equal."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from model_core import load_model
from model_core.core import paths
from model_core.interp import attribution_graph as AG
from model_core.interp import transcoders as TC
from model_core.interp.features_sae import FeatureError
from model_core.interp.transcoder_formats import DenseTranscoder, detect_format, read_transcoders

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def trained():
    lm = load_model("random-llama-tiny")
    run = TC.train_transcoders(lm.name, max_tokens=1024, context=32, batch_size=8, k=8, eval_tokens=128, save=False)
    return lm, run.transcoders


@pytest.fixture()
def data(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "data_dir", lambda: tmp_path / "data")
    return tmp_path


def _inputs(lm, layer: int) -> torch.Tensor:
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]])
    return TC.mlp_pairs(lm, ids, [layer])[layer][0][0]  # [T, d]


def _raw(tc, layer, thr_quantile=0.97):
    """Weights with a JumpReLU threshold that leaves a few features on, in SAELens' orientation."""
    c = tc.coders[layer]
    W_enc = c.encoder.weight.detach().mT.contiguous()  # [d, F]
    thr = torch.full((W_enc.shape[1],), 0.0)
    return {"W_enc": W_enc, "b_enc": c.encoder.bias.detach().clone(), "W_dec": c.W_dec.detach().clone(),
            "b_dec": c.b_dec.detach().clone(), "W_skip": c.W_skip.detach().clone(), "threshold": thr}


def _saelens_reference(t, x):
    pre = x @ t["W_enc"] + t["b_enc"]
    acts = torch.relu(pre) * (pre > t["threshold"])
    return acts @ t["W_dec"] + t["b_dec"] + x @ t["W_skip"].mT


def test_a_saelens_jumprelu_skip_transcoder_opens_and_equals_saelens_equations(trained, data):
    lm, tc = trained
    src = data / "saelens-set"
    refs = {}
    for layer in tc.layers:
        t = _raw(tc, layer)
        x = _inputs(lm, layer)
        pre = x @ t["W_enc"] + t["b_enc"]
        t["threshold"] = pre.quantile(0.97, dim=0).clamp(min=0.01)  # a few features per position
        t["threshold"][:8] = -0.5  # SAELens: relu(pre) * (pre > t), so a negative threshold is a ReLU
        folder = src / f"blocks.{layer}.ln2.hook_normalized"
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "sae_weights.safetensors"))
        (folder / "cfg.json").write_text(json.dumps({
            "architecture": "jumprelu_skip_transcoder", "d_in": lm.shape.d_model, "d_sae": t["W_enc"].shape[1],
            "d_out": lm.shape.d_model, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": False,
            "normalize_activations": "none",
            "metadata": {"model_name": lm.name, "hook_name": f"blocks.{layer}.ln2.hook_normalized",
                         "hook_name_out": f"blocks.{layer}.hook_mlp_out"}}))
        refs[layer] = (t, x)
    assert detect_format(src) == "saelens"
    imported = TC.import_transcoders(src, name="from-saelens")  # the model comes from cfg.json's metadata
    assert imported.model == lm.name and imported.layers == tc.layers
    back = TC.load_transcoders("from-saelens")
    for layer, (t, x) in refs.items():
        got = TC.transcode(back.coders[layer], x)
        ref = _saelens_reference(t, x)
        assert torch.allclose(got, ref, atol=1e-5 * float(ref.abs().max()), rtol=0), layer
        assert back.coders[layer].activation == "jumprelu"
    # and the graph on it adds up
    g = AG.attribution_graph(lm, back, PROMPT, max_feature_nodes=256)
    for name in ("logit", "completeness", "pre_activations", "intervention"):
        assert g.checks[name]["ok"], (name, g.checks[name])
    assert g.stats["active_features"] > 0


def test_a_circuit_tracer_set_opens_relu_jumprelu_and_topk(trained, data):
    lm, tc = trained
    layer = 0
    x = _inputs(lm, layer)
    c = tc.coders[layer]
    W_enc, b_enc = c.encoder.weight.detach(), c.encoder.bias.detach()  # circuit-tracer: W_enc [d_sae, d_model]
    W_dec, b_dec, W_skip = c.W_dec.detach(), c.b_dec.detach(), c.W_skip.detach()
    pre = x @ W_enc.mT + b_enc
    thr = pre.quantile(0.95, dim=0)
    neg = torch.full_like(thr, -0.05)
    k_big = int((pre > 0).sum(-1).min()) + 3  # more than some row's positive pre-activations
    topk_big = pre.topk(k_big)
    cases = {
        # circuit-tracer's JumpReLU: pre * (pre > threshold), with the threshold in the file
        "jumprelu": ({"activation_function.threshold": thr}, {}, pre * (pre > thr)),
        # a negative threshold: small negative activations stay (signed), as circuit-tracer computes them
        "jumprelu-negative": ({"activation_function.threshold": neg}, {}, pre * (pre > neg)),
        # circuit-tracer's TopK keeps the k largest pre-activations even where they are negative
        "topk-past-positives": ({}, {"activation": "topk", "k": k_big},
                                torch.zeros_like(pre).scatter_(-1, topk_big.indices, topk_big.values)),
        "relu": ({}, {"activation": "relu"}, torch.relu(pre)),
        # TopK: k in config.yaml, as circuit-tracer's load_transcoder_set takes it
        "topk": ({}, {"activation": "topk", "k": 5},
                 torch.zeros_like(pre).scatter_(-1, pre.topk(5).indices, pre.topk(5).values)),
    }
    for kind, (extra, cfg_extra, acts) in cases.items():
        src = data / f"ct-{kind}"
        src.mkdir()
        save_file({"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_dec, "W_skip": W_skip, **extra},
                  str(src / "layer_0.safetensors"))
        (src / "config.yaml").write_text(yaml.safe_dump({
            "model_name": lm.name, "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
            "feature_output_hook": "mlp.hook_out", "transcoders": ["layer_0.safetensors"], **cfg_extra}))
        coders, meta = read_transcoders(src)
        assert meta == {"model": lm.name, "format": "circuit-tracer"}
        ref = acts @ W_dec + b_dec + x @ W_skip.mT
        got = TC.transcode(coders[0], x)
        assert torch.allclose(got, ref, atol=1e-5 * float(ref.abs().max()), rtol=0), kind
        assert coders[0].activation == kind.split("-")[0]
        if kind in ("jumprelu-negative", "topk-past-positives"):
            assert float(acts.min()) < 0  # the case holds negative activations, which must be kept


def test_a_sparsify_trainer_folder_opens_and_equals_sparsify(trained, data):
    lm, tc = trained
    src = data / "sparsify-out"
    for layer, c in tc.coders.items():
        c.save_to_disk(src / f"layers.{layer}.mlp")  # sparsify's own writer, its trainer's names
    assert detect_format(src) == "sparsify"
    imported = TC.import_transcoders(src, model=lm.name, name="from-sparsify")
    x = _inputs(lm, 1)
    enc = tc.coders[1].encode(x)
    ref = tc.coders[1].decode(enc.top_acts, enc.top_indices) + x @ tc.coders[1].W_skip.mT  # sparsify's forward
    assert torch.allclose(TC.transcode(TC.load_transcoders("from-sparsify").coders[1], x), ref, atol=1e-6)
    assert imported.record["imported_from"]["format"] == "sparsify"


def test_a_set_trained_here_exports_to_each_format_and_reads_back_equal(trained, data):
    lm, tc = trained
    tc.name = ""
    TC.save_transcoders(tc, "here")
    x = _inputs(lm, 1)
    ref = TC.transcode(tc.coders[1], x)
    # circuit-tracer reads TopK: the files carry its keys and shapes, k in config.yaml
    TC.export_transcoders("here", data / "out-ct", "circuit-tracer")
    cfg = yaml.safe_load((data / "out-ct" / "config.yaml").read_text())
    assert cfg["activation"] == "topk" and cfg["k"] == 8 and cfg["model_kind"] == "transcoder_set"
    assert cfg["transcoders"] == [f"layer_{layer}.safetensors" for layer in tc.layers]
    t = load_file(str(data / "out-ct" / "layer_1.safetensors"))
    F_, d = tc.coders[1].num_latents, lm.shape.d_model
    assert t["W_enc"].shape == (F_, d) and t["W_dec"].shape == (F_, d) and t["W_skip"].shape == (d, d)
    coders, _ = read_transcoders(data / "out-ct")
    assert torch.allclose(TC.transcode(coders[1], x), ref, atol=1e-5)
    # sparsify: its own layout, its own loader
    TC.export_transcoders("here", data / "out-sp", "sparsify")
    coders, _ = read_transcoders(data / "out-sp", "sparsify")
    assert torch.allclose(TC.transcode(coders[1], x), ref, atol=1e-6)
    # SAELens has no TopK transcoder: a sentence, nothing half-written
    with pytest.raises(FeatureError, match="SAELens has no TopK"):
        TC.export_transcoders("here", data / "out-sl", "saelens")
    # a JumpReLU set (from circuit-tracer's files) goes to SAELens and back
    (data / "ct").mkdir()
    c = tc.coders[1]
    pre = x @ c.encoder.weight.detach().mT + c.encoder.bias.detach()
    save_file({"W_enc": c.encoder.weight.detach(), "b_enc": c.encoder.bias.detach(), "W_dec": c.W_dec.detach(),
               "b_dec": c.b_dec.detach(), "activation_function.threshold": pre.quantile(0.9, dim=0).clamp(min=0)},
              str(data / "ct" / "layer_1.safetensors"))
    TC.import_transcoders(data / "ct", model=lm.name, name="jr")
    jr_ref = TC.transcode(TC.load_transcoders("jr").coders[1], x)
    TC.export_transcoders("jr", data / "out-sl", "saelens")
    cfg = json.loads((data / "out-sl" / "layer_1" / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu_transcoder" and cfg["metadata"]["model_name"] == lm.name
    assert load_file(str(data / "out-sl" / "layer_1" / "sae_weights.safetensors"))["W_enc"].shape == (d, F_)
    coders, meta = read_transcoders(data / "out-sl")
    assert meta["format"] == "saelens" and torch.allclose(TC.transcode(coders[1], x), jr_ref, atol=1e-5)


def test_a_graph_on_a_set_with_negative_activations_adds_up(trained, data):
    """circuit-tracer's JumpReLU with thresholds below 0 leaves small negative activations: they are
    nodes of the graph like the positive ones, so completeness and the logit still hold."""
    lm, tc = trained
    src = data / "ct-negative"
    src.mkdir()
    for layer, c in tc.coders.items():
        x = _inputs(lm, layer)
        pre = x @ c.encoder.weight.detach().mT + c.encoder.bias.detach()
        thr = pre.quantile(0.9, dim=0)
        thr[: thr.numel() // 4] = -0.02  # a quarter of the features keep small negative values
        save_file({"W_enc": c.encoder.weight.detach(), "b_enc": c.encoder.bias.detach(), "W_dec": c.W_dec.detach(),
                   "b_dec": c.b_dec.detach(), "W_skip": c.W_skip.detach(), "activation_function.threshold": thr},
                  str(src / f"layer_{layer}.safetensors"))
    TC.import_transcoders(src, model=lm.name, name="negative")
    back = TC.load_transcoders("negative")
    g = AG.attribution_graph(lm, back, PROMPT, max_feature_nodes=128, node_threshold=1.0, edge_threshold=1.0)
    fm = AG.FrozenModel(lm, back, g.prompt_ids, g.target)
    negative = sum(int((fm.leaves.acts[layer] < 0).sum()) for layer in range(lm.shape.n_layers))
    assert negative > 0  # the case holds them; without them among the leaves completeness turns red
    assert g.stats["active_features"] == sum(int((fm.leaves.acts[layer] != 0).sum()) for layer in range(lm.shape.n_layers))
    for name in ("logit", "completeness", "pre_activations", "intervention"):
        assert g.checks[name]["ok"], (name, g.checks[name])


def test_circuit_tracer_reads_layers_by_file_name_and_refuses_a_set_with_gaps(trained, data):
    lm, tc = trained
    c = tc.coders[1]
    src = data / "ct-one"
    src.mkdir()
    save_file({"W_enc": c.encoder.weight.detach(), "b_enc": c.encoder.bias.detach(), "W_dec": c.W_dec.detach(),
               "b_dec": c.b_dec.detach()}, str(src / "layer_1.safetensors"))
    (src / "config.yaml").write_text(yaml.safe_dump({"model_kind": "transcoder_set", "activation": "relu",
                                                     "transcoders": ["layer_1.safetensors"]}))
    coders, _ = read_transcoders(src)
    assert sorted(coders) == [1]  # its file says layer 1, though it is the list's first
    TC.import_transcoders(src, model=lm.name, name="only-1")
    with pytest.raises(FeatureError, match="every layer from 0"):
        TC.export_transcoders("only-1", data / "out-gap", "circuit-tracer")
    assert not (data / "out-gap").exists() or not any((data / "out-gap").iterdir())  # nothing half-written
    broken = data / "ct-broken"
    broken.mkdir()
    save_file({"W_enc": c.encoder.weight.detach()}, str(broken / "layer_0.safetensors"))
    with pytest.raises(FeatureError, match="no W_dec"):
        read_transcoders(broken)
    (broken / "layer_0.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(FeatureError, match="could not be read"):
        read_transcoders(broken)


def test_bad_sets_get_one_sentence(trained, data):
    lm, tc = trained
    with pytest.raises(FeatureError, match="holds no transcoder"):
        read_transcoders(data)
    sae = data / "sae"
    sae.mkdir()
    save_file({"W_enc": torch.zeros(4, 8), "b_enc": torch.zeros(8), "W_dec": torch.zeros(8, 4),
               "b_dec": torch.zeros(4)}, str(sae / "sae_weights.safetensors"))
    (sae / "cfg.json").write_text(json.dumps({"architecture": "standard", "d_in": 4, "d_sae": 8}))
    with pytest.raises(FeatureError, match="not a transcoder"):
        read_transcoders(sae)
    (sae / "cfg.json").write_text(json.dumps({"architecture": "transcoder", "normalize_activations": "expected_average_only_in"}))
    with pytest.raises(FeatureError, match="normalizes its input"):
        read_transcoders(sae)
    hf = data / "hf"
    hf.mkdir()
    (hf / "config.yaml").write_text(yaml.safe_dump({"model_kind": "transcoder_set",
                                                    "transcoders": ["hf://mntss/x/layer_0.safetensors"]}))
    with pytest.raises(FeatureError, match="local files only"):
        read_transcoders(hf)
    # a set of another width than the model: refused when opened against it
    wide = data / "wide"
    wide.mkdir()
    save_file({"W_enc": torch.randn(16, lm.shape.d_model + 1), "b_enc": torch.zeros(16),
               "W_dec": torch.randn(16, lm.shape.d_model + 1), "b_dec": torch.zeros(lm.shape.d_model + 1)},
              str(wide / "layer_0.safetensors"))
    TC.import_transcoders(wide, model=lm.name, name="wide", fmt="circuit-tracer")
    with pytest.raises(FeatureError, match="reads width"):
        TC.load_transcoders("wide").check_model(lm)
    with pytest.raises(FeatureError, match="do not name their model"):
        TC.import_transcoders(wide, name="nameless")
    with pytest.raises(FeatureError, match="shape"):
        DenseTranscoder(torch.zeros(8, 4), torch.zeros(8), torch.zeros(8, 5), torch.zeros(4))
