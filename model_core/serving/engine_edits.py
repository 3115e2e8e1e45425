"""The engine's per-row edits: which rows steer, clamp or ablate, in buffers a captured step reads.

A request's edits (model_core.core.row_edits: steering vectors, feature clamps, zero ablations)
are written into `RowSlot`s, one per (hook, kind) of edit in use, one row per engine slot. A launch
whose rows use some slots runs the decode step with those slots' `apply` as hook edits (its
"signature": the slots' keys); rows without an edit hold the identity there. So a steered row
batches with plain ones, and each signature is one more captured step per bucket, not one per
request. A launch with no edited row runs the plain step, untouched.

The prefill of a batch with edited requests runs eagerly, each row's edits applied to its own row
as plain hook edits (`prefill_edits`: the same functions the request path calls, on [1, T, w]).
"""

from __future__ import annotations

import torch

from model_core.core.row_edits import RowSlot, engine_runnable

MAX_SLOTS = 32  # (hook, kind) slots held at once; idle ones go first when a new one is needed


class EditSlotsFull(RuntimeError):
    pass


class EditSlots:
    """The engine's RowSlots by key, and which rows use which."""

    def __init__(self, slots: int, dtype: torch.dtype, device: torch.device, running=lambda: (), graphs=None):
        self.slots, self.dtype, self.device = slots, dtype, device
        self.running = running  # () -> the engine slots whose rows are running
        self.graphs = graphs  # StepGraphs: captured steps that read a dropped slot go with it
        self.by_key: dict[tuple, RowSlot] = {}
        self.row_keys: dict[int, tuple] = {}  # engine slot -> the keys its request uses (a launch's signature)
        self._edits: dict[tuple, dict] = {}  # signature -> its hook edits (made once, read every launch)

    def runnable(self, edits: dict | None) -> bool:
        return engine_runnable(edits, self.device)

    def admit(self, row: int, edits: dict | None) -> None:
        """Row `row` starts a request: the identity in every slot, then its own edits written in."""
        for slot in self.by_key.values():
            slot.reset(row)
        keys = []
        for name, edit in (edits or {}).items():
            key = edit.slot_key(name)
            slot = self.by_key.get(key)
            if slot is None:
                slot = self._new(key, name, edit)
            slot.write(row, edit)
            keys.append(key)
        self.row_keys[row] = tuple(keys)

    def release(self, row: int) -> None:
        self.row_keys.pop(row, None)

    def _new(self, key: tuple, name: str, edit) -> RowSlot:
        if len(self.by_key) >= MAX_SLOTS:
            in_use = {k for row in self.running() for k in self.row_keys.get(row, ())}
            idle = [k for k in self.by_key if k not in in_use]
            for k in idle:
                del self.by_key[k]
            self._edits = {sig: e for sig, e in self._edits.items() if not set(idle) & set(sig)}
            if idle and self.graphs is not None:
                self.graphs.drop_edited(set(idle))
            if len(self.by_key) >= MAX_SLOTS:
                raise EditSlotsFull(f"This server runs at most {MAX_SLOTS} different edits at once; "
                                    "run it again when a running edited generation has finished.")
        slot = edit.new_slot(name, self.slots, self.dtype, self.device)
        self.by_key[key] = slot
        return slot

    def signature(self, slots: list[int]) -> tuple:
        """The keys the rows in these engine slots use, in the registry's order (() : none)."""
        if not self.by_key:  # no request has edited yet: every launch is plain
            return ()
        used = {k for s in slots for k in self.row_keys.get(s, ())}
        return tuple(k for k in self.by_key if k in used) if used else ()

    def slots_of(self, signature: tuple) -> list[RowSlot]:
        return [self.by_key[k] for k in signature]

    def hook_edits(self, signature: tuple) -> dict:
        """hook_edits of the signature's slots, made on its first launch."""
        edits = self._edits.get(signature)
        if edits is None:
            edits = self._edits[signature] = hook_edits(self.slots_of(signature))
        return edits


def hook_edits(slots: list[RowSlot]) -> dict:
    """{hook name: edit} applying each slot's rows at its hook (several slots at one hook in order)."""
    by_name: dict[str, list[RowSlot]] = {}
    for s in slots:
        by_name.setdefault(s.name, []).append(s)

    def chain(ss):
        def edit(name, x):
            for s in ss:
                x = s.apply(x)
            return x
        return edit

    return {name: chain(ss) for name, ss in by_name.items()}


def prefill_edits(per_row: list[dict | None]) -> dict:
    """{hook name: edit} for one padded prefill of several requests: row i's own edit (the function
    its request path would call) applied to row i alone, [1, T, w]; rows without one stay as they are.
    (A row's padding comes after its last token: what an edit does there no position reads.)"""
    names = dict.fromkeys(n for e in per_row if e for n in e)

    def for_name(name):
        rows = [(i, e[name]) for i, e in enumerate(per_row) if e and name in e]

        def edit(n, x):  # x [N, T, w]
            out = x.clone()
            for i, fn in rows:
                out[i:i + 1] = fn(n, x[i:i + 1])
            return out
        return edit

    return {name: for_name(name) for name in names}


def slot_tensors(slots: list[RowSlot]) -> list[torch.Tensor]:
    return [t for s in slots for t in s.tensors()]
