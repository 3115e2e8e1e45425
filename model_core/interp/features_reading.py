"""Reading features: which fire at each position of a prompt, every feature's top contexts over a
token stream with a log-binned histogram of all its activations (density), the tokens its decoder
row promotes, and an automatic label.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model_core.interp.features_sae import (
    DEFAULT_BATCH,
    FORMAT,
    FeatureError,
    Features,
    FeaturesCancelled,
    capture,
    sae_encode,
)

TOP_K = 12  # contexts kept per feature


def feature_activations(lm, feats: Features, prompt, *, top: int = 5, chat: bool = False) -> dict:
    """The prompt's tokens and, per position, the `top` features that fire (feature, activation),
    largest first. Position 0 is included (the autoencoder never trained on it: read it with care)."""
    from model_core.core.prompts import prompt_ids
    from model_core.core.tokenization import describe_tokens

    hp = feats.point(lm)
    ids = prompt_ids(lm, prompt, chat=chat)
    x = capture(lm, hp, torch.tensor([ids]))[0]  # [T, d]
    acts, idx = sae_encode(feats.sae, x)
    top = max(1, min(int(top), acts.shape[1]))
    order = torch.argsort(acts, dim=1, descending=True)[:, :top]
    rows = describe_tokens(lm.tokenizer, ids)
    positions = []
    for p in range(len(ids)):
        fs = [{"feature": int(idx[p, j]), "activation": float(acts[p, j])} for j in order[p].tolist()
              if float(acts[p, j]) > 0]
        positions.append({"position": p, "token": rows[p]["display"], "features": fs})
    return {"hook": hp.name, "tokens": [r["display"] for r in rows], "positions": positions}


@dataclass
class FeatureContexts:
    """The k largest activations of every feature over `tokens` ([N, W] windows), each with its place
    as a flat index w * W + p (position 0 of each window skipped)."""

    tokens: torch.Tensor  # [N, W] int64
    vals: torch.Tensor  # [M, K] float32, largest first (-inf: no context)
    idx: torch.Tensor  # [M, K] int64 (-1: none)
    # every activation of the scan, binned: [M, HIST_BINS] counts over log10(activation) in
    # HIST_LOG10 (values beyond fall in the end bins); None in sets saved before it was kept
    hist: torch.Tensor | None = None

    @property
    def window(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def scanned(self) -> int:
        """Tokens the scan read (position 0 of each window skipped)."""
        return int(self.tokens.shape[0]) * (self.window - 1)

    def save(self, path) -> Path:
        from safetensors.torch import save_file

        t = {"tokens": self.tokens.contiguous(), "vals": self.vals.contiguous(), "idx": self.idx.contiguous()}
        if self.hist is not None:
            t["hist"] = self.hist.contiguous()
        save_file(t, str(path), metadata={"format": FORMAT + "-contexts"})
        return Path(path)

    @classmethod
    def load(cls, path) -> FeatureContexts:
        from safetensors.torch import load_file

        return cls(**load_file(str(path)))


HIST_BINS = 48
HIST_LOG10 = (-3.0, 3.0)  # activations from 0.001 to 1000, 8 bins a decade


def hist_edges() -> list[float]:
    """The HIST_BINS + 1 bin edges of FeatureContexts.hist, as activations."""
    lo, hi = HIST_LOG10
    return [10 ** (lo + (hi - lo) * i / HIST_BINS) for i in range(HIST_BINS + 1)]


def _hist_bins(acts: torch.Tensor) -> torch.Tensor:
    """Bin numbers of positive activations (log10 bins of HIST_LOG10, the ends open)."""
    lo, hi = HIST_LOG10
    b = ((torch.log10(acts) - lo) * (HIST_BINS / (hi - lo))).floor()
    return b.clamp(0, HIST_BINS - 1).long()


def density(index: FeatureContexts, feature: int) -> dict:
    """How often a feature fired over the scan: {fired, scanned, density, counts [HIST_BINS], edges},
    or {} for a set saved without the histogram."""
    if index.hist is None:
        return {}
    counts = index.hist[feature]
    fired = int(counts.sum())
    return {"fired": fired, "scanned": index.scanned, "density": fired / max(index.scanned, 1),
            "counts": counts.tolist(), "edges": hist_edges()}


def context_index(lm, feats: Features, windows: torch.Tensor, *, k: int = TOP_K, batch_size: int = DEFAULT_BATCH,
                  should_stop: Callable[[], bool] | None = None) -> FeatureContexts:
    """One pass over `windows` (each batch stops at the hook point) keeping every feature's k
    largest activations and their places. Memory: [M, k + batch x window] values at once."""
    hp = feats.point(lm)
    N, W = windows.shape
    M = feats.num_latents
    k = max(1, min(int(k), N * (W - 1)))
    vals = torch.full((M, k), float("-inf"))
    idx = torch.full((M, k), -1, dtype=torch.int64)
    hist = torch.zeros(M * HIST_BINS, dtype=torch.int64)  # [M * HIST_BINS], viewed [M, HIST_BINS] at the end
    for b0 in range(0, N, batch_size):
        if should_stop is not None and should_stop():
            raise FeaturesCancelled()
        ids = windows[b0:b0 + batch_size]
        acts, top_i = sae_encode(feats.sae, capture(lm, hp, ids))  # [B*W, kk]
        vals, idx = merge_top(vals, idx, hist, acts, top_i, b0, W)
    return finish_contexts(windows, vals, idx, hist)


def merge_top(vals, idx, hist, acts, top_i, b0: int, W: int):
    """One batch's sparse activations ([B*W, kk] values and feature ids, windows from b0) merged
    into every feature's k largest (vals, idx [M, k]) and the histogram (in place)."""
    M, k = vals.shape
    B = acts.shape[0] // W
    acts, top_i = acts.float().cpu(), top_i.cpu()
    fired = acts.view(B, W, -1)[:, 1:] > 0  # [B, W-1, kk]: position 0 skipped, as in the contexts
    a, f = acts.view(B, W, -1)[:, 1:][fired], top_i.view(B, W, -1)[:, 1:][fired]  # [n] each
    hist.index_add_(0, f * HIST_BINS + _hist_bins(a), torch.ones_like(f))
    dense = torch.zeros(B * W, M).scatter_(1, top_i, acts)
    dense.view(B, W, M)[:, 0] = float("-inf")
    dense[dense <= 0] = float("-inf")
    places = b0 * W + torch.arange(B * W)
    v = torch.cat([vals, dense.T], 1)
    i = torch.cat([idx, places.expand(M, -1)], 1)
    t = torch.topk(v, k, dim=1)
    return t.values, torch.gather(i, 1, t.indices)


def finish_contexts(windows: torch.Tensor, vals, idx, hist) -> FeatureContexts:
    idx[~torch.isfinite(vals)] = -1
    return FeatureContexts(tokens=windows.cpu(), vals=vals, idx=idx, hist=hist.view(vals.shape[0], HIST_BINS))


def top_contexts(index: FeatureContexts, tokenizer, feature: int, *, before: int = 16, after: int = 4) -> list[dict]:
    """A feature's top contexts: value, window, position, the tokens around it (byte-safe) and `at`,
    the activating token's place among them."""
    from model_core.core.tokenization import describe_tokens

    M = index.vals.shape[0]
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < M:
        raise FeatureError(f"Feature {feature} is outside this set (0-{M - 1}).")
    out = []
    for v, flat in zip(index.vals[feature].tolist(), index.idx[feature].tolist()):
        if flat < 0 or not math.isfinite(v):
            continue
        w, p = divmod(int(flat), index.window)
        lo, hi = max(0, p - before), min(index.window, p + after + 1)
        ids = index.tokens[w, lo:hi].tolist()
        out.append({"value": float(v), "window": w, "position": p, "at": p - lo, "ids": ids,
                    "tokens": [r["display"] for r in describe_tokens(tokenizer, ids)]})
    return out


def decoder_directions(feats: Features) -> torch.Tensor:
    """[M, d]: what one unit of each feature's activation adds at the hook point (unit norm)."""
    return feats.sae.W_dec.detach().float()


def promoted_tokens(lm, feats: Features, feature: int, k: int = 10) -> dict:
    """{"promoted": [...], "suppressed": [...]}: the feature's decoder row through the final norm's
    gain and the unembedding (model_core.interp.neurons.unembed_direction), the tokens whose logits it
    raises and lowers most per unit of activation (direct effect, before the final norm's scale)."""
    from model_core.interp.neurons import top_tokens, unembed_direction

    feats.point(lm)
    M = feats.num_latents
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < M:
        raise FeatureError(f"Feature {feature} is outside this set (0-{M - 1}).")
    with torch.no_grad():
        logits = unembed_direction(lm, decoder_directions(feats)[feature])
    return top_tokens(lm, logits, k)


def _ngrams(index: FeatureContexts, feature: int, n_max: int = 3) -> Counter:
    """n-grams (1..n_max tokens) ending at the activating token of each top context."""
    c: Counter = Counter()
    for flat in index.idx[feature].tolist():
        if flat < 0:
            continue
        w, p = divmod(int(flat), index.window)
        for n in range(1, n_max + 1):
            if p - n + 1 >= 0:
                c[tuple(index.tokens[w, p - n + 1:p + 1].tolist())] += 1
    return c


def label(lm, feats: Features, index: FeatureContexts, feature: int, promoted: list[int] | None = None) -> dict:
    """An automatic label: the most frequent n-grams ending at the activating token of the top
    contexts (a longer one kept when it is as frequent), and the top promoted tokens."""
    from model_core.core.tokenization import byte_safe_decode, display_bytes, token_bytes

    c = _ngrams(index, feature)

    def dec(ids):  # a context cut inside a character shows its stray bytes as <0xNN>, not "�"
        return byte_safe_decode(lm.tokenizer, ids)

    grams = sorted(c.items(), key=lambda kv: (-kv[1], -len(kv[0])))
    picked: list[tuple] = []
    for g, cnt in grams:
        if cnt < 2 and picked:
            break
        if any(g == q[-len(g):] or q == g[-len(q):] for q, _ in picked):
            continue
        picked.append((g, cnt))
        if len(picked) == 2:
            break
    if promoted is None:
        promoted = [r["id"] for r in promoted_tokens(lm, feats, feature, 3)["promoted"]]
    n_ctx = int((index.idx[feature] >= 0).sum())
    reads = [{"text": dec(list(g)), "count": cnt} for g, cnt in picked]
    writes = [dec([i]) for i in promoted]

    def shown(ids) -> str:  # as every view shows tokens: ␣ for a space, ↵ for a newline, <0xNN> for a stray byte
        return "“" + display_bytes(b"".join(token_bytes(lm.tokenizer, t) for t in ids)) + "”"

    text = ((" / ".join(shown(g) for g, _ in picked) or "(never fires)") + " → "
            + ", ".join(shown([i]) for i in promoted))
    return {"feature": feature, "label": text, "reads": reads, "promotes": writes, "contexts": n_ctx}


def label_all(lm, feats: Features, index: FeatureContexts, chunk: int = 512) -> list[dict]:
    """label() of every feature, the promoted tokens computed in chunks of decoder rows."""
    from model_core.interp.neurons import unembed_direction

    W = decoder_directions(feats)
    out = []
    for c0 in range(0, W.shape[0], chunk):
        with torch.no_grad():
            logits = unembed_direction(lm, W[c0:c0 + chunk].to(lm.device))
            top = torch.topk(logits, 3, dim=1).indices.cpu().tolist()
        for j, ids in enumerate(top):
            out.append(label(lm, feats, index, c0 + j, promoted=ids))
    return out
