"""Logit lens: read each layer's residual stream through the model's final norm and unembedding.

Computed one layer at a time for only the positions asked for: at 512 tokens x 49k vocab a
single layer's logits are 100 MB, so we never hold more than one layer's worth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_core.trace import Trace

ROWS = 512  # residual vectors per unembedding matmul


@dataclass
class LensResult:
    layers: list[int]
    positions: list[int]
    top_ids: torch.Tensor  # [L, P, k]
    top_probs: torch.Tensor  # [L, P, k]
    entropy: torch.Tensor  # [L, P] in nats
    target_ids: list[int] | None = None
    target_probs: torch.Tensor | None = None  # [L, P]
    target_ranks: torch.Tensor | None = None  # [L, P], 0 = top-1


def logit_lens(trace: Trace, positions=None, layers=None, k: int = 5, targets=None,
               point: str = "resid_post") -> LensResult:
    """targets: one token id per position (e.g. the next prompt token) whose rank/prob to follow."""
    T = trace.n_tokens
    positions = list(range(T)) if positions is None else [p % T for p in positions]
    layers = trace.captured_layers if layers is None else list(layers)
    adapter = trace._lm.adapter
    tops_i, tops_p, ents, t_probs, t_ranks = [], [], [], [], []
    norm_dev = adapter.final_norm.weight.device  # split models: the final norm's GPU
    tgt = None if targets is None else torch.tensor(targets, device=adapter.unembed.weight.device)
    P = len(positions)
    # Several layers per unembedding matmul (one [layers*P, d] x [d, V] product is ~3x faster on
    # CPU than one per layer), bounded to ~ROWS rows so the logits stay around 100 MB.
    per_chunk = max(1, ROWS // max(P, 1))
    with torch.inference_mode():
        for c in range(0, len(layers), per_chunk):
            chunk = layers[c: c + per_chunk]
            resid = torch.cat([(trace.resid_post(l) if point == "resid_post" else trace.resid_mid(l))[positions]
                               .to(norm_dev) for l in chunk])
            logits = adapter.logits_from_resid(resid).float()
            # Few passes over [rows, vocab]: logsumexp, one exp, and entropy H = lse - sum(p * logit).
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            p = torch.exp(logits - lse)
            tv, ti = logits.topk(min(k, logits.shape[-1]), dim=-1)
            tops_i += list(ti.view(len(chunk), P, -1))
            tops_p += list(torch.exp(tv - lse).view(len(chunk), P, -1))
            ents += list((lse[:, 0] - (p * logits).sum(-1)).view(len(chunk), P))
            if tgt is not None:
                t_rep = tgt.repeat(len(chunk))[:, None]
                lt = logits.gather(-1, t_rep)
                t_probs += list(p.gather(-1, t_rep)[:, 0].view(len(chunk), P))
                t_ranks += list((logits > lt).sum(-1).view(len(chunk), P))
    res = LensResult(layers=layers, positions=positions, top_ids=torch.stack(tops_i).cpu(),
                     top_probs=torch.stack(tops_p).cpu(), entropy=torch.stack(ents).cpu())
    if tgt is not None:
        res.target_ids = [int(t) for t in targets]
        res.target_probs = torch.stack(t_probs).cpu()
        res.target_ranks = torch.stack(t_ranks).cpu()
    return res
