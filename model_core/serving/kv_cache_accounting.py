"""KV-cache accounting: the bytes the cache should hold (the formula, per layer, sliding windows
included) next to the bytes its real key/value tensors hold, their growth with the sequence, and
the measured decode time with and without the cache.
"""

from __future__ import annotations

import time

import torch

from model_core.core.adapters import kv_cache_bytes
from model_core.core.cache_api import new_cache
from model_core.core.errors import PromptError
from model_core.serving.generation_request import check_max_new_tokens
from model_core.serving.model_forward import forward_last


def _layer_windows(lm) -> list[int | None]:
    ad = lm.adapter
    return [ad.sliding_window(l) for l in range(lm.shape.n_layers)]


def kv_cache_formula(lm, tokens: int, dtype: torch.dtype | None = None, windows: list[int | None] | None = None) -> dict:
    """Bytes the cache should hold for `tokens` tokens, per layer and in total. Sliding-window
    layers (Gemma 3) keep only the last window-1 tokens in transformers' DynamicCache.
    `windows`: _layer_windows(lm), when the caller already has it."""
    s = lm.shape
    b = torch.empty((), dtype=dtype or lm.dtype).element_size()
    per_layer = []
    for w in windows if windows is not None else _layer_windows(lm):
        t = tokens if w is None else min(tokens, w - 1)
        per_layer.append(kv_cache_bytes(1, s.n_kv_heads, s.d_head, t, b))
    return {"tokens": tokens, "bytes_per_value": b, "per_layer": per_layer, "total": sum(per_layer),
            "bytes_per_token": kv_cache_bytes(s.n_layers, s.n_kv_heads, s.d_head, 1, b),
            "expression": f"2 x {s.n_layers} layers x {s.n_kv_heads} kv_heads x {s.d_head} head_dim x "
                          f"{tokens} tokens x {b} B"}


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(getattr(l, "keys", None), getattr(l, "values", None)) for l in layers]
    return list(zip(cache.key_cache, cache.value_cache))  # older caches


def cache_size(cache) -> tuple[int, int]:
    total, tokens = 0, 0
    for k, v in cache_tensors(cache):
        if torch.is_tensor(k) and k.numel():
            total += k.numel() * k.element_size() + v.numel() * v.element_size()
            tokens = max(tokens, int(k.shape[-2]))
    return tokens, total


def kv_cache_report(lm, cache) -> dict:
    """Formula next to the measured bytes of the cache's real key/value tensors, per layer."""
    measured, tokens_per_layer = [], []
    for k, v in cache_tensors(cache):
        empty = k is None or not torch.is_tensor(k) or k.numel() == 0
        measured.append(0 if empty else k.numel() * k.element_size() + v.numel() * v.element_size())
        tokens_per_layer.append(0 if empty else int(k.shape[-2]))
    tokens = max(tokens_per_layer or [0])
    try:
        tokens = int(cache.get_seq_length())
    except (AttributeError, ValueError):  # a hybrid's cache of linear-attention layers only has no length
        pass
    tokens = max([tokens] + [t for t, w in zip(tokens_per_layer, _layer_windows(lm)) if w is None])
    return _report(lm, tokens, measured, tokens_per_layer)


def slot_kv_report(lm, tokens: int, layer_bytes_per_token: list[int]) -> dict:
    """kv_cache_report for an engine slot: the bytes `tokens` tokens occupy in the engine's
    preallocated cache tensors (their shapes and dtype, per layer)."""
    return _report(lm, tokens, [tokens * b for b in layer_bytes_per_token], [tokens] * len(layer_bytes_per_token))


def _report(lm, tokens: int, measured: list[int], tokens_per_layer: list[int]) -> dict:
    f = kv_cache_formula(lm, tokens)
    return {"tokens": tokens, "bytes_per_value": f["bytes_per_value"], "bytes_per_token": f["bytes_per_token"],
            "expression": f["expression"], "formula_per_layer": f["per_layer"], "formula_total": f["total"],
            "measured_per_layer": measured, "measured_total": sum(measured), "tokens_per_layer": tokens_per_layer}


def kv_cache_growth(lm, total_tokens: int, points: int = 32) -> dict:
    """Formula bytes as the sequence grows 1..total_tokens (for a plot)."""
    xs = sorted({max(1, round(total_tokens * i / points)) for i in range(1, points + 1)} | {1})
    windows = _layer_windows(lm)  # once, not per point: each layer's window is a config read
    rows = [kv_cache_formula(lm, t, windows=windows) for t in xs]
    return {"tokens": xs, "total": [r["total"] for r in rows], "per_layer": [r["per_layer"] for r in rows]}


def time_cache_vs_no_cache(lm, token_ids, new_tokens: int = 16, repeats: int = 1) -> dict:
    """Measured greedy decoding of `new_tokens` tokens after the prompt, with the KV cache (one
    new token per forward) and without it (the whole sequence every forward). Same tokens both
    ways (checked)."""
    ids = [int(t) for t in token_ids]
    new_tokens = check_max_new_tokens(new_tokens)
    if len(ids) + new_tokens > lm.shape.context_length:
        raise PromptError("The prompt plus the new tokens would not fit in the model's context.")
    dev = lm.device

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    best_on = best_off = float("inf")
    with torch.inference_mode():
        for _ in range(max(1, repeats)):
            sync()
            t0 = time.perf_counter()
            cache = new_cache(lm)
            x = torch.tensor([ids], device=dev)
            out_on = []
            logits = forward_last(lm, x, cache)
            for _ in range(new_tokens):
                nxt = torch.argmax(logits).reshape(1, 1)
                out_on.append(nxt)
                logits = forward_last(lm, nxt, cache)
            out_on = [int(t) for t in torch.cat(out_on).flatten().tolist()]
            sync()
            best_on = min(best_on, time.perf_counter() - t0)
            del cache
            t0 = time.perf_counter()
            seq = torch.tensor([ids], device=dev)
            out_off = []
            for _ in range(new_tokens):
                logits = lm.model(input_ids=seq, use_cache=False, logits_to_keep=1).logits[0, -1]
                nxt = torch.argmax(logits).reshape(1, 1)
                out_off.append(nxt)
                seq = torch.cat([seq, nxt], 1)
            out_off = [int(t) for t in torch.cat(out_off).flatten().tolist()]
            sync()
            best_off = min(best_off, time.perf_counter() - t0)
    return {"prompt_tokens": len(ids), "new_tokens": new_tokens, "with_cache_s": best_on, "without_cache_s": best_off,
            "speedup": best_off / best_on if best_on > 0 else float("nan"),
            "with_cache_tok_s": new_tokens / best_on, "without_cache_tok_s": new_tokens / best_off,
            "same_tokens": out_on == out_off}
