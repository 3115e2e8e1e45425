"""Hook edits the inference engine can also run per row of a batched decode step.

A hook edit is any `fn(hook_name, x) -> x'` (model_core.core.hooks). The ones here are typed: each
is still that function (a prompt's forward, a prefill, the request path call it as it is), and it
also says how to write itself into a `RowSlot`, per-row buffers of fixed shape that a decode step
reads at its hook point. A captured step (CUDA graph, TorchScript recording) holds the slot's
addresses, so rows with different edits, or none, share one captured step: a row without the edit
holds the identity (zeros to add, ones to keep) and its values come out bit for bit unchanged.

Edits whose shape fits no slot (a mean ablation: its mean is over the positions of one forward)
stay plain functions, and their generations run on the request's own forwards.

Shapes: a decode step's hook value x is [B, 1, w] (or [B, w] where a family flattens positions);
a slot's buffers are [S, w] over the engine's S slots, and a step reads their first B rows.
"""

from __future__ import annotations

import copy

import torch


class RowSlot:
    """Per-row buffers for one (hook, kind) of edit: `reset` a row to the identity, `write` an edit
    into a row, `apply` the first B rows to a decode step's value at the hook. `BUFFERS` names the
    attributes that hold per-row tensors (what a recording takes as inputs)."""

    BUFFERS: tuple[str, ...] = ()

    def __init__(self, name: str, slots: int):
        self.name, self.slots = name, slots

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, b) for b in self.BUFFERS]

    def reset(self, row: int) -> None:
        raise NotImplementedError

    def write(self, row: int, edit: RowEdit) -> None:
        raise NotImplementedError

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scratch(self) -> RowSlot:
        """A slot of the same shapes on storage of its own (what a recording is made on); anything
        else it holds (an autoencoder's weights) is shared."""
        s = copy.copy(self)
        for b in self.BUFFERS:
            setattr(s, b, getattr(self, b).clone())
        return s


def _per_row(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The first B rows of a [S, w] buffer shaped to broadcast over x [B, 1, w] or [B, w]."""
    B = x.shape[0]
    return t[:B].view(B, *([1] * (x.dim() - 2)), t.shape[-1])


class RowEdit:
    """A hook edit with a per-row form. Subclasses are called as hook edits and name their slot."""

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def slot_key(self, name: str) -> tuple:
        """Edits with the same key share a slot (one row each)."""
        raise NotImplementedError

    def new_slot(self, name: str, slots: int, dtype: torch.dtype, device: torch.device) -> RowSlot:
        raise NotImplementedError

    def runs_on(self, device: torch.device) -> bool:
        """Whether a step on `device` can run it (what it holds lives there or moves there)."""
        return True


class AddSlot(RowSlot):
    BUFFERS = ("vec",)

    def __init__(self, name: str, slots: int, width: int, dtype, device):
        super().__init__(name, slots)
        self.vec = torch.zeros(slots, width, dtype=dtype, device=device)  # [S, w]

    def reset(self, row):
        self.vec[row].zero_()

    def write(self, row, edit):
        self.vec[row].copy_(edit.vector.to(self.vec.dtype))

    def apply(self, x):
        return x + _per_row(self.vec, x)


class AddVector(RowEdit):
    """x + v at positions >= start of each forward (a decode step's one position always counts as
    later): a steering vector, already scaled. v [w] float32, cast to the model's dtype when added."""

    def __init__(self, vector: torch.Tensor, start: int = 0):
        self.vector, self.start = vector.detach().float(), max(0, int(start))
        self._cast: dict = {}

    def _v(self, x):
        key = (x.device, x.dtype)
        if key not in self._cast:
            self._cast[key] = self.vector.to(device=x.device, dtype=x.dtype)
        return self._cast[key]

    def __call__(self, name, x):  # x [B, T, w]
        if self.start == 0 or x.shape[1] == 1:
            return x + self._v(x)
        out = x.clone()
        out[:, self.start:] += self._v(x)
        return out

    def slot_key(self, name):
        return (name, "add")

    def new_slot(self, name, slots, dtype, device):
        return AddSlot(name, slots, self.vector.shape[-1], dtype, device)


class KeepSlot(RowSlot):
    BUFFERS = ("keep",)

    def __init__(self, name: str, slots: int, width: int, dtype, device):
        super().__init__(name, slots)
        self.keep = torch.ones(slots, width, dtype=dtype, device=device)  # [S, w]: 1 keeps, 0 zeroes

    def reset(self, row):
        self.keep[row].fill_(1)

    def write(self, row, edit):
        self.keep[row].fill_(1)
        self.keep[row, edit.index.to(self.keep.device) if edit.index is not None else slice(None)] = 0

    def apply(self, x):
        return x * _per_row(self.keep, x)


class ZeroColumns(RowEdit):
    """Zero the last dimension's columns `index` (None: all of them) at every position: a zero
    ablation of heads (hook_z's columns of those heads), neurons (hook_post) or a whole MLP's output."""

    def __init__(self, width: int, index: torch.Tensor | None = None):
        self.width, self.index = int(width), None if index is None else torch.as_tensor(index, dtype=torch.long)

    def __call__(self, name, x):
        if self.index is None:
            return torch.zeros_like(x)
        x = x.clone()
        x[..., self.index.to(x.device)] = 0
        return x

    def slot_key(self, name):
        return (name, "keep")

    def new_slot(self, name, slots, dtype, device):
        return KeepSlot(name, slots, self.width, dtype, device)


def same_device(a, b) -> bool:
    """cuda and cuda:0 are one device (a model reports the one, a tensor the other)."""
    a, b = torch.device(a), torch.device(b)
    cuda_index = lambda d: (d.index or 0) if d.type == "cuda" else d.index  # noqa: E731
    return a.type == b.type and cuda_index(a) == cuda_index(b)


def engine_runnable(edits: dict | None, device: torch.device) -> bool:
    """Whether every edit of a request has a per-row form the engine on `device` runs."""
    return all(isinstance(e, RowEdit) and e.runs_on(device) for e in (edits or {}).values())
