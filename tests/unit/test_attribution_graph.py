"""Attribution graphs on transcoders, mechanics on random-weight models (Llama and GPT-2 families):
the frozen replacement model's logit equals transformers' own logit for the prompt, every computed
row is complete (input edges + bias = value), an ablation in the frozen model moves the logit by
the edge; and each check turns red when the frozen model is wrong (error nodes dropped, attention
left free). The transcoders round-trip through sparsify's own loader (its on-disk layout)."""

from __future__ import annotations

import pytest
import torch

from model_core import load_model
from model_core.interp import attribution_graph as AG
from model_core.interp import transcoders as TC
from model_core.interp.features_sae import FeatureError

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module", params=["random-llama-tiny", "random-gpt2-tiny"])
def setup(request):
    lm = load_model(request.param)
    run = TC.train_transcoders(lm.name, max_tokens=2048, context=32, batch_size=8, k=8, eval_tokens=256,
                               save=False)
    run.transcoders.name = "tiny"
    return lm, run


def _transformers_logits(lm, ids):
    """transformers' own forward, no lmscope recorder active."""
    with torch.no_grad():
        return lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()


def test_transcoders_report_quality_for_every_layer(setup):
    lm, run = setup
    q = run.record["quality"]
    assert sorted(q["per_layer"]) == [str(i) for i in range(lm.shape.n_layers)]
    assert all(v["explained"] is not None and v["explained"] < 1 for v in q["per_layer"].values())
    assert 0 <= q["top1_agreement"] <= 1 and q["ce_replaced"] > 0
    assert run.record["steps"] == 8  # 2048 tokens in windows of 32, 8 per step


def test_graph_checks_pass_and_the_logit_is_transformers_own(setup):
    lm, run = setup
    g = AG.attribution_graph(lm, run.transcoders, PROMPT, max_feature_nodes=20000, batch=64)
    ids = lm.tokenizer(PROMPT)["input_ids"]
    ref = _transformers_logits(lm, ids)
    assert g.target == int(ref.argmax())  # default target: the model's top next token
    assert abs(g.checks["logit"]["frozen"] - float(ref[g.target])) <= 1e-4 * max(1.0, abs(float(ref[g.target])))
    for name in ("logit", "completeness", "pre_activations", "intervention"):
        assert g.checks[name]["ok"], (name, g.checks[name])
    # no cap: every feature with a path to the logit got a row, so completeness covered them all
    assert g.checks["completeness"]["rows"] == g.stats["features_reaching_logit"] + 1 == g.stats["rows_computed"]
    assert 0 < g.stats["features_reaching_logit"] <= g.stats["active_features"]
    kinds = {n.kind for n in g.nodes}
    assert "logit" in kinds and "embedding" in kinds
    ids_in = {n.id for n in g.nodes}
    assert all(s in ids_in and t in ids_in for s, t, _ in g.edges)
    assert all(t != s for s, t, _ in g.edges)


def test_a_named_target_and_the_logit_difference_of_the_ablation(setup):
    lm, run = setup
    ids = lm.tokenizer(PROMPT)["input_ids"]
    ref = _transformers_logits(lm, ids)
    second = int(ref.topk(2).indices[1])
    g = AG.attribution_graph(lm, run.transcoders, PROMPT, second, max_feature_nodes=64)
    assert g.target == second and abs(g.checks["logit"]["frozen"] - float(ref[second])) < 1e-3
    iv = g.checks["intervention"]
    assert iv["ok"] and abs(iv["frozen_change"] - iv["edge_predicted"]) <= iv["tolerance"]


def test_the_checks_turn_red_when_the_frozen_model_is_wrong(setup, monkeypatch):
    lm, run = setup
    ids = lm.tokenizer(PROMPT)["input_ids"]
    fm = AG.FrozenModel(lm, run.transcoders, ids, int(_transformers_logits(lm, ids).argmax()))
    # error nodes dropped: the frozen model no longer computes the real logit
    dropped = fm.leaves.scaled(1.0)
    dropped.errs = {k: torch.zeros_like(v) for k, v in dropped.errs.items()}
    with torch.no_grad():
        logit, _ = fm.forward(dropped)
    assert abs(float(logit) - fm.model_logit) > 1e-3

    # attention left free (the pattern recomputed from the edited stream): no longer affine, so the
    # edges no longer add up to the value
    real_forward = AG.FrozenModel.forward

    def free_attention(self, leaves):
        saved = dict(self.patterns)
        ad = self.lm.adapter
        resid = leaves.emb
        for layer in range(self.L):
            self.patterns[layer] = ad.attend(layer, self.attn_norm[layer](resid), self.rope[layer]).probs.float()
            break  # layer 0 is enough to make the map non-linear
        try:
            return real_forward(self, leaves)
        finally:
            self.patterns.update(saved)

    monkeypatch.setattr(AG.FrozenModel, "forward", free_attention)
    g = AG.attribution_graph(lm, run.transcoders, PROMPT, max_feature_nodes=64)
    assert not g.checks["completeness"]["ok"], g.checks["completeness"]


def test_bad_input_is_one_sentence(setup):
    lm, run = setup
    with pytest.raises(FeatureError, match="one token"):
        AG.attribution_graph(lm, run.transcoders, PROMPT, "a target of several tokens")
    with pytest.raises(FeatureError, match="'node_threshold' must be"):
        AG.attribution_graph(lm, run.transcoders, PROMPT, node_threshold=1.5)
    with pytest.raises(FeatureError, match="up to"):
        AG.attribution_graph(lm, run.transcoders, " word" * (AG.MAX_PROMPT_TOKENS + 5))
    other = TC.Transcoders(coders=run.transcoders.coders, model="some-other-model", name="elsewhere")
    with pytest.raises(FeatureError, match="was trained on some-other-model"):
        AG.attribution_graph(lm, other, PROMPT)
    partial = TC.Transcoders(coders={0: run.transcoders.coders[0]}, model=lm.name, name="one-layer")
    with pytest.raises(FeatureError, match="a transcoder for every layer"):
        AG.attribution_graph(lm, partial, PROMPT)


def test_saved_sets_open_with_sparsify_own_loader(setup, tmp_path, monkeypatch):
    from sparsify import SparseCoder

    from model_core.core import paths

    lm, run = setup
    monkeypatch.setattr(paths, "data_dir", lambda: tmp_path)
    tc = run.transcoders
    TC.save_transcoders(tc, "round-trip")
    many = SparseCoder.load_many(str(tmp_path / "transcoders" / "round-trip"), local=True)
    assert sorted(many) == [TC.hookpoint(i) for i in range(lm.shape.n_layers)]
    back = TC.load_transcoders("round-trip")
    x = torch.randn(5, lm.shape.d_model)
    for layer, coder in tc.coders.items():
        assert many[TC.hookpoint(layer)].cfg.transcode
        assert torch.equal(TC.transcode(back.coders[layer], x), TC.transcode(coder, x))
    with pytest.raises(FeatureError, match="no transcoder set named"):
        TC.load_transcoders("missing")
    with pytest.raises(FeatureError, match="is not a transcoder set name"):
        TC.load_transcoders("../etc")


def test_neuronpedia_layout(setup):
    """The export in the layout of Neuronpedia's graph viewer (circuit-tracer's frontend models:
    metadata, qParams, nodes with node_id / jsNodeId / layer / ctx_idx / feature_type, links)."""
    from model_core.interp.attribution_export import neuronpedia_json

    lm, run = setup
    g = AG.attribution_graph(lm, run.transcoders, PROMPT, max_feature_nodes=64, node_threshold=1.0)
    feats = [n.id for n in g.nodes if n.kind == "feature"][:3]
    out = neuronpedia_json(g, lm.shape.n_layers, pinned=feats, supernodes=[["group", *feats]])
    assert set(out) == {"metadata", "qParams", "nodes", "links"}
    assert out["metadata"]["scan"] == lm.name and out["metadata"]["prompt_tokens"] == g.prompt_tokens
    nodes = out["nodes"]
    node_ids = [n["node_id"] for n in nodes]
    assert len(set(node_ids)) == len(nodes) == len(g.nodes)
    # jsNodeId as circuit-tracer writes it: a feature's is per (layer, feature), whatever the position
    assert all(n["jsNodeId"] == f"{n['layer']}_{n['node_id'].split('_')[1]}-0" for n in nodes
               if n["feature_type"] == "cross layer transcoder")
    assert {(link["source"], link["target"]) for link in out["links"]} <= {(a, b) for a in node_ids for b in node_ids}
    assert len(out["links"]) == len(g.edges)
    [logit] = [n for n in nodes if n["is_target_logit"]]
    assert logit["feature_type"] == "logit" and logit["feature"] == g.target
    assert logit["layer"] == str(lm.shape.n_layers + 1) and abs(logit["token_prob"] - g.target_prob) < 1e-9
    kinds = {n["feature_type"] for n in nodes}
    assert kinds <= {"cross layer transcoder", "mlp reconstruction error", "embedding", "logit"}
    emb = [n for n in nodes if n["feature_type"] == "embedding"]
    ids = lm.tokenizer(PROMPT)["input_ids"]
    assert all(n["node_id"] == f"E_{ids[n['ctx_idx']]}_{n['ctx_idx']}" for n in emb)
    assert out["qParams"]["pinnedIds"] == [f"{n.layer}_{n.feature}_{n.position}" for n in g.nodes if n.id in feats]
    assert out["qParams"]["supernodes"][0][0] == "group" and len(out["qParams"]["supernodes"][0]) == len(feats) + 1


def test_qk_attribution_sums_to_the_models_score_and_turns_red_without_a_term(setup, monkeypatch):
    """QK attribution: the query-key pairs' contributions add up to the model's own pre-softmax score
    (adapter.attend on the real forward); leaving out one residual term breaks the sum."""
    from model_core.interp import qk_attribution as QK

    lm, run = setup
    ids = lm.tokenizer(PROMPT)["input_ids"]
    fm = AG.FrozenModel(lm, run.transcoders, ids, int(_transformers_logits(lm, ids).argmax()))
    layer, head, q, k = lm.shape.n_layers - 1, lm.shape.n_heads - 1, len(ids) - 1, 2
    r = QK.qk_attribution(fm, layer, head, q, k)
    assert r.check["ok"], r.check
    assert abs(sum(c for _, c in QK.qk_attribution(fm, layer, head, q, k, top=10_000).query_terms) - r.score) < 1e-3
    assert any(t.startswith(f"F0.{q}.") for t, _ in QK.qk_attribution(fm, layer, head, q, k, top=10_000).query_terms)
    assert 0 < r.pattern < 1
    with pytest.raises(FeatureError, match="must not come after"):
        QK.qk_attribution(fm, layer, head, 1, 2)
    with pytest.raises(FeatureError, match="The head must be"):
        QK.qk_attribution(fm, layer, lm.shape.n_heads, q, k)

    real = QK.residual_terms

    def one_term_short(*a):  # the largest term left out (the last one, a decoder bias, can be below tolerance)
        labels, vecs = real(*a)
        i = int(vecs.norm(dim=1).argmax())
        keep = [j for j in range(len(labels)) if j != i]
        return [labels[j] for j in keep], vecs[keep]

    monkeypatch.setattr(QK, "residual_terms", one_term_short)
    assert not QK.qk_attribution(fm, layer, head, q, k).check["ok"]


def test_interventions_chosen_on_the_graph(setup):
    """Ablating a feature node in the real model: the target's change equals the graph's own
    intervention check's real-model change for that node; scale 1 changes nothing; only feature
    nodes of this graph are taken."""
    from model_core.interp import graph_interventions as GI

    lm, run = setup
    g = AG.attribution_graph(lm, run.transcoders, PROMPT, max_feature_nodes=64)
    nodes = {n.id: n.to_dict() for n in g.nodes}
    iv = g.checks["intervention"]
    if iv["node"] not in nodes:  # the checked node may be pruned from the drawn graph
        layer, pos, f = (int(x) for x in iv["node"][1:].split("."))
        acts = AG.FrozenModel(lm, run.transcoders, g.prompt_ids, g.target).leaves.acts[layer]
        nodes[iv["node"]] = {"value": float(acts[pos, f])}
    chosen = GI.parse_feature_nodes([iv["node"]], nodes)
    r = GI.intervene(lm, run.transcoders, g.prompt_ids, chosen, target=g.target, new_tokens=4)
    assert abs(r["target_logit_change"] - iv["real_model_change"]) < 1e-4
    same = GI.intervene(lm, run.transcoders, g.prompt_ids, chosen, scale=1.0, target=g.target, new_tokens=4)
    assert same["kl"] == 0 and same["target_logit_change"] == 0
    assert same["continuation"]["before"] == same["continuation"]["after"]
    with pytest.raises(FeatureError, match="not a feature node of this graph"):
        GI.parse_feature_nodes(["T0"], nodes)
    with pytest.raises(FeatureError, match="Choose one or more"):
        GI.parse_feature_nodes([], nodes)


def test_a_non_latin_prompt_reads_as_the_views_show_it(setup):
    """Byte-level tokens that hold part of a character decode to "\ufffd" one by one (transformers'
    decode, the reference here); the graph's display, its nodes' tokens and its target read as
    tokenization.describe_tokens shows them in every other view (whole characters, "東·1/3")."""
    from model_core.core.tokenization import describe_tokens

    lm, run = setup
    prompt = "東京は日本の首都で、人口は🍕"
    g = AG.attribution_graph(lm, run.transcoders, prompt, max_feature_nodes=200, batch=64)
    assert any("\ufffd" in t for t in g.prompt_tokens)  # the case: the plain decode cannot show them
    want = [r["display"] for r in describe_tokens(lm.tokenizer, g.prompt_ids + [g.target])]
    assert g.prompt_display == want[:-1] and g.target_display == want[-1]
    assert not any("\ufffd" in t for t in [*g.prompt_display, g.target_display, *(n.token for n in g.nodes)])
    assert {n.token for n in g.nodes if n.kind != "logit"} <= set(g.prompt_display)
    d = g.to_dict()
    assert d["prompt_display"] == g.prompt_display and d["target_display"] == g.target_display
    # the export's prompt is the prompt's own text (transformers' decode of all its ids at once), where
    # joining each token's decode would give "\ufffd"s
    from model_core.interp.attribution_export import neuronpedia_json

    text = lm.tokenizer.decode(g.prompt_ids)
    assert "🍕" in text and "".join(g.prompt_tokens) != text
    assert neuronpedia_json(g, lm.shape.n_layers)["metadata"]["prompt"] == text == d["prompt_text"]
