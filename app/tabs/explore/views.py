"""From a Trace to the numbers each Explore view shows (pure functions: Trace in, arrays out; what
several views reuse is kept per trace in app/tabs/explore/view_cache.py, and the background lens of
every position is app/tabs/explore/lens_filler.py's).

Every view shows the whole prompt at any length the server allows. A *region* of positions (query
rows x key columns; by default the whole prompt) is drawn cell by cell with token labels when it is
small, and otherwise pooled here on the server, so what the browser receives is bounded whatever the
length: attention by max pooling (a cell is the largest weight of its block), the bars of one row by
sum pooling (a bar is the attention mass on its block), the logit lens by sampling one position per
column (each column costs a pass through the unembedding per layer) and zoomed to see every position.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch
import torch.nn.functional as F

from app.tabs.explore import view_cache
from app.tabs.explore.view_cache import for_trace as _vcache
from model_core.core.sampling import SamplingSettings, apply_sampling
from model_core.interp.lens import logit_lens
from model_core.interp.trace import Trace

EXACT = 64  # a region at most this many positions per axis is drawn cell by cell, with token labels
BIG_BINS = 80  # cells per axis at most in the chosen head's heatmap (max-pooled beyond)
GRID_EXACT = 32  # the all-heads grid is drawn cell by cell up to this many positions per axis ...
GRID_BINS = 28  # ... and max-pooled to this many cells per axis beyond
BAR_BINS = 128  # bars at most in "where the chosen token looks" (sum-pooled beyond)
# Beyond EXACT positions the lens samples LENS_COLS of them, one per column: each column is a pass of
# every layer through the unembedding (30 x 49k at 576 wide on SmolLM2), and the first view of a
# 1,024-token prompt must stay within 1.5x the trace (bench/explore.py). Zoom to see every position.
LENS_COLS = 32
SEQ_BINS = 80  # positions at most in the residual-norm and neuron views (max-pooled beyond)
NEURONS = 24  # neurons in the neuron heatmap

# colour scales of the attention heatmaps: name -> what the caption says
SCALES = {
    "linear": "weight, linear 0-1",
    "log": "weight on a log scale",
    "row": "each query row divided by its largest weight among the keys shown",
}


# ---------------------------------------------------------------------- labels and regions

def labels(tr: Trace) -> list[str]:
    return [t["display"] for t in tr.tokens]


def kv_groups(tr: Trace) -> list[int]:
    s = tr.lm.shape
    group = s.n_heads // s.n_kv_heads
    return [h // group for h in range(s.n_heads)]


def to_np(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def whole(T: int) -> tuple[int, int, int, int]:
    return (0, T - 1, 0, T - 1)


_RANGE = re.compile(r"(\d{1,9})\s*(?:-|–|—|:|\.\.|to)\s*(\d{1,9})")


def parse_region(text, T: int) -> tuple[tuple[int, int, int, int], str]:
    """A zoom as people type it -> ((first row, last row, first key, last key), notice).

    "" or "all" is the whole prompt; "a-b" is positions a..b as both query rows and key columns;
    "a-b, c-d" is query rows a..b and key columns c..d (inclusive, 0-based). Out-of-range values
    are clamped and said so in the notice; what cannot be read shows the whole prompt, also said."""
    T = max(1, int(T))
    text = "" if text is None else str(text)[:200]
    if not text.strip() or text.strip().lower() in ("all", "whole", "none"):
        return whole(T), ""
    found = _RANGE.findall(text)
    if not found or len(found) > 2:
        return whole(T), (f"Zoom “{text[:40]}” is not a range like 100-160 or 100-160, 0-160; "
                          "showing the whole prompt.")
    (a, b), (c, d) = found[0], found[-1]
    vals = [int(a), int(b), int(c), int(d)]
    clamped = [max(0, min(T - 1, v)) for v in vals]
    q0, q1 = sorted(clamped[:2])
    k0, k1 = sorted(clamped[2:])
    note = ""
    if clamped != vals:
        if min(vals[0], vals[1]) > T - 1:  # nothing of it is in this prompt
            return whole(T), f"Zoom {text[:40]} lies beyond this prompt's {T} tokens; showing the whole prompt."
        note = f"Zoom {text[:40]} clamped to this prompt's positions 0-{T - 1}."
    return (q0, q1, k0, k1), note


def region_text(region: tuple[int, int, int, int], T: int) -> str:
    """The canonical zoom string of a region ("" for the whole prompt)."""
    q0, q1, k0, k1 = region
    if region == whole(T):
        return ""
    return f"{q0}-{q1}" if (q0, q1) == (k0, k1) else f"{q0}-{q1}, {k0}-{k1}"


def axis(lo: int, hi: int, max_bins: int, names: list[str] | None = None) -> dict:
    """Positions lo..hi in at most `max_bins` equal bins (the last one may be shorter).
    labels: "pos:token" per position when a bin is one position, else None (numeric axis)."""
    n = hi - lo + 1
    b = max(1, math.ceil(n / max(1, max_bins)))
    starts = list(range(lo, hi + 1, b))
    ends = [min(s + b - 1, hi) for s in starts]
    return {"lo": lo, "hi": hi, "bin": b, "starts": starts, "ends": ends,
            "centers": [(s + e) / 2 for s, e in zip(starts, ends)],
            "labels": [f"{i}:{names[i]}" for i in range(lo, hi + 1)] if (b == 1 and names is not None) else None}


# ---------------------------------------------------------------------- attention

def _pool_max(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """[N, R, C] -> [N, ceil(R/br), ceil(C/bc)], each cell the largest value of its block."""
    if br == 1 and bc == 1:
        return x
    return F.max_pool2d(x[None], (br, bc), (br, bc), ceil_mode=True)[0]


def _colour(x: torch.Tensor, scale: str, T: int) -> torch.Tensor:
    if scale == "log":
        return torch.log10(x.clamp_min(10.0 ** log_floor(T)))
    return x


def log_floor(T: int) -> float:
    """Lowest decade the log scale shows: two below a uniform row over the whole prompt."""
    return -float(math.ceil(math.log10(max(T, 2))) + 2)


def attention_view(tr: Trace, layer: int, head: int, query: int,
                   region: tuple[int, int, int, int] | None = None, scale: str = "linear") -> dict:
    """The chosen layer's heads over a region: every head small (grid), the chosen head larger
    (big), and the query's row over the region's keys up to the query itself (row; sum-pooled beyond
    BAR_BINS; over the whole prompt when the query is not one of the region's rows, and over keys
    0..query when every key column of the region lies after it)."""
    T = tr.n_tokens
    q0, q1, k0, k1 = region or whole(T)
    scale = scale if isinstance(scale, str) and scale in SCALES else "linear"
    names = labels(tr)
    p = tr.attention_pattern(layer)
    sub = p[:, q0: q1 + 1, k0: k1 + 1].float()
    if scale == "row":
        sub = sub / sub.amax(-1, keepdim=True).clamp_min(1e-30)
    nq, nk = q1 - q0 + 1, k1 - k0 + 1
    gb = GRID_EXACT if max(nq, nk) <= GRID_EXACT else GRID_BINS
    g_rows, g_cols = axis(q0, q1, gb, names), axis(k0, k1, gb, names)
    b_rows, b_cols = axis(q0, q1, EXACT if max(nq, nk) <= EXACT else BIG_BINS, names), \
        axis(k0, k1, EXACT if max(nq, nk) <= EXACT else BIG_BINS, names)
    grid = _colour(_pool_max(sub, g_rows["bin"], g_cols["bin"]), scale, T)
    big = _colour(_pool_max(sub[head: head + 1], b_rows["bin"], b_cols["bin"])[0], scale, T)
    row = p[head, query].float()
    if not q0 <= query <= q1:  # a query outside the zoomed rows: where it looks over the whole prompt
        k0, k1 = 0, T - 1
    # a causal query reads no key after itself: the bars stop at the query (keys past it are all 0)
    k1 = min(k1, query)
    if k0 > k1:  # every key column of the zoom lies after the query: all the keys it can read
        k0 = 0
    inside = row[k0: k1 + 1]
    bars = axis(k0, k1, BAR_BINS, names)
    if bars["bin"] > 1:
        pad = (-inside.shape[0]) % bars["bin"]
        summed = F.pad(inside, (0, pad)).view(-1, bars["bin"]).sum(-1)
    else:
        summed = inside
    return {"grid": to_np(grid).astype(np.float32), "big": to_np(big).astype(np.float32),
            "grid_rows": g_rows, "grid_cols": g_cols, "rows": b_rows, "cols": b_cols,
            "row": to_np(summed).astype(np.float32), "bars": bars, "scale": scale,
            "log_floor": log_floor(T), "outside_mass": max(0.0, float(row.sum() - inside.sum()))}


def head_overview(tr: Trace, metric: str) -> np.ndarray:
    """[L, H] summary of every head, one layer's pattern at a time (nothing big is kept; the
    summary itself is kept per trace and metric, so moving the highlight costs nothing)."""
    c = _vcache(tr)
    key = ("overview", metric[:40])
    if key in c:
        return c[key]
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
    c[key] = np.stack(out)
    return c[key]


def head_overview_cached(tr: Trace, metric: str) -> np.ndarray | None:
    return _vcache(tr).get(("overview", metric[:40]))


# ---------------------------------------------------------------------- residual stream, neurons

def _pool_seq(x: torch.Tensor, b: int, signed: bool = False) -> torch.Tensor:
    """[P, ...] -> [ceil(P/b), ...]: the largest value per bin (signed: the value of largest |x|)."""
    if b == 1:
        return x
    pad = (-x.shape[0]) % b
    if signed:
        xp = F.pad(x.T, (0, pad)).T.reshape(-1, b, *x.shape[1:])
        idx = xp.abs().argmax(1, keepdim=True)
        return xp.gather(1, idx)[:, 0]
    xp = F.pad(x.T, (0, pad), value=float("-inf")).T.reshape(-1, b, *x.shape[1:])
    return xp.amax(1)


def residual_view(tr: Trace, query: int, rows: tuple[int, int] | None = None) -> dict:
    """Residual norms [L+1, bins] over positions rows (max-pooled beyond SEQ_BINS) and what each
    block adds at the query."""
    T = tr.n_tokens
    lo, hi = rows or (0, T - 1)
    c = _vcache(tr)
    with c["lock"]:
        if "norms" not in c:
            with torch.inference_mode():
                r = [tr.embed.norm(dim=-1)] + [tr.resid_post(l).norm(dim=-1) for l in tr.captured_layers]
                c["norms"] = torch.stack([x.float().cpu() for x in r])
    norms = c["norms"][:, lo: hi + 1]
    ax = axis(lo, hi, SEQ_BINS, labels(tr))
    pooled = _pool_seq(norms.T, ax["bin"]).T
    attn = [float(tr.attn_out[l][query].norm()) for l in tr.captured_layers]
    mlp = [float(tr.mlp_out[l][query].norm()) for l in tr.captured_layers]
    return {"axis": ax, "positions": list(range(lo, hi + 1)), "norms": to_np(pooled).astype(np.float32),
            "attn": np.array(attn), "mlp": np.array(mlp)}


def neuron_view(tr: Trace, layer: int, query: int, rows: tuple[int, int] | None = None, n: int = NEURONS) -> dict:
    """The layer's neurons that fire hardest over positions rows (acts [bins, n], signed max-|x|
    pooled beyond SEQ_BINS) and the strongest ones at the query."""
    T = tr.n_tokens
    lo, hi = rows or (0, T - 1)
    acts = tr.mlp_post(layer)
    win = acts[lo: hi + 1].float()
    ids = torch.topk(win.abs().amax(0), min(n, win.shape[-1])).indices
    ax = axis(lo, hi, SEQ_BINS, labels(tr))
    at_q = acts[query].float()
    qids = torch.topk(at_q.abs(), min(16, at_q.shape[-1])).indices
    return {"axis": ax, "acts": to_np(_pool_seq(win[:, ids], ax["bin"], signed=True)).astype(np.float32),
            "neurons": ids.tolist(), "query_values": to_np(at_q[qids]), "query_neurons": qids.tolist()}


# ---------------------------------------------------------------------- logit lens

def _next_ids(tr: Trace) -> list[int]:
    """The token each position predicts: the next prompt token (the model's own top-1 at the end)."""
    c = _vcache(tr)
    if "next_ids" not in c:
        c["next_ids"] = tr.token_ids[1:] + [int(torch.argmax(tr.next_logits))]
    return c["next_ids"]


def _lens_state(tr: Trace) -> dict:
    """The per-trace lens arrays [L, T] and which positions they hold (call with the lens lock held)."""
    c = _vcache(tr)
    st = c.get("lens")
    if st is None:
        T, L = tr.n_tokens, len(tr.captured_layers)
        st = c["lens"] = {"done": np.zeros(T, bool), "done_t": np.zeros(T, bool),
                          "top": np.zeros((L, T), np.int64), "p": np.zeros((L, T), np.float32),
                          "ent": np.zeros((L, T), np.float32), "tp": np.zeros((L, T), np.float32),
                          "rank": np.zeros((L, T), np.int64)}
    return st


def _lens_lock(tr: Trace):
    return view_cache.lock(tr, "lens_lock")


def lens_columns(tr: Trace, positions: list[int], targets: bool = False, compute: bool = True) -> dict:
    """Logit-lens numbers [L, P] at these positions: top-1 id and probability and entropy, and with
    targets=True also the next token's probability and rank (that doubles the cost of a column:
    only the query's column needs it, for "the next token across layers"). Columns are computed
    once per trace and kept, so zooming back and forth and moving the query cost nothing new; the
    background filler (app/tabs/explore/lens_filler.py) computes every position while the server is idle.
    compute=False computes nothing: positions not known yet come back missing (NaN probability,
    top id -1), and "missing" counts them."""
    with _lens_lock(tr):
        st = _lens_state(tr)
        done = st["done_t" if targets else "done"]
        missing = sorted({p for p in positions if not done[p]})
        if missing and compute:
            nxt = _next_ids(tr)
            res = logit_lens(tr, positions=missing, k=1, targets=[nxt[p] for p in missing] if targets else None)
            st["top"][:, missing] = res.top_ids[:, :, 0].numpy()
            st["p"][:, missing] = res.top_probs[:, :, 0].float().numpy()
            st["ent"][:, missing] = res.entropy.float().numpy()
            st["done"][missing] = True
            if targets:
                st["tp"][:, missing] = res.target_probs.float().numpy()
                st["rank"][:, missing] = res.target_ranks.numpy()
                st["done_t"][missing] = True
            missing = []
        out = {k: st[k][:, positions] for k in (("top", "p", "ent", "tp", "rank") if targets else ("top", "p", "ent"))}
        if missing:
            gone = ~done[positions]
            for k in out:
                if out[k].dtype.kind == "f":
                    out[k][:, gone] = np.nan
                else:
                    out[k][:, gone] = -1
        out["missing"] = len(missing)
        return out


def lens_done(tr: Trace) -> np.ndarray:
    """[T] bool: which positions of the trace have their lens column computed (a copy)."""
    with _lens_lock(tr):
        return _lens_state(tr)["done"].copy()


def lens_filled(tr: Trace) -> int:
    """How many positions of the trace have their lens column computed."""
    return int(lens_done(tr).sum())


def fill_order(T: int) -> list[int]:
    """Every position 0..T-1, coarse to fine: every 32nd (the last of each 32), then every 16th, ...
    then the rest, so that partway through the fill every region already holds evenly spread columns."""
    seen = np.zeros(T, bool)
    order = []
    s = 32
    while s >= 1:
        for p in range(s - 1, T, s):
            if not seen[p]:
                seen[p] = True
                order.append(p)
        s //= 2
    return order


def missing_batches(tr: Trace, positions: list[int], first: int = 4, growth: int = 3) -> list[list[int]]:
    """The positions whose lens column is not computed yet, in batches for a view that draws as it
    computes: coarse to fine over the list (fill_order), the first batch small (`first` columns
    spread over the region: a picture within ~0.15 s on this CPU), each next one `growth` times the
    size of everything before it, so a 64-column zoom is drawn 3 times, not 64."""
    with _lens_lock(tr):
        done = _lens_state(tr)["done"]
        todo = [positions[i] for i in fill_order(len(positions)) if not done[positions[i]]]
    out, n = [], first
    while todo:
        out.append(todo[:n])
        todo = todo[n:]
        n = max(first, growth * sum(len(b) for b in out))
    return out


def lens_positions(lo: int, hi: int) -> tuple[list[int], int]:
    """Positions the lens shows for rows lo..hi: all of them up to EXACT, else the last position
    of each of at most LENS_COLS equal bins (the region's last position always in)."""
    n = hi - lo + 1
    if n <= EXACT:
        return list(range(lo, hi + 1)), 1
    step = math.ceil(n / LENS_COLS)
    return [min(hi, lo + step * j + step - 1) for j in range(math.ceil(n / step))], step


def lens_view(tr: Trace, query: int, colour: str = "probability", rows: tuple[int, int] | None = None,
              compute: bool = True) -> dict:
    """The lens over rows lo..hi (every position up to EXACT, else sampled columns) and the next
    token across layers at the query. compute=False: only what is already known (the background
    filler's columns, earlier views'); the others come back blank and counted in "missing"."""
    T = tr.n_tokens
    lo, hi = rows or (0, T - 1)
    pos, step = lens_positions(lo, hi)
    tok = tr.lm.tokenizer
    cols = lens_columns(tr, pos, compute=compute)
    at_q = lens_columns(tr, [query], targets=True)  # one column: cheap, always computed
    show = _vcache(tr).setdefault("shown", {})
    pend = [_pending(tr, p) for p in pos]  # a character the prompt left open at that position
    top = [[_cell(show, tok, i, pend[j]) if i >= 0 else "" for j, i in enumerate(row)] for row in cols["top"].tolist()]
    probs = cols["p"]
    return {"positions": pos, "step": step, "lo": lo, "top": top, "probs": probs,
            "colour": probs if colour == "probability" else cols["ent"], "layers": list(tr.captured_layers),
            "target": _show(tok, _next_ids(tr)[query]), "target_probs": at_q["tp"][:, 0],
            "target_ranks": at_q["rank"][:, 0].astype(np.float64), "missing": cols["missing"]}


def lens_strip(tr: Trace, layer: int, rows: tuple[int, int] | None = None) -> dict:
    """The top token at one layer over the lens's positions for rows lo..hi (the same columns as
    lens_view: every position up to EXACT, else sampled), as a row of words: {"positions", "step",
    "words", "probs" (NaN where the column is not computed yet), "layer"}. Computes nothing new:
    the lens figure beside it has asked for these columns already (or the filler will)."""
    T = tr.n_tokens
    lo, hi = rows or (0, T - 1)
    pos, step = lens_positions(lo, hi)
    layers = list(tr.captured_layers)
    i = layers.index(layer) if layer in layers else len(layers) - 1
    cols = lens_columns(tr, pos, compute=False)
    show = _vcache(tr).setdefault("shown", {})
    ids = cols["top"][i].tolist()
    words = [_cell(show, tr.lm.tokenizer, t, _pending(tr, p)) if t >= 0 else "" for t, p in zip(ids, pos)]
    return {"positions": pos, "step": step, "words": words, "probs": cols["p"][i], "layer": layers[i],
            "missing": cols["missing"]}


def lens_topk(tr: Trace, layer: int, pos: int, k: int = 10) -> dict:
    """The lens's k best guesses at one layer and position (one pass of one row through the
    unembedding, ~1 ms; kept per trace): {"tokens", "probs", "layer", "pos", "entropy"}."""
    layers = list(tr.captured_layers)
    layer = layer if layer in layers else layers[-1]
    pos = max(0, min(tr.n_tokens - 1, int(pos)))
    c = _vcache(tr)
    key = ("topk", layer, pos, k)
    if key not in c:
        res = logit_lens(tr, positions=[pos], layers=[layer], k=k)
        c[key] = {"tokens": [_show(tr.lm.tokenizer, i) for i in res.top_ids[0, 0].tolist()],
                  "probs": res.top_probs[0, 0].float().numpy(), "layer": layer, "pos": pos,
                  "entropy": float(res.entropy[0, 0])}
    return c[key]


def _show(tok, i: int) -> str:
    from model_core.core.tokenization import token_display

    return token_display(tok, i)


def _pending(tr: Trace, p: int) -> bytes:
    """The bytes of a character the prompt has started but not finished at position p (b"" if none)."""
    from model_core.core.tokenization import pending_bytes

    rows = tr.tokens[max(0, p - 3): p + 1]
    return pending_bytes([bytes.fromhex(t.get("bytes", "")) for t in rows]) if any(
        (t.get("parts") or 1) > 1 for t in rows) else b""


def _cell(show: dict, tok, i: int, pending: bytes) -> str:
    """A lens cell: the predicted token, or after an unfinished character the character it would
    finish ("…မ", model_core.core.tokenization.continuation_display) instead of a bare byte."""
    if not pending:
        return show.get(i) or show.setdefault(i, _show(tok, i))
    from model_core.core.tokenization import continuation_display, token_bytes

    key = (i, pending)
    return show.get(key) or show.setdefault(key, continuation_display(pending, token_bytes(tok, i)))


# ---------------------------------------------------------------------- next token, tables

def next_token_view(tr: Trace, settings: SamplingSettings, k: int = 20, epsilon: float = 0.0,
                    eta: float = 0.0) -> dict:
    res = apply_sampling(tr.next_logits, settings, context_ids=tr.token_ids, epsilon=epsilon, eta=eta)
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
    if res.eta_threshold is not None:  # eta's cutoff depends on the entropy of what enters it
        summary += f"; eta's cutoff p < {res.eta_threshold:.2e}"
    tok = tr.lm.tokenizer
    return {"tokens": [_show(tok, i) for i in top.tolist()], "base": to_np(res.base_probs[top]),
            "final": to_np(res.probs[top]), "removed_by": removed_by, "summary": summary,
            "stages": [{"stage": st.name, "removed": st.n_removed, "mass_kept": round(st.kept_mass, 6)}
                       for st in res.stages[1:]]}


def token_table(tr: Trace):
    import pandas as pd

    lp = tr.token_logprobs.float().cpu().tolist()
    return pd.DataFrame({
        "position": range(tr.n_tokens), "id": tr.token_ids, "token": [t["text"] for t in tr.tokens],
        "display": labels(tr),
        # a token that is one of several byte tokens spelling a character: its bytes, the character, which part
        "bytes": [t.get("bytes", "") for t in tr.tokens], "glyph": [t.get("glyph_text", t["text"]) for t in tr.tokens],
        "part": [f"{t['part']}/{t['parts']}" if (t.get("parts") or 1) > 1 else "" for t in tr.tokens],
        "logprob": lp,
        "surprisal_bits": [(-v / math.log(2)) if v == v else None for v in lp],
    })
