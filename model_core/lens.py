"""Logit lens: read each layer's residual stream through the model's final norm and unembedding.

Computed one layer at a time for only the positions asked for: at 512 tokens x 49k vocab a
single layer's logits are 100 MB, so we never hold more than one layer's worth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_core.trace import Trace


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
    tgt = None if targets is None else torch.tensor(targets, device=adapter.unembed.weight.device)
    with torch.inference_mode():
        for l in layers:
            resid = trace.resid_post(l) if point == "resid_post" else trace.resid_mid(l)
            x = resid[positions].to(adapter.final_norm.weight.device)  # split models: the norm's GPU
            logits = adapter.logits_from_resid(x).float()
            logp = torch.log_softmax(logits, dim=-1)
            p = logp.exp()
            tp, ti = p.topk(min(k, p.shape[-1]), dim=-1)
            tops_i.append(ti)
            tops_p.append(tp)
            ents.append(-(p * logp).nan_to_num().sum(-1))
            if tgt is not None:
                lt = logits.gather(-1, tgt[:, None])
                t_probs.append(p.gather(-1, tgt[:, None])[:, 0])
                t_ranks.append((logits > lt).sum(-1))
    res = LensResult(layers=layers, positions=positions, top_ids=torch.stack(tops_i).cpu(),
                     top_probs=torch.stack(tops_p).cpu(), entropy=torch.stack(ents).cpu())
    if tgt is not None:
        res.target_ids = [int(t) for t in targets]
        res.target_probs = torch.stack(t_probs).cpu()
        res.target_ranks = torch.stack(t_ranks).cpu()
    return res
