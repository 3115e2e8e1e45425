"""The instrumentation hooks under torch.compile (model_core.core.hooks._hook), as the engine's
compiled decode step uses them: its plain step compiles to one graph with no hook in it, and its
edited step runs every request's edits as plain Python between graphs that are the same for any
edits. Reference: the same forward run eagerly (uncompiled) with the same edits."""

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from model_core import load_model
from model_core.core.hooks import instrument
from model_core.core.row_edits import AddVector, ZeroColumns
from model_core.serving.engine_edits import EditSlots
from model_core.serving.engine_step import compiled_forwards, step_hooks


def test_a_compiled_forward_leaves_hooks_out_or_runs_any_edits_between_the_same_graphs():
    lm = load_model("random-llama-tiny")
    instrument(lm.adapter)  # hooks on every layer, as after any trace
    d, n = lm.shape.d_model, lm.shape.n_layers
    g = torch.Generator().manual_seed(0)
    slots = EditSlots(3, lm.dtype, lm.device)
    slots.admit(0, {f"blocks.{n - 1}.hook_resid_pre": AddVector(torch.randn(d, generator=g) * 4)})
    slots.admit(1, {"blocks.0.hook_resid_pre": AddVector(torch.randn(d, generator=g) * 4),
                    "blocks.0.hook_mlp_out": ZeroColumns(d)})
    ids = torch.tensor([[5], [6], [7]])  # [3, 1]: one decode position per row, row 2 plain

    def forward(f, edits, compiled):
        with torch.inference_mode(), step_hooks(lm, compiled, edits):
            return f(input_ids=ids, use_cache=False).logits[:, -1]

    torch._dynamo.reset()
    counters.clear()
    fast, fast_hooks = compiled_forwards(lm.model)
    plain = forward(lm.model, None, False)
    torch.testing.assert_close(forward(fast, None, True), plain, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]  # the hooks left out

    edited_graphs = None
    for rows in ([0], [1], [0, 1]):  # three signatures: the edits at different hooks and layers
        edits = slots.hook_edits(slots.signature(rows))
        eager = forward(lm.model, edits, False)
        out = forward(fast_hooks, edits, True)
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
        for r in range(3):  # each edited row moved, the plain row did not
            moved = not torch.allclose(eager[r], plain[r], atol=1e-3)
            assert moved == (r in rows), (rows, r)
        edited_graphs = edited_graphs or counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == edited_graphs  # no recompile for other edits
    # and the plain step afterwards is the whole graph again, without the edits
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(forward(fast, None, True), plain, atol=1e-5, rtol=1e-5)
