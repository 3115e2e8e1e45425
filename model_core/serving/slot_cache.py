"""A KV cache made for continuous batching: preallocated slots, one per running sequence.

Per layer the keys and values are one tensor each, [slots, kv_heads, max_len, head_dim], allocated
once. A sequence owns a slot from its prefill to its last token. A decode step runs the first
`rows` slots together; every row writes its one new key/value at its own position (`write_pos`)
and attends over the first `length` positions through a mask (`step_mask`), so rows of different
lengths share a step without padding or copying, and the tensors a CUDA graph captured stay valid.

transformers' attention layers call `cache.update(key, value, layer_idx)` and use what it returns
as the keys and values to attend over; that is all this class provides (like `StaticCache`, but
with a position per row instead of one `cache_position` for the whole batch).

Sliding-window layers keep every position too; their mask lets a row see only its last
`sliding_window` positions (transformers' `sliding_window_overlay`). A model that names its layers'
kinds (Gemma 3's local and global layers) gets one mask per layer type (`window` returns
{layer type: mask}); a model whose every layer slides (Mistral) gets the sliding mask itself.
"""

from __future__ import annotations

import torch


class SlotCache:
    def __init__(self, layer_shapes: list[tuple[int, int]], slots: int, max_len: int, dtype, device,
                 sliding_window: int | None = None, per_layer_type: bool = True):
        """layer_shapes: (kv_heads, head_dim) per layer; sliding_window: the window of the model's
        sliding layers (None: it has none); per_layer_type: the model names its layers' kinds
        (`config.layer_types`: Gemma, Qwen) and takes one mask per kind, else every layer slides
        (Mistral) and takes the sliding mask itself."""
        self.slots, self.max_len, self.sliding_window = slots, max_len, sliding_window
        self.per_layer_type = per_layer_type
        self.keys = [torch.zeros(slots, h, max_len, d, dtype=dtype, device=device) for h, d in layer_shapes]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.positions = torch.arange(max_len, device=device)  # [max_len]; a step's window is a prefix
        # index tensors of the cache write, made once: a step slices them (views, no kernels)
        self.slot_index = torch.arange(slots, device=device)[:, None]  # [slots, 1]
        self.head_index = {h: torch.arange(h, device=device)[None, :] for h, _ in layer_shapes}  # [1, kv_heads]
        # The window a step works on is carried by tensor shapes, not Python ints, so a compiled
        # forward sees the rows and the length as sizes (one compiled graph serves every bucket).
        self.write_pos: torch.Tensor | None = None  # [rows] int64
        self.span: torch.Tensor = self.positions  # [length]

    def layer_bytes_per_token(self) -> list[int]:
        """Bytes one token's key and value take in each layer's tensors (read off the tensors)."""
        return [k[0, :, 0].numel() * k.element_size() + v[0, :, 0].numel() * v.element_size()
                for k, v in zip(self.keys, self.values)]

    @property
    def allocated_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k in self.keys)

    def window(self, rows: int, length: int, write_pos: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The next forward runs slots [0, rows) and attends over positions [0, length); returns its
        attention mask (`step_mask`), or with sliding-window layers one per layer type (the
        mapping transformers' models take as `attention_mask`)."""
        self.write_pos, self.span = write_pos[:rows], self.positions[:length]
        full = step_mask(self.write_pos, self.span, self.keys[0].dtype)
        if self.sliding_window is None:
            return full
        if not self.per_layer_type:
            return step_mask(self.write_pos, self.span, self.keys[0].dtype, self.sliding_window)
        return {"full_attention": full,
                "sliding_attention": step_mask(self.write_pos, self.span, self.keys[0].dtype, self.sliding_window)}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key, value [rows, kv_heads, 1, head_dim] -> every row's keys/values [rows, kv_heads, length, head_dim]."""
        rows, length = self.write_pos.shape[0], self.span.shape[0]
        K, V = self.keys[layer_idx], self.values[layer_idx]
        # one index_put_ into the whole tensor: torch.compile turns it back into an in-place write,
        # where a scatter_ into the slice [:rows] became a copy of the whole cache every layer
        # (1.3 of 3.1 ms of a 32-row step on an H200, bench/decode_forward.py --profile)
        at = (self.slot_index[:rows], self.head_index[int(K.shape[1])],
              self.write_pos[:, None])  # [rows, 1], [1, kv_heads], [rows, 1] -> [rows, kv_heads]
        K.index_put_(at, key[:, :, 0].to(K.dtype))  # key [rows, kv_heads, 1, D] -> [rows, kv_heads, D]
        V.index_put_(at, value[:, :, 0].to(V.dtype))
        return K[:rows, :, :length], V[:rows, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    @property
    def is_initialized(self) -> bool:
        """transformers 5's Cache API (a model's forward may ask): the tensors exist from the start and
        a row's prefill is loaded before its first step, so a step never sees an empty cache."""
        return True

    def load_rows(self, slots: torch.Tensor, prefill_cache, tokens: int) -> None:
        """Copy every row of a prefill's DynamicCache (row i -> slot slots[i]), its first `tokens`
        positions, with one copy per layer. Every layer of that cache must hold every position
        (`full_prefill_cache`: transformers' sliding-window layers keep only the last few). Positions past a row's own prompt hold the padding's
        keys: never attended (a row writes position p before it attends over 0..p)."""
        n = len(slots)  # a captured prefill's cache has its bucket's rows: the first n are these
        for l, layer in enumerate(prefill_cache.layers):
            self.keys[l][slots, :, :tokens] = layer.keys[:n, :, :tokens].to(self.keys[l].dtype)
            self.values[l][slots, :, :tokens] = layer.values[:n, :, :tokens].to(self.values[l].dtype)


def step_mask(write_pos: torch.Tensor, span: torch.Tensor, dtype, sliding_window: int | None = None) -> torch.Tensor:
    """write_pos [rows], span [length] (0..length-1) -> additive attention mask [rows, 1, 1, length]:
    row b sees keys 0..write_pos[b], or with a sliding window only the last `sliding_window` of them."""
    allowed = span[None, :] <= write_pos[:, None]  # [rows, length]
    if sliding_window is not None:
        allowed &= span[None, :] > write_pos[:, None] - sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=write_pos.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None, None, :]
