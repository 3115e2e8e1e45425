"""A trace as a small JSON-able summary: its tokens, the next-token distribution's top k and the
logit lens's top-1 per layer at the last position (`lmscope trace --json`, Explore's trace.json)."""

from __future__ import annotations

import torch

from model_core.interp.lens import logit_lens


def trace_summary(lm, tr, k: int = 10) -> dict:
    probs = torch.softmax(tr.next_logits.float(), -1)
    p, i = probs.topk(k)
    lens = logit_lens(tr, positions=[-1], k=1)
    tok = lm.tokenizer
    return {
        "model": lm.name,
        "tokens": [{"id": t["id"], "text": t["text"], "display": t["display"], "bytes": t.get("bytes", ""),
                    "glyph": t.get("glyph_text", t["text"])} for t in tr.tokens],
        "next_tokens": [{"id": int(a), "token": tok.decode([int(a)]), "prob": float(b)} for a, b in zip(i, p)],
        "logit_lens": [
            {"layer": int(l), "token": tok.decode([int(lens.top_ids[j, 0, 0])]), "id": int(lens.top_ids[j, 0, 0]),
             "prob": float(lens.top_probs[j, 0, 0])}
            for j, l in enumerate(lens.layers)
        ],
        "perplexity": tr.perplexity(),
        "seconds": round(tr.seconds, 4),
    }
