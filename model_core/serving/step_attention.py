"""The attention of each generated token's query over its context, recomputed from one traced
forward over the whole sequence (a causal row does not depend on later tokens).
"""

from __future__ import annotations

import torch

from model_core.core.errors import PromptError
from model_core.serving.generation_records import Generation


def attention_rows(lm, token_ids, query_positions, layers=None) -> torch.Tensor:
    """Attention of the given query positions over the sequence, per layer and head:
    [len(query_positions), layers, heads, T] (zeros beyond each query's position).

    With a causal mask a query's attention row does not depend on later tokens, so the row of
    position p in one forward over the whole sequence is exactly what the model computed when
    it produced token p+1 step by step. One traced forward pass (model_core.interp.trace) gives every
    layer's input; each layer's q and k are recomputed with the model's own projections."""
    from model_core.interp.trace import trace

    ids = [int(t) for t in token_ids]
    n_layers = lm.shape.n_layers
    layers = list(range(n_layers)) if layers is None else [int(l) for l in layers]
    qp = torch.tensor([int(p) for p in query_positions], dtype=torch.long)
    if qp.numel() == 0 or int(qp.min()) < 0 or int(qp.max()) >= len(ids):
        raise PromptError("Query positions must lie inside the sequence.")
    tr = trace(lm, token_ids=ids, layers=layers, max_tokens=None)
    ad = lm.adapter
    with torch.inference_mode():
        qp_d = qp.to(tr.device)
        rows = [ad.attention(l, tr.resid_pre[l], tr.rope.get(l), qp_d).probs.permute(1, 0, 2)  # [Q, H, T]
                for l in layers]
    return torch.stack(rows, 1).cpu()  # [Q, L, H, T]


def step_attention(lm, token_ids, step_position: int, layers=None) -> torch.Tensor:
    """[layers, heads, step_position]: the attention that produced the token at step_position
    (the query is the token before it) over the context it saw."""
    if step_position < 1:
        raise PromptError("The first token has no context to attend to.")
    return attention_rows(lm, token_ids[:step_position], [step_position - 1], layers)[0]


def attach_attention(lm, gen: Generation) -> None:
    """Each step's attention over its context (head mean, [layers, context]), from one traced forward."""
    ids = gen.all_ids
    positions = [s.position - 1 for s in gen.steps]
    rows = attention_rows(lm, ids[: max(positions) + 1], positions)  # [Q, L, H, T]
    for s, r in zip(gen.steps, rows):
        s.attention = r.mean(1)[:, : s.position]  # [L, context]
