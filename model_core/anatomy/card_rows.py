"""An architecture card as rows people read: the labelled rows (labels shared with the Anatomy
tab's comparison), the sources' claims to show in each row, each part's share of the parameters,
and the KV cache's growth with the context next to its formulas.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from model_core.anatomy.decoder_card import kv_bytes_at


def _n(v) -> str:
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


# card field -> the row where a claim about it is shown
CLAIM_ROWS = {"params": "params", "active_params": "active params / token", "layers": "layers",
              "d_model": "d_model", "attention": "attention kind", "q_heads": "query heads", "kv_heads": "key/value heads",
              "kv_bytes_per_token": "KV cache / token (fp16)", "sliding_window": "sliding window",
              "position": "position encoding", "ffn": "feed-forward", "norm": "norm", "norm_position": "norm position",
              "vocab": "vocabulary", "max_context": "context length", "tied": "weight tying"}


def display_rows(card: dict) -> OrderedDict[str, str]:
    """The card as labelled rows (labels shared with the Anatomy tab's comparison)."""
    r = OrderedDict()
    r["architecture"] = card["architecture"]
    r["weights"] = card["weights"]
    r["params"] = _n(card["params"])
    if card["active_params"] != card["params"]:
        r["active params / token"] = f"{card['active_params']:,} ({100 * card['active_params'] / card['params']:.1f}%)"
    else:
        r["active params / token"] = "all (dense)"
    r["layers"] = _n(card["layers"])
    r["d_model"] = _n(card["d_model"])
    r["attention kind"] = card["attention_detail"]
    r["query heads"] = _n(card["q_heads"])
    r["key/value heads"] = _n(card["kv_heads"])
    if card.get("v_head_dim"):
        r["head dim"] = (f"q·k {card['head_dim']} ({card['head_dim'] - card['kv_rope_key']} + {card['kv_rope_key']} RoPE), "
                         f"v {card['v_head_dim']}")
    else:
        r["head dim"] = _n(card["head_dim"])
    r["KV cache / token (fp16)"] = f"{card['kv_bytes_per_token']:,} B = {card['kv_formula']}"
    if card["kv_bytes_per_token_uncompressed"]:
        u = card["kv_bytes_per_token_uncompressed"]
        r["KV / token if uncompressed (fp16)"] = (f"{u:,} B ({u / card['kv_bytes_per_token']:.0f}× the latent): "
                                                 f"every head's full K and V")
    else:
        r["KV / token if uncompressed (fp16)"] = "same (K and V are cached as they are)"
    if card["sliding_window"]:
        r["sliding window"] = f"{card['sliding_layers']} of {card['layers']} layers see only the last {card['sliding_window']:,} tokens"
    else:
        r["sliding window"] = "no (every layer sees all tokens)"
    r["position encoding"] = card["position"]
    r["feed-forward"] = card["ffn"]
    r["norm"] = card["norm"]
    feeds = ", ".join(card["norm_feeds"])
    r["norm position"] = card["norm_position"] + (f": {feeds}" if feeds else "") + (
        f"; final {card['final_norm']}" if card["final_norm"] else "")
    r["vocabulary"] = _n(card["vocab"])
    r["context length"] = _n(card["max_context"])
    r["weight tying"] = "tied (unembedding = embedding)" if card["tied"] else "untied (separate unembedding)"
    for part, v in card["params_by_part"].items():
        if part in ("experts",) and not v:
            continue
        if part == "other" and not v:
            continue
        if part == "unembedding" and card["tied"]:
            continue
        r[f"params: {part}"] = _n(v)
    return r


def row_marks(card: dict) -> dict[str, list[dict]]:
    """The claims to show in each row: {row label: [{claim, source, agrees, note}]}."""
    marks: dict[str, list[dict]] = {}
    for c in card.get("comparison", []):
        marks.setdefault(CLAIM_ROWS.get(c["field"], c["field"]), []).append(c)
    return marks


def param_shares(card: dict) -> OrderedDict[str, float]:
    """Share (%) of the model's parameters in each part."""
    total = max(1, card["params"])
    return OrderedDict((k, 100 * v / total) for k, v in card["params_by_part"].items())


def kv_growth(cards: dict[str, dict], points: int = 60) -> dict:
    """KV-cache bytes (fp16) vs context for each card, from 1 token to its own context length, on a
    log grid shared by all: {name: {tokens, bytes, uncompressed (MLA) or None, formula, max_context}}."""
    top = max(c["max_context"] or 1 for c in cards.values())
    grid = sorted({int(round(x)) for x in [10 ** (i * math.log10(top) / (points - 1)) for i in range(points)]})
    out = {}
    for name, c in cards.items():
        toks = [t for t in grid if t <= (c["max_context"] or top)]
        if c["max_context"] and toks[-1] != c["max_context"]:
            toks.append(c["max_context"])
        windows = sorted({w for *_, w in c["_kv_layers"] if w})
        for w in windows:  # the bend of a sliding window is a grid point
            if w < toks[-1] and w not in toks:
                toks = sorted(toks + [w])
        out[name] = {"tokens": toks, "bytes": kv_bytes_at(c, toks),
                     "uncompressed": kv_bytes_at(c, toks, uncompressed=True) if c["kv_bytes_per_token_uncompressed"] else None,
                     "formula": c["kv_formula"], "kind": c["attention"], "max_context": c["max_context"]}
    return out


FORMULAS = OrderedDict([
    ("MHA / GQA / MQA", "bytes = 2 (K and V) × layers × kv_heads × head_dim × T × 2 B"),
    ("sliding window W", "bytes = 2 × layers × kv_heads × head_dim × min(T, W) × 2 B on the windowed layers"),
    ("MLA", "bytes = layers × (latent d_c + RoPE key d_R) × T × 2 B; uncompressed: layers × heads × (d_qk + d_v) × T × 2 B"),
])
