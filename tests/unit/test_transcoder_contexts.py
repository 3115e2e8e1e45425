"""Top contexts and labels of transcoder features (model_core.interp.transcoder_contexts), saved with
a trained set on a random-weight Llama: each kept context's value is the feature's activation
recomputed at that place from the window's own forward (sparsify's encoder on the MLP input), the
values come largest first, and every feature has a label."""

from __future__ import annotations

import torch

from model_core import load_model
from model_core.core import paths
from model_core.interp import transcoders as TC


def test_a_trained_set_keeps_each_features_top_contexts_and_label(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "data_dir", lambda: tmp_path)
    lm = load_model("random-llama-tiny")
    TC.train_transcoders(lm.name, max_tokens=1024, context=32, batch_size=8, k=8, eval_tokens=256, name="ctx")
    tc = TC.load_transcoders("ctx")
    layer = tc.layers[-1]
    assert len(tc.labels[layer]) == tc.coders[layer].num_latents and all("→" in t for t in tc.labels[layer])
    index = tc.feature_contexts(layer)
    assert index is not None and index.tokens.shape == (8, 32)
    fired = [f for f in range(index.vals.shape[0]) if index.idx[f, 0] >= 0]
    assert fired, "no feature fired on the held-out windows"
    checked = 0
    for f in fired[:20]:
        vals = index.vals[f][index.idx[f] >= 0]
        assert torch.all(vals[:-1] >= vals[1:])  # largest first
        w, p = divmod(int(index.idx[f, 0]), index.window)
        assert p >= 1  # position 0 (the attention sink) is never a context
        x = TC.mlp_pairs(lm, index.tokens[w:w + 1], [layer])[layer][0][0]  # [W, d]
        acts, idx = TC.encode(tc.coders[layer], x[p:p + 1])
        recomputed = float(acts[0][idx[0] == f].sum())
        assert abs(recomputed - float(index.vals[f, 0])) <= 1e-4 * max(1.0, recomputed)
        checked += 1
    assert checked >= 1
