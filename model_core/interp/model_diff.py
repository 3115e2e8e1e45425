"""What fine-tuning changed: a model against its base, on one prompt or over a corpus.

On a prompt (`diff_prompt`), per position: KL(base || tuned) of the next-token distributions, the
tokens that gained and lost the most probability, how far the residual streams are apart after the
embeddings and after each layer (the norm of the difference over the base's norm), the first layer
where they part, and the logit lens of each model. Per head: the Jensen-Shannon distance between the
two models' attention rows, averaged over queries.

Over a corpus (`diff_corpus`): the same per window of text, reduced to what a person scans first:
the contexts with the largest KL ranked, KL summed by the token that follows, the mean residual
difference per layer and the layer x head map of attention change.

The two models must share a tokenizer (a fine-tuned model and its parent); one that only added
tokens is compared on the shared vocabulary, and the result says so. KL is computed in float64 from
the models' own logits, so a model against itself gives exactly 0.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from model_core.core.errors import LmscopeError, SettingsError

log = logging.getLogger(__name__)

PART_THRESHOLD = 0.05  # residual streams "part" where the difference reaches 5% of the base's norm
TOP_TOKENS = 5  # gained / lost tokens per position
TOP_CONTEXTS = 25
CONTEXT_TOKENS = 32  # tokens of text shown before a ranked position


@dataclass
class PromptDiff:
    base: str
    tuned: str
    tokens: list[str]  # [T] the prompt's tokens as displayed
    kl: list[float]  # [T] KL(base || tuned) of the next-token distributions, nats
    gained: list[list[tuple[str, float]]]  # [T][TOP_TOKENS] (token, p_tuned - p_base), largest rise first
    lost: list[list[tuple[str, float]]]  # [T][TOP_TOKENS] (token, p_tuned - p_base), largest fall first
    resid_diff: list[list[float]]  # [L + 1][T] ||r_tuned - r_base|| / ||r_base||; row 0 = embeddings
    parted_at: list[int | None]  # [T] first row of resid_diff at or over PART_THRESHOLD (None: never)
    lens: dict[str, list[list[str]]]  # {"base", "tuned"}: [L][T] top-1 logit-lens token
    head_js: list[list[float] | None]  # [L][H] mean JS distance of attention rows (None: no pattern)
    vocabulary: str  # "same" or a sentence saying which part was compared

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CorpusDiff:
    base: str
    tuned: str
    tokens: int
    windows: int
    window: int
    mean_kl: float
    contexts: list[dict]  # ranked: {text, next, kl, window, position, ids (the window up to position)}
    kl_by_next_token: list[dict]  # {token, kl_sum, count}, largest sum first
    resid_diff: list[float]  # [L + 1] mean over positions
    head_js: list[list[float] | None]  # [L][H] mean over windows
    vocabulary: str
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def shared_vocabulary(base, tuned) -> tuple[int, str]:
    """(ids compared, a note): the two tokenizers must agree on every base token's id. A tuned
    tokenizer that only added tokens is compared on the base's ids."""
    vb, vt = base.tokenizer.get_vocab(), tuned.tokenizer.get_vocab()
    n_logits = min(base.shape.vocab_size, tuned.shape.vocab_size)
    if vb == vt and base.shape.vocab_size == tuned.shape.vocab_size:
        return n_logits, "same"
    if all(vt.get(tok) == i for tok, i in vb.items()):
        n = min(n_logits, len(vb))
        return n, (f"{tuned.name} adds {len(vt) - len(vb)} tokens to {base.name}'s tokenizer; the "
                   f"first {n:,} token ids, which both share, are compared.")
    raise SettingsError(f"{base.name} and {tuned.name} use different tokenizers, so their next-token "
                        "distributions cannot be compared; diff a fine-tuned model against its parent.")


def _check_pair(base, tuned) -> tuple[int, str]:
    shared = shared_vocabulary(base, tuned)
    if base.shape.n_layers != tuned.shape.n_layers:
        raise SettingsError(f"{base.name} has {base.shape.n_layers} layers and {tuned.name} "
                            f"{tuned.shape.n_layers}; diff a fine-tuned model against its parent.")
    return shared


def kl_per_position(logits_base: torch.Tensor, logits_tuned: torch.Tensor) -> torch.Tensor:
    """[T] KL(base || tuned) in nats, float64, from [T, V] logits (the same V)."""
    lb = torch.log_softmax(logits_base.double(), -1)
    lt = torch.log_softmax(logits_tuned.double(), -1)
    # 0 * log 0 is 0: a token the base gives no probability adds nothing
    return (lb.exp() * (lb - lt)).nan_to_num(0.0).sum(-1).clamp_min(0.0)


def js_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon distance (base 2, in [0, 1]) between distributions over the last dim."""
    p, q = p.double(), q.double()
    m = 0.5 * (p + q)

    def kl(a, b):  # terms with a = 0 are 0
        return torch.where(a > 0, a * (torch.log2(a) - torch.log2(b.clamp_min(1e-300))), torch.zeros_like(a)).sum(-1)

    return (0.5 * kl(p, m) + 0.5 * kl(q, m)).clamp_min(0.0).sqrt()


def _resid_rows(tr, n_layers: int) -> torch.Tensor:
    """[L + 1, T, d] the residual stream after the embeddings and after each layer."""
    return torch.stack([tr.embed] + [tr.resid_post(layer) for layer in range(n_layers)]).float()


def _relative_diff(rb: torch.Tensor, rt: torch.Tensor) -> torch.Tensor:
    """[L + 1, T]: ||rt - rb|| / ||rb|| per row and position."""
    return (rt - rb).norm(dim=-1) / rb.norm(dim=-1).clamp_min(1e-12)


def _head_js(tb, tt, n_layers: int) -> list[torch.Tensor | None]:
    """Per layer [H] mean over queries of the JS distance between the two models' attention rows;
    None for a layer without softmax attention (a hybrid's recurrent layer)."""
    out: list[torch.Tensor | None] = []
    for layer in range(n_layers):
        try:
            pb, pt = tb.attention_pattern(layer), tt.attention_pattern(layer)  # [H, T, T]
        except LmscopeError:
            out.append(None)
            continue
        out.append(js_distance(pb, pt).mean(-1))  # [H]
    return out


def _display(lm, token_id: int) -> str:
    """A token as people should see it (spaces and newlines visible, partial UTF-8 as bytes)."""
    from model_core.core.tokenization import token_display

    return token_display(lm.tokenizer, token_id)


def diff_prompt(base, tuned, prompt: str | None = None, token_ids=None, chat: bool = False,
                max_tokens: int = 256) -> PromptDiff:
    """One prompt through both models (LoadedModels), tokenized by the base."""
    from model_core.interp.lens import logit_lens
    from model_core.interp.trace import encode_prompt, trace

    n_vocab, vocab_note = _check_pair(base, tuned)
    if token_ids is None:
        token_ids = encode_prompt(base, prompt or "", chat=chat, max_tokens=max_tokens)
    tb, tt = trace(base, token_ids=token_ids), trace(tuned, token_ids=token_ids)
    L = base.shape.n_layers
    with torch.inference_mode():
        logits_b, logits_t = tb.logits()[:, :n_vocab], tt.logits()[:, :n_vocab]  # [T, V]
        kl = kl_per_position(logits_b, logits_t)  # [T]
        delta = torch.softmax(logits_t.double(), -1) - torch.softmax(logits_b.double(), -1)  # [T, V]
        up_v, up_i = delta.topk(TOP_TOKENS, dim=-1)
        down_v, down_i = (-delta).topk(TOP_TOKENS, dim=-1)
        rel = _relative_diff(_resid_rows(tb, L), _resid_rows(tt, L)).cpu()  # [L + 1, T]
        heads = _head_js(tb, tt, L)
    parted = []
    for t in range(rel.shape[1]):
        over = (rel[:, t] >= PART_THRESHOLD).nonzero()
        parted.append(int(over[0]) if len(over) else None)
    lens = {}
    for key, tr, lm in (("base", tb, base), ("tuned", tt, tuned)):
        r = logit_lens(tr, k=1)
        ids = r.top_ids[:, :, 0].tolist()  # [L][T]
        lens[key] = [[_display(lm, i) for i in row] for row in ids]
    return PromptDiff(
        base=base.name, tuned=tuned.name, tokens=[t["display"] for t in tb.tokens], kl=kl.tolist(),
        gained=[[(_display(base, i), float(v)) for v, i in zip(vs, ix) if v > 0]
                for vs, ix in zip(up_v.tolist(), up_i.tolist())],
        lost=[[(_display(base, i), -float(v)) for v, i in zip(vs, ix) if v > 0]
              for vs, ix in zip(down_v.tolist(), down_i.tolist())],
        resid_diff=rel.tolist(), parted_at=parted, lens=lens,
        head_js=[None if h is None else h.tolist() for h in heads], vocabulary=vocab_note)


def diff_corpus(base, tuned, windows: torch.Tensor, progress: Callable[[float], None] | None = None,
                top: int = TOP_CONTEXTS) -> CorpusDiff:
    """windows: [N, W] token ids (model_core.interp.neurons.corpus_windows). Each window is traced by
    both models; the position whose next token is the corpus's own is ranked by its KL."""
    import time

    from model_core.interp.trace import trace

    n_vocab, vocab_note = _check_pair(base, tuned)
    if windows.ndim != 2 or windows.shape[0] == 0:
        raise SettingsError("The corpus gave no windows of text to compare; give more text.")
    N, W = windows.shape
    L = base.shape.n_layers
    t0 = time.perf_counter()
    best: list[tuple[float, int, int]] = []  # a min-heap of (kl, window, position)
    by_next: dict[int, list[float]] = {}  # next token id -> [kl sum, count]
    resid_sum = torch.zeros(L + 1, dtype=torch.float64)
    head_sum: list[torch.Tensor | None] = [None] * L
    kl_total, n_pos = 0.0, 0
    with torch.inference_mode():
        for w in range(N):
            ids = windows[w].tolist()
            tb, tt = trace(base, token_ids=ids), trace(tuned, token_ids=ids)
            kl = kl_per_position(tb.logits()[:, :n_vocab], tt.logits()[:, :n_vocab]).cpu()  # [W]
            for pos in range(W - 1):  # the last position's next token lies outside the window
                k = float(kl[pos])
                item = (k, w, pos)
                if len(best) < top:
                    heapq.heappush(best, item)
                elif item > best[0]:
                    heapq.heapreplace(best, item)
                s = by_next.setdefault(ids[pos + 1], [0.0, 0])
                s[0] += k
                s[1] += 1
            kl_total += float(kl[: W - 1].sum())
            n_pos += W - 1
            resid_sum += _relative_diff(_resid_rows(tb, L), _resid_rows(tt, L)).double().sum(-1).cpu()
            for layer, h in enumerate(_head_js(tb, tt, L)):
                if h is not None:
                    head_sum[layer] = h.cpu() if head_sum[layer] is None else head_sum[layer] + h.cpu()
            if progress is not None:
                progress((w + 1) / N)
    contexts = []
    for k, w, pos in sorted(best, reverse=True):
        ids = windows[w].tolist()
        # ids: the window up to the ranked position, what diff_prompt re-runs to show it token by token
        contexts.append({"text": base.tokenizer.decode(ids[max(0, pos + 1 - CONTEXT_TOKENS): pos + 1]),
                         "next": _display(base, ids[pos + 1]), "kl": k, "window": w, "position": pos,
                         "ids": ids[: pos + 1]})
    ranked_next = sorted(by_next.items(), key=lambda kv: -kv[1][0])[:top]
    return CorpusDiff(
        base=base.name, tuned=tuned.name, tokens=int(N * W), windows=int(N), window=int(W),
        mean_kl=kl_total / max(n_pos, 1), contexts=contexts,
        kl_by_next_token=[{"token": _display(base, t), "kl_sum": s, "count": c} for t, (s, c) in ranked_next],
        resid_diff=(resid_sum / (N * W)).tolist(),
        head_js=[None if h is None else (h / N).tolist() for h in head_sum], vocabulary=vocab_note,
        seconds=round(time.perf_counter() - t0, 2))

