"""The logit lens against the whole-vocabulary computation with transformers' own modules.

Reference: for every layer and position, softmax(lm_head(norm(resid_post))) with the model's
own final norm and lm_head modules over the full vocabulary at once; the lens walks the
vocabulary in cache-sized blocks with running statistics and must give the same top-k,
probabilities, entropies, and the targets' probabilities and ranks.
"""

import pytest
import torch

from conftest import DEFAULT, RANDOM_MODELS
from model_core import load_model, trace
from model_core.interp.lens import logit_lens

PROMPT = "The animal didn't cross the street because it was too tired"


@pytest.mark.parametrize("name", [DEFAULT, *RANDOM_MODELS])
def test_lens_equals_whole_vocabulary_softmax(name, monkeypatch):
    from model_core.interp import lens as lens_mod

    lm = load_model(name)
    if lm.shape.vocab_size < 4 * lens_mod.MIN_BLOCK:  # tiny vocabularies: force several blocks anyway
        monkeypatch.setattr(lens_mod, "MIN_BLOCK", 16)
        monkeypatch.setattr(lens_mod, "BLOCK_BYTES", 16 * 4)
    tr = trace(lm, PROMPT)
    T = tr.n_tokens
    positions = list(range(max(0, T - 5), T))
    targets = [(tr.token_ids + [0])[p + 1] for p in positions]
    lens = logit_lens(tr, positions=positions, k=3, targets=targets)
    head, norm = lm.model.lm_head, lm.adapter.final_norm
    cap = getattr(lm.model.config, "final_logit_softcapping", None)
    with torch.inference_mode():
        for i, layer in enumerate(tr.captured_layers):
            logits = head(norm(tr.resid_post(layer)[positions])).float()
            if cap:
                logits = torch.tanh(logits / cap) * cap
            p = torch.softmax(logits, -1)
            top_p, top_i = p.topk(3, -1)
            assert torch.equal(lens.top_ids[i], top_i), f"layer {layer}"
            torch.testing.assert_close(lens.top_probs[i], top_p, atol=1e-6, rtol=1e-4)
            ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
            torch.testing.assert_close(lens.entropy[i], ent, atol=1e-4, rtol=1e-4)
            tgt = torch.tensor(targets)
            torch.testing.assert_close(lens.target_probs[i], p[torch.arange(len(positions)), tgt], atol=1e-6,
                                       rtol=1e-4)
            ranks = (logits > logits[torch.arange(len(positions)), tgt][:, None]).sum(-1)
            assert torch.equal(lens.target_ranks[i], ranks), f"layer {layer}"
    # the vocabulary really was walked in several blocks (the merge would go untested otherwise)
    rows = len(positions) * len(tr.captured_layers)
    assert lm.shape.vocab_size > max(lens_mod.MIN_BLOCK, lens_mod.BLOCK_BYTES // (4 * rows))


def test_rank_with_exact_ties_counts_only_higher_logits(monkeypatch):
    """Tokens whose unembedding rows equal the target's tie with it exactly; the rank counts only
    strictly higher logits, as the whole-vocabulary reference does (blocks forced)."""
    from model_core.interp import lens as lens_mod

    lm = load_model("random-llama-tiny")
    monkeypatch.setattr(lens_mod, "MIN_BLOCK", 16)
    monkeypatch.setattr(lens_mod, "BLOCK_BYTES", 16 * 4)
    tr = trace(lm, PROMPT)
    target = tr.token_ids[1]
    W = lm.model.lm_head.weight
    saved = W.detach().clone()
    try:
        with torch.no_grad():
            for j in (3, 77, 200):  # three other tokens become exact copies of the target
                W[j] = W[target]
        lens = logit_lens(tr, positions=[0], k=1, targets=[target])
        with torch.inference_mode():
            for i, layer in enumerate(tr.captured_layers):
                logits = lm.model.lm_head(lm.adapter.final_norm(tr.resid_post(layer)[[0]])).float()[0]
                assert int(lens.target_ranks[i, 0]) == int((logits > logits[target]).sum()), f"layer {layer}"
    finally:
        with torch.no_grad():
            W.copy_(saved)


def test_the_walk_runs_as_torchscript_and_computes_what_its_python_does():
    """The vocabulary walk runs as TorchScript (it holds no interpreter lock while it runs, see
    model_core.interp.lens), not its Python fallback, and gives bit for bit what the same function gives
    run as Python: with and without a softcap, a bias, targets and several blocks."""
    from model_core.interp import lens as lens_mod

    walk = lens_mod._walk()
    assert isinstance(walk, torch.jit.ScriptFunction)
    g = torch.Generator().manual_seed(0)
    normed, weight = torch.randn(12, 16, generator=g), torch.randn(300, 16, generator=g)
    bias, tgt = torch.randn(300, generator=g), torch.randint(0, 300, (12, 1), generator=g)
    t_logit, tol = torch.randn(12, 1, generator=g), torch.full((12, 1), 1e-3)
    for args in [(None, 0.0, 1, 300, None, None, None), (bias, 30.0, 5, 64, tgt, t_logit, tol),
                 (None, 0.0, 3, 300, tgt, None, None)]:
        bias_, cap, k, block, *rest = args
        with torch.jit.optimized_execution(False):
            got = walk(normed, weight, bias_, cap, k, block, *rest)
        want = lens_mod._vocab_blocks(normed, weight, bias_, cap, k, block, *rest)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), args
