"""Head search over a corpus: every head of a model scored on many prompts, so that the heads worth
opening (previous-token, duplicate-token, induction, attention-sink heads) stand out with their
spread across prompts, and each is a click away from the prompts where it scored highest.

Scores of one head on one prompt, from its attention pattern p [T, T] (row i: where query i looks)
and the prompt's token ids:

  previous_token   mean over i >= 1 of p[i, i-1]
  first_token      mean over i >= 1 of p[i, 0] (the attention sink / BOS mass)
  entropy          mean over i of -sum_j p[i, j] log p[i, j] (nats)
  duplicate_token  mean over the queries i whose token occurred before of sum_{j < i, id_j = id_i} p[i, j]
  induction        mean over the same queries of sum_{j + 1 < i, id_j = id_i} p[i, j + 1]: the
                   token after an earlier occurrence of the current one (what an induction head
                   copies from); NaN on a prompt with no repeated token

The standard induction test (`induction_on_repeats`): random tokens r (length S) repeated, r r; on the
second copy, query i's induction target is i - S + 1. A head that only ever attends to the previous
token scores 1 on previous_token and 0 on induction there (S > 2).

Shapes: patterns [H, T, T]; per-prompt scores [L, H]; a search's arrays [N, L, H].
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from model_core.core.errors import LmscopeError
from model_core.interp.trace import trace

METRICS = ("previous_token", "duplicate_token", "induction", "first_token", "entropy")
MAX_PROMPTS = 512
MAX_TOKENS = 256
TOP_PROMPTS = 3


class HeadSearchError(LmscopeError):
    """A bad setting of a head search: one sentence."""


def pattern_scores(p: torch.Tensor, ids: list[int]) -> dict[str, torch.Tensor]:
    """p [H, T, T] (rows sum to 1), ids [T] -> {metric: [H]} (module docstring)."""
    p = p.float()
    H, T, _ = p.shape
    out = {"entropy": -(p * torch.log(p.clamp_min(1e-12))).sum(-1).mean(-1)}
    if T < 2:
        nan = torch.full((H,), math.nan)
        return {**out, "previous_token": nan, "first_token": nan, "duplicate_token": nan, "induction": nan}
    out["previous_token"] = torch.diagonal(p, offset=-1, dim1=-2, dim2=-1).mean(-1)
    out["first_token"] = p[:, 1:, 0].mean(-1)
    t = torch.as_tensor(ids)
    same = (t[:, None] == t[None, :]).tril(-1)  # [T, T]: j < i with the same token as i
    queries = same.any(-1)  # [T]: queries whose token occurred before
    if not queries.any():
        nan = torch.full((H,), math.nan)
        return {**out, "duplicate_token": nan, "induction": nan}
    out["duplicate_token"] = (p * same).sum(-1)[:, queries].mean(-1)
    # the position after each earlier occurrence: mask shifted one column right, kept below the diagonal
    nxt = torch.zeros_like(same)
    nxt[:, 1:] = same[:, :-1]
    nxt = nxt.tril(-1)
    out["induction"] = (p * nxt).sum(-1)[:, queries].mean(-1)
    return out


def prompt_scores(lm, ids: list[int]) -> dict[str, torch.Tensor]:
    """{metric: [L, H]} of every head on one prompt (one traced forward)."""
    tr = trace(lm, token_ids=ids, max_tokens=None)
    rows = [pattern_scores(tr.attention_pattern(layer), ids) for layer in tr.captured_layers]
    return {m: torch.stack([r[m] for r in rows]) for m in METRICS}


def repeated_random(lm, length: int, seed: int = 0) -> list[int]:
    """[bos?] + r + r with r `length` random ordinary tokens (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    special = set(lm.tokenizer.all_special_ids)
    vocab = lm.tokenizer.vocab_size
    r: list[int] = []
    while len(r) < length:
        t = int(torch.randint(vocab, (1,), generator=g))
        if t not in special:
            r.append(t)
    bos = [lm.tokenizer.bos_token_id] if lm.tokenizer.bos_token_id is not None else []
    return bos + r + r


def induction_on_repeats(lm, length: int = 32, n: int = 4, seed: int = 0) -> torch.Tensor:
    """[L, H] mean attention from each query of the second copy to its induction target (i - S + 1),
    over n repeated random sequences (the standard induction-head test)."""
    if not 3 <= length <= MAX_TOKENS // 2:
        raise HeadSearchError(f"The repeated sequence length must be from 3 to {MAX_TOKENS // 2}.")
    out = []
    for k in range(n):
        ids = repeated_random(lm, length, seed + k)
        off = len(ids) - 2 * length  # 1 with a BOS, else 0
        tr = trace(lm, token_ids=ids, max_tokens=None)
        q = torch.arange(off + length + 1, len(ids))  # second copy, from its second token
        per_layer = [tr.attention_pattern(layer).float()[:, q, q - length + 1].mean(-1) for layer in tr.captured_layers]
        out.append(torch.stack(per_layer))  # [L, H]
    return torch.stack(out).mean(0)


def check_settings(n_prompts, max_tokens) -> tuple[int, int]:
    def whole(v, what, lo, hi):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or int(v) != v or not lo <= v <= hi:
            raise HeadSearchError(f"The {what} must be a whole number from {lo} to {hi}.")
        return int(v)
    return whole(n_prompts, "number of prompts", 1, MAX_PROMPTS), whole(max_tokens, "tokens per prompt", 8, MAX_TOKENS)


def search_heads(lm, texts: list[str], n_prompts: int = 64, max_tokens: int = 128, *, repeat_length: int = 32,
                 progress: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> dict:
    """Score every head on the first n_prompts texts (each cut to max_tokens tokens; texts of fewer
    than 8 tokens skipped) and on repeated random sequences. Returns a JSON-able dict:
      prompts      [{text, n_tokens}]
      metrics      {metric: {"mean": [L][H], "std": [L][H], "top": [L][H][TOP_PROMPTS] prompt indices}}
                   (mean / std over the prompts where the score is defined; top: highest first)
      induction_repeated  [L][H] (induction_on_repeats)
      settings     {n_prompts, max_tokens, repeat_length, model}
    """
    n_prompts, max_tokens = check_settings(n_prompts, max_tokens)
    tok = lm.tokenizer
    prompts, scores = [], {m: [] for m in METRICS}
    for text in texts:
        if len(prompts) >= n_prompts:
            break
        ids = tok(text, add_special_tokens=True)["input_ids"][:max_tokens]
        if len(ids) < 8:
            continue
        if should_stop is not None and should_stop():
            raise HeadSearchError("The head search was cancelled.")
        s = prompt_scores(lm, ids)
        for m in METRICS:
            scores[m].append(s[m])
        prompts.append({"text": tok.decode(ids, skip_special_tokens=True), "n_tokens": len(ids)})
        if progress is not None:
            progress(len(prompts), n_prompts)
    if not prompts:
        raise HeadSearchError("None of the texts has 8 tokens or more.")
    metrics = {}
    for m in METRICS:
        a = torch.stack(scores[m])  # [N, L, H]
        ok = ~torch.isnan(a)
        cnt = ok.sum(0).clamp_min(1)
        mean = torch.where(ok, a, 0).sum(0) / cnt
        var = (torch.where(ok, a - mean, 0) ** 2).sum(0) / cnt
        mean = torch.where(ok.any(0), mean, torch.nan)
        top = torch.where(ok, a, -math.inf).topk(min(TOP_PROMPTS, a.shape[0]), dim=0).indices  # [k, L, H]
        metrics[m] = {"mean": _nan_list(mean), "std": _nan_list(var.sqrt()), "top": top.permute(1, 2, 0).tolist()}
    return {"prompts": prompts, "metrics": metrics,
            "induction_repeated": induction_on_repeats(lm, repeat_length).tolist(),
            "settings": {"n_prompts": len(prompts), "max_tokens": max_tokens, "repeat_length": repeat_length,
                         "model": lm.name}}


def _nan_list(x: torch.Tensor) -> list:
    """A [L, H] tensor as lists, NaN as None (JSON has no NaN)."""
    return [[None if v != v else float(v) for v in row] for row in x.tolist()]
