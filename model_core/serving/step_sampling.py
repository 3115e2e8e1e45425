"""One step of sampling and recording, all on the device: the sampling pipeline of
`model_core.core.sampling` (repetition penalty, temperature, top-k, top-p, min-p: the same stage
functions, hence the same arithmetic, as transformers' logits processors), then a greedy pick or a
seeded draw, and everything recorded about the step packed in one tensor (the layout
`generation_records._unpack` reads).
"""

from __future__ import annotations

import torch

from model_core.core import sampling as S
from model_core.core.sampling import SamplingSettings
from model_core.serving.batch_sampling import counter_uniform
from model_core.serving.generation_records import STAGE_CODES, TOP_K_RECORDED


def sample_step(logits: torch.Tensor, settings: SamplingSettings, context_ids: torch.Tensor | None,
                draw: tuple[int, int], k: int = TOP_K_RECORDED, generated_ids: torch.Tensor | None = None):
    """logits [V] float32 on the device -> (chosen id tensor [1], packed record tensor, final logits).

    The stages are sampling.py's functions (the arithmetic of transformers' processors), in
    generate()'s order. Everything recorded is packed in one float32 tensor so the caller copies
    once per step. Ids are exact in float32 up to 2^24 (16.7M-token vocabularies).
    context_ids: prompt and generated tokens (the repetition penalty); generated_ids: the generated
    ones alone (the presence and frequency penalties)."""
    raw = logits
    cur = S.repetition_penalty(raw, context_ids, settings.repetition_penalty)
    cur = S.presence_frequency_penalty(cur, generated_ids, settings.presence_penalty, settings.frequency_penalty)
    # Per filter: (code, logits before, logits after). What it removed is derived cheaply: the
    # kept mass is exp(logsumexp(after) - logsumexp(before)), the count is the drop in finite
    # logits, and "which of the top candidates" is a gather of 2 x k values.
    filters: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def filt(name, new):
        nonlocal cur
        filters.append((STAGE_CODES[name], cur, new))
        cur = new

    if settings.greedy:
        keep = torch.zeros_like(cur, dtype=torch.bool)
        keep[torch.argmax(cur)] = True
        filt("greedy", cur.masked_fill(~keep, S.FILTER_VALUE))
    else:
        cur = S.temperature(cur, settings.temperature)
        if settings.top_k > 0:
            filt("top_k", S.top_k(cur, settings.top_k))
        if settings.top_p < 1.0:
            filt("top_p", S.top_p(cur, settings.top_p))
        if settings.min_p > 0:
            filt("min_p", S.min_p(cur, settings.min_p))
    probs = torch.softmax(cur, -1)
    if settings.greedy:
        chosen = torch.argmax(cur).reshape(1)
    else:
        # the engine's draw (row_sampling): Gumbel-max over uniforms hashed from (seed, step, token),
        # so a seed draws the same tokens on either path, alone or batched
        seed, step = (torch.tensor([v], device=cur.device) for v in draw)
        u = counter_uniform(seed, step, cur.shape[-1])[0]
        chosen = torch.argmax(cur - torch.log(-torch.log(u))).reshape(1)

    base = torch.softmax(raw, -1)
    k = min(k, raw.numel())
    top_p_, top_i = torch.topk(base, k)
    aft_p, aft_i = torch.topk(probs, k)
    zero = torch.zeros((), device=raw.device)
    removed_by = torch.zeros(k, device=raw.device)
    for code, before, after in reversed(filters):  # the earliest stage that removed a candidate wins
        gone = torch.isneginf(after[top_i]) & ~torch.isneginf(before[top_i])
        removed_by = torch.where(gone, torch.full_like(removed_by, code), removed_by)
    # Each filter's input is the previous one's output: one count and one logsumexp per link of
    # the chain (plain lists, no memo keyed on object ids, so torch.compile can trace it).
    chain = [filters[0][1], *(f[2] for f in filters)] if filters else [cur]
    finite = [(t > S.FILTER_VALUE).sum().float() for t in chain]
    lses = [torch.logsumexp(t, -1) for t in chain]
    n_removed = {code: finite[j] - finite[j + 1] for j, (code, _, _) in enumerate(filters)}
    kept = {code: torch.exp(lses[j + 1] - lses[j]) for j, (code, _, _) in enumerate(filters)}
    n_removed_l = [n_removed.get(c, zero) for c in (1, 2, 3, 4)]
    kept_l = [kept.get(c, zero + 1) for c in (1, 2, 3, 4)]
    raw_c = raw[chosen]
    rank = (raw > raw_c).sum().float() + 1
    lse_raw = torch.logsumexp(raw, -1)
    lse_cur = lses[-1] if filters else torch.logsumexp(cur, -1)
    head = torch.stack([
        chosen[0].float(), rank, base[chosen][0], probs[chosen][0],
        # entropy H = logsumexp(x) - sum(p * x) (cheaper than summing -p log p over the vocabulary)
        lse_raw - (base * raw).sum(), lse_cur - (probs * cur.nan_to_num(neginf=0.0)).sum(),
        (probs > 0).sum().float(),
        *n_removed_l, *kept_l,
    ])
    packed = torch.cat([head, top_i.float(), top_p_, removed_by, aft_i.float(), aft_p])
    return chosen, packed, cur
