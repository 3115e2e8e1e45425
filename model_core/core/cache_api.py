"""transformers' cache API across the 5.x versions this project runs on (one place to adapt).

transformers >= 5.2x names the forward's cache argument `cache`; earlier 5.x `past_key_values`.
"""

from __future__ import annotations

import inspect

_CACHE_KW: dict = {}


def cache_kwarg(model) -> str:
    """The name of `model.forward`'s cache argument."""
    key = type(model)
    if key not in _CACHE_KW:
        params = inspect.signature(model.forward).parameters
        _CACHE_KW[key] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KW[key]


def new_cache(lm):
    """An empty DynamicCache for the model (layer types from its config)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=lm.model.config)
    except TypeError:  # very old signature
        return DynamicCache()


def full_prefill_cache(lm):
    """A DynamicCache whose every layer keeps every position, sliding-window layers included (the
    engine copies a prefill's keys and values into its slots position by position; the model's
    masks still apply each layer's window). For a model without sliding-window layers, new_cache."""
    from transformers import DynamicCache

    if sliding_window_of(lm) is None:
        return new_cache(lm)
    return DynamicCache()


def sliding_window_of(lm) -> int | None:
    """The window of the model's sliding-window layers (its adapter's `sliding_window`), or None."""
    return next((w for w in map(lm.adapter.sliding_window, range(lm.shape.n_layers)) if w), None)


def crop_to(cache, length: int) -> None:
    """Drop the cache's positions past `length`. A negative count to remove is what every 5.x takes
    (5.2x refuses the absolute length earlier versions took)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)
