"""Logit lens: read each layer's residual stream through the model's final norm and unembedding.

The unembedding is a [rows, d] x [d, vocab] product, and at 49k vocab the elementwise work on
its output (softmax statistics, top-k, ranks) cost more than the product itself when done over
the whole [rows, vocab] array: it does not fit in cache, so every pass went to memory. So the
vocabulary is walked in blocks that do fit, keeping running statistics per row the way flash
attention keeps its softmax (running max, rescaled sums). Nothing of size rows x vocab is held.

That walk is ~25 torch calls a block and ~50 blocks a pass on a CPU, and every call gives the
interpreter lock up and waits to get it back: beside a thread running plain Python (the server's
figures and pages) one pass took 5.7 s instead of 0.25 s. So the walk (`_vocab_blocks`) runs as
TorchScript, which holds no lock for the whole pass: the same ATen calls in the same order, so the
same numbers (the graph executor's optimizations are off for it).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from model_core.interp.trace import Trace

log = logging.getLogger(__name__)

ROWS = 512  # residual vectors per pass over the vocabulary
BLOCK_BYTES = 1 << 20  # ~1 MB of logits per block: stays in a core's L2 (fastest of 0.5-8 MB here)
MIN_BLOCK = 256  # vocabulary entries per block at least


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


@dataclass
class VocabStats:
    """Softmax statistics of `rows` logit vectors, computed without materialising them."""
    top_ids: torch.Tensor  # [R, k]
    top_probs: torch.Tensor  # [R, k]
    entropy: torch.Tensor  # [R]
    target_probs: torch.Tensor | None  # [R]
    target_ranks: torch.Tensor | None  # [R], number of tokens with a higher logit


def _vocab_blocks(normed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cap: float, k: int,
                  block: int, tgt: torch.Tensor | None, t_logit: torch.Tensor | None,
                  tol: torch.Tensor | None) -> list[torch.Tensor]:
    """vocab_stats' walk over the vocabulary (TorchScript: see the module docstring). normed [R, d],
    weight [V, d] (and bias [V]) of the unembedding, cap: its final softcap (0: none), tgt [R, 1]
    target ids or None, t_logit / tol [R, 1]: each target's logit and rounding bound when the walk
    has several blocks. -> [running max, sum exp, sum exp * logit, top values, top ids, targets'
    logits, logits surely above them, logits at or above their lower bound], each [R, 1] or [R, k]."""
    R, V = normed.shape[0], weight.shape[0]
    dev = normed.device
    m = torch.full((R, 1), float("-inf"), device=dev)  # running max logit
    s = torch.zeros(R, 1, device=dev)  # sum exp(logit - m)
    t = torch.zeros(R, 1, device=dev)  # sum exp(logit - m) * logit   (entropy = lse - t / s)
    top_v = torch.full((R, k), float("-inf"), device=dev)
    top_i = torch.zeros(R, k, dtype=torch.long, device=dev)
    t_self = torch.zeros(R, 1, device=dev)
    above = torch.zeros(R, 1, dtype=torch.long, device=dev)  # logits surely above the target's
    band = torch.zeros(R, 1, dtype=torch.long, device=dev)  # logits at or above its lower bound
    for v0 in range(0, V, block):
        v1 = min(V, v0 + block)
        b = bias
        if b is not None:
            b = b[v0:v1]
        lb = torch.nn.functional.linear(normed, weight[v0:v1], b)  # as Adapter.logits_slice
        if cap != 0.0:
            lb = torch.tanh(lb / cap) * cap
        lb = lb.float()  # [R, b], finite (a linear layer's output)
        if k == 1:
            bv, bi = lb.max(-1, keepdim=True)
            bm = bv
        else:
            bv, bi = lb.topk(min(k, v1 - v0), dim=-1)
            bm = bv[:, :1]
        m_new = torch.maximum(m, bm)
        scale = torch.exp(m - m_new)
        e = torch.exp(lb - m_new)
        s = s * scale + e.sum(-1, keepdim=True)
        t = t * scale + (e * lb).sum(-1, keepdim=True)
        m = m_new
        cv, ci = torch.cat([top_v, bv], -1), torch.cat([top_i, bi + v0], -1)
        top_v, sel = cv.topk(k, dim=-1)
        top_i = ci.gather(-1, sel)
        if tgt is not None:
            inside = (tgt >= v0) & (tgt < v1)
            own = lb.gather(-1, (tgt - v0).clamp(0, v1 - v0 - 1))
            t_self = torch.where(inside, own, t_self)
            if block >= V or t_logit is None or tol is None:  # one block: against its own value, exactly
                above += (lb > own).sum(-1, keepdim=True)
                band += (lb > own).sum(-1, keepdim=True)
            else:
                above += (lb > t_logit + tol).sum(-1, keepdim=True)
                band += (lb >= t_logit - tol).sum(-1, keepdim=True)
    return [m, s, t, top_v, top_i, t_self, above, band]


@functools.cache
def _walk():
    """_vocab_blocks as TorchScript, compiled once (~0.1 s); the Python function where that fails."""
    try:
        return torch.jit.script(_vocab_blocks)
    except Exception as e:  # noqa: BLE001 - the same walk, holding the lock per call
        log.warning("the logit lens runs in Python (%s: %s)", type(e).__name__, str(e)[:200])
        return _vocab_blocks


def vocab_stats(adapter, normed: torch.Tensor, k: int = 1, targets: torch.Tensor | None = None) -> VocabStats:
    """normed [R, d] (after the final norm) -> top-k, entropy and the targets' probability and rank,
    in one pass over the vocabulary in cache-sized blocks. Equal, up to float rounding, to
    softmax(adapter.logits_from_normed(normed)) (tests check it against the whole-vocab result)."""
    R = normed.shape[0]
    V = adapter.unembed.weight.shape[0]
    k = min(k, V)
    # Blocks on the CPU in float32 (cache-bound); on a GPU, or in half precision, one block.
    one_block = normed.device.type != "cpu" or normed.dtype != torch.float32
    block = V if one_block else max(MIN_BLOCK, BLOCK_BYTES // (4 * max(R, 1)))
    tgt = t_logit = tol = None
    if targets is not None:
        tgt = targets.to(normed.device).view(R, 1)
        if block < V:
            # The target's logit comes first (ranks count the logits above it), from a dot product,
            # which rounds differently from the block product: rounding errors add up like a random
            # walk, ~sqrt(K) ulps of sum|x w| (measured on the default model: under 3 ulps; the bound
            # is 8 x sqrt(K)). Logits that close are settled at the end against the block's value.
            t_logit = adapter.logits_at(normed, tgt).float()
            w = adapter.unembed.weight[tgt[:, 0]].float()
            K = normed.shape[-1]
            tol = 8 * K ** 0.5 * 2.0 ** -24 * (normed.abs().float() * w.abs()).sum(-1, keepdim=True)
    u, cap = adapter.unembed, float(adapter.final_logit_softcap() or 0.0)
    with torch.jit.optimized_execution(False):  # this thread only: no pass reorders or fuses a call
        m, s, t, top_v, top_i, t_self, above, band = _walk()(normed, u.weight, u.bias, cap, k, block, tgt, t_logit, tol)
    lse = m + torch.log(s)
    ent = (lse - t / s)[:, 0]
    out = VocabStats(top_ids=top_i, top_probs=torch.exp(top_v - lse), entropy=ent, target_probs=None,
                     target_ranks=None)
    if targets is not None:
        out.target_probs = torch.exp(t_self - lse)[:, 0]
        ranks = above[:, 0].clone()
        near = torch.nonzero((band - above)[:, 0] > 1).flatten()  # another token within the bound
        if near.numel():
            rows = adapter.logits_slice(normed[near], 0, V).float()
            own = rows.gather(-1, tgt[near])  # compared within one product, rounding alike
            ranks[near] = (rows > own).sum(-1)
        out.target_ranks = ranks
    return out


def _rows(trace: Trace, layer: int, positions: list[int], point: str) -> torch.Tensor:
    """resid_post / resid_mid of `layer` at `positions` only: the same additions as Trace.resid_post
    (block input + attention + MLP, in that order, so bit-identical) on the rows asked for, not on
    all T rows (a few positions of a long prompt: most of the time went to adding [T, d] tensors)."""
    pre, attn, mlp = (getattr(trace, n, None) for n in ("resid_pre", "attn_out", "mlp_out"))
    if isinstance(pre, dict) and layer in pre and isinstance(attn, dict) and isinstance(mlp, dict):
        x = pre[layer][positions] + attn[layer][positions]
        return x + mlp[layer][positions] if point == "resid_post" else x
    return (trace.resid_post(layer) if point == "resid_post" else trace.resid_mid(layer))[positions]


def logit_lens(trace: Trace, positions=None, layers=None, k: int = 5, targets=None,
               point: str = "resid_post") -> LensResult:
    """targets: one token id per position (e.g. the next prompt token) whose rank/prob to follow."""
    T = trace.n_tokens
    positions = list(range(T)) if positions is None else [p % T for p in positions]
    layers = trace.captured_layers if layers is None else list(layers)
    adapter = trace.lm.adapter
    norm_dev = adapter.final_norm.weight.device  # split models: the final norm's GPU
    tgt = None if targets is None else torch.tensor(targets, device=adapter.unembed.weight.device)
    P = len(positions)
    per_chunk = max(1, ROWS // max(P, 1))  # several layers per pass over the vocabulary
    parts: list[VocabStats] = []
    with torch.inference_mode():
        for c in range(0, len(layers), per_chunk):
            chunk = layers[c: c + per_chunk]
            resid = torch.cat([_rows(trace, l, positions, point).to(norm_dev) for l in chunk])
            normed = adapter.final_norm(resid).to(adapter.unembed.weight.device)
            parts.append(vocab_stats(adapter, normed, k, None if tgt is None else tgt.repeat(len(chunk))))
    L = len(layers)

    def cat(name, *shape):
        return torch.cat([getattr(p, name) for p in parts]).view(L, P, *shape).cpu()

    res = LensResult(layers=layers, positions=positions, top_ids=cat("top_ids", -1),
                     top_probs=cat("top_probs", -1), entropy=cat("entropy"))
    if tgt is not None:
        res.target_ids = [int(t) for t in targets]
        res.target_probs = cat("target_probs")
        res.target_ranks = cat("target_ranks")
    return res
