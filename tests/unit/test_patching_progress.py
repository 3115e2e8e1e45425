"""Issue 15 item 10: a patching sweep reports progress per layer of each batched forward, not only
once per batch (a default sweep on a CPU is a few batches of ~10 s each, and the page sat at 0 %)."""

import torch

from model_core import load_model
from model_core.interp.interventions import Metric, patch_heads, patch_residual


def test_progress_moves_per_layer_inside_one_batch():
    lm = load_model("random-llama-tiny")
    L = lm.shape.n_layers
    clean, corrupt = "Eiffel is in Paris", "Colosse is in Rome"  # byte tokenizer: same length
    m = Metric(target=ord("P"), other=ord("R"), kind="logit_diff")
    seen = []
    one_batch = patch_residual(lm, clean, corrupt, m, batch_size=10_000, progress=seen.append)
    assert one_batch.n_forward == 3  # clean, corrupted, one patched batch
    inside = [f for f in seen if 0 < f < 1]
    assert len(inside) == L - 1, seen  # layer 0 starts at 0; one report as each later layer starts
    assert seen == sorted(seen) and seen[-1] == 1.0
    # the ticks are identity edits: the same sweep without them gives the same numbers
    plain = patch_residual(lm, clean, corrupt, m, batch_size=10_000)
    assert torch.equal(one_batch.values, plain.values)
    heads_seen = []
    patch_heads(lm, clean, corrupt, m, batch_size=10_000, progress=heads_seen.append)
    assert len([f for f in heads_seen if 0 < f < 1]) == L - 1, heads_seen
