"""From a Trace to the numbers each Explore view shows (pure functions: Trace in, arrays out).
Only the visible slice is computed and sent: long prompts are shown through a window."""

from __future__ import annotations

import math

import numpy as np
import torch

from model_core.lens import logit_lens
from model_core.sampling import SamplingSettings, apply_sampling
from model_core.trace import Trace

WINDOW = 48  # positions shown in attention heatmaps and residual views
LENS_WINDOW = 12  # positions in the logit-lens grid (each costs 30 rows through the 49k-vocab unembedding)


def window(T: int, end: int, size: int = WINDOW) -> list[int]:
    """`size` positions ending at `end` (inclusive), clipped to the prompt."""
    end = max(0, min(T - 1, end))
    start = max(0, end - size + 1)
    return list(range(start, end + 1))


def labels(tr: Trace) -> list[str]:
    return [t["display"] for t in tr.tokens]


def kv_groups(tr: Trace) -> list[int]:
    s = tr._lm.shape
    group = s.n_heads // s.n_kv_heads
    return [h // group for h in range(s.n_heads)]


def to_np(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def attention_view(tr: Trace, layer: int, head: int, query: int) -> dict:
    pos = window(tr.n_tokens, query)
    sl = slice(pos[0], pos[-1] + 1)
    pattern = tr.attention_pattern(layer)[:, sl, sl]
    row = tr.attention_pattern(layer)[head, query]
    return {"positions": pos, "patterns": to_np(pattern), "row": to_np(row[sl]),
            "outside_mass": float(row[: pos[0]].sum()) if pos[0] > 0 else 0.0}


def head_overview(tr: Trace, metric: str) -> np.ndarray:
    """[L, H] summary of every head, one layer's pattern at a time (nothing big is kept)."""
    out = []
    for l in tr.captured_layers:
        p = tr.attention_pattern(l).float()
        T = p.shape[-1]
        if metric.startswith("entropy"):
            v = -(p * torch.log(p.clamp_min(1e-12))).sum(-1).mean(-1)
        elif metric.startswith("first"):
            v = p[:, 1:, 0].mean(-1) if T > 1 else p[:, :, 0].mean(-1)
        else:  # previous-token score
            v = torch.diagonal(p, offset=-1, dim1=-2, dim2=-1).mean(-1) if T > 1 else torch.zeros(p.shape[0])
        out.append(to_np(v))
    return np.stack(out)


def residual_view(tr: Trace, query: int) -> dict:
    pos = window(tr.n_tokens, query)
    sl = slice(pos[0], pos[-1] + 1)
    rows = [tr.embed[sl].norm(dim=-1)] + [tr.resid_post(l)[sl].norm(dim=-1) for l in tr.captured_layers]
    attn = [float(tr.attn_out[l][query].norm()) for l in tr.captured_layers]
    mlp = [float(tr.mlp_out[l][query].norm()) for l in tr.captured_layers]
    return {"positions": pos, "norms": to_np(torch.stack(rows)), "attn": np.array(attn), "mlp": np.array(mlp)}


def lens_view(tr: Trace, query: int, colour: str = "probability") -> dict:
    pos = window(tr.n_tokens, query, LENS_WINDOW)
    tok = tr._lm.tokenizer
    # target at each position = the actual next prompt token (or the model's own top-1 at the end)
    nxt = tr.token_ids[1:] + [int(torch.argmax(tr.next_logits))]
    # The lens is the costly view (layers x positions rows through the unembedding): cache it
    # per window so slider moves that keep the window reuse it.
    res = tr._cached(("lens", tuple(pos)), lambda: logit_lens(tr, positions=pos, k=1, targets=[nxt[p] for p in pos]))
    top = [[_show(tok, int(i)) for i in row] for row in res.top_ids[:, :, 0]]
    probs = to_np(res.top_probs[:, :, 0])
    col = probs if colour == "probability" else to_np(res.entropy)
    qi = pos.index(query)
    return {"positions": pos, "top": top, "probs": probs, "colour": col, "layers": res.layers,
            "target": _show(tok, nxt[query]), "target_probs": to_np(res.target_probs[:, qi]),
            "target_ranks": to_np(res.target_ranks[:, qi])}


def neuron_view(tr: Trace, layer: int, query: int, n: int = 24) -> dict:
    pos = window(tr.n_tokens, query)
    acts = tr.mlp_post(layer)
    win = acts[pos[0]: pos[-1] + 1]
    ids = torch.topk(win.abs().amax(0), min(n, win.shape[-1])).indices
    at_q = acts[query]
    qids = torch.topk(at_q.abs(), min(16, at_q.shape[-1])).indices
    return {"positions": pos, "acts": to_np(win[:, ids]), "neurons": ids.tolist(),
            "query_values": to_np(at_q[qids]), "query_neurons": qids.tolist()}


def _show(tok, i: int) -> str:
    from model_core.tokenization import display_bytes, token_bytes

    return display_bytes(token_bytes(tok, i))


def next_token_view(tr: Trace, settings: SamplingSettings, k: int = 20) -> dict:
    res = apply_sampling(tr.next_logits, settings, context_ids=tr.token_ids)
    top = torch.topk(res.base_probs, k).indices
    removed_by = []
    for i in top.tolist():
        who = ""
        for st in res.stages:
            if bool(st.removed[i]):
                who = st.name.replace("_", "-")
                break
        removed_by.append(who)
    kept = int((res.probs > 0).sum())
    parts = [f"{st.name.replace('_', '-')} removed {st.n_removed:,} ({1 - st.kept_mass:.1%} of the mass entering it)"
             for st in res.stages[1:] if st.n_removed]
    summary = ("greedy: always the top token" if settings.greedy else
               f"{kept:,} tokens can be drawn" + ("; " + "; ".join(parts) if parts else "; no filter active"))
    tok = tr._lm.tokenizer
    return {"tokens": [_show(tok, i) for i in top.tolist()], "base": to_np(res.base_probs[top]),
            "final": to_np(res.probs[top]), "removed_by": removed_by, "summary": summary,
            "stages": [{"stage": st.name, "removed": st.n_removed, "mass_kept": round(st.kept_mass, 6)}
                       for st in res.stages[1:]]}


def token_table(tr: Trace):
    import pandas as pd

    lp = tr.token_logprobs.float().cpu().tolist()
    return pd.DataFrame({
        "position": range(tr.n_tokens), "id": tr.token_ids, "token": [t["text"] for t in tr.tokens],
        "display": labels(tr), "logprob": lp,
        "surprisal_bits": [(-v / math.log(2)) if v == v else None for v in lp],
    })
