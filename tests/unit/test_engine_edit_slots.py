"""The engine's edit slots (model_core.serving.engine_edits.EditSlots): each row's edits written in
and reset, a launch's signature, idle slots dropped when the registry is full (with the captured
steps that read them), and one sentence when every slot is in use."""

import pytest
import torch

from model_core.core.row_edits import AddVector, ZeroColumns
from model_core.serving import engine_edits as E


class _Graphs:
    """Stands in for StepGraphs' one method the registry calls."""

    def __init__(self):
        self.dropped = []

    def drop_edited(self, keys):
        self.dropped.append(keys)


def test_rows_write_reset_and_sign_their_launch():
    running = [0, 1]
    slots = E.EditSlots(3, torch.float32, torch.device("cpu"), lambda: running)
    add = {"blocks.2.hook_resid_pre": AddVector(torch.ones(4))}
    slots.admit(0, add)
    slots.admit(1, {"blocks.1.hook_z": ZeroColumns(4, [1, 2])})
    assert slots.signature([0]) == (("blocks.2.hook_resid_pre", "add"),)
    assert len(slots.signature([0, 1])) == 2 and slots.signature([2]) == ()
    (a, k) = slots.slots_of(slots.signature([0, 1]))
    assert a.vec[0].tolist() == [1.0] * 4 and a.vec[1].tolist() == [0.0] * 4
    assert k.keep[1].tolist() == [1.0, 0.0, 0.0, 1.0] and k.keep[0].tolist() == [1.0] * 4
    copy = a.scratch()  # what a recording is made on: equal values, storage of its own
    assert torch.equal(copy.vec, a.vec) and copy.vec.data_ptr() != a.vec.data_ptr() and copy.tensors() == [copy.vec]
    slots.admit(0, None)  # a plain request in row 0: the identity everywhere
    assert a.vec[0].tolist() == [0.0] * 4 and slots.signature([0]) == ()
    x = torch.randn(3, 1, 4)
    assert torch.equal(a.apply(x), x)  # zeros added change no bit


def test_a_full_registry_drops_idle_slots_and_refuses_with_a_sentence(monkeypatch):
    monkeypatch.setattr(E, "MAX_SLOTS", 2)
    running, graphs = [0, 1], _Graphs()
    slots = E.EditSlots(2, torch.float32, torch.device("cpu"), lambda: running, graphs)
    slots.admit(0, {"blocks.0.hook_resid_pre": AddVector(torch.ones(4))})
    slots.admit(1, {"blocks.1.hook_resid_pre": AddVector(torch.ones(4))})
    with pytest.raises(E.EditSlotsFull, match="at most 2 different edits"):
        slots.admit(1, {"blocks.3.hook_resid_pre": AddVector(torch.ones(4))})
    running.remove(1)  # row 1 finished: its slot is idle
    slots.admit(1, {"blocks.3.hook_resid_pre": AddVector(torch.ones(4))})
    assert graphs.dropped == [{("blocks.1.hook_resid_pre", "add")}]
    assert set(slots.by_key) == {("blocks.0.hook_resid_pre", "add"), ("blocks.3.hook_resid_pre", "add")}
