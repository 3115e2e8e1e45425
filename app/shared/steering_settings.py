"""A steering vector's settings from the page, checked, and the hook edits they make (Explore's
steered trace and the Generate tab's steering panel share them)."""

from __future__ import annotations

from collections import OrderedDict
from threading import Lock

from model_core.interp import steering as St

MY_PAIRS = "my pairs (JSONL below)"
_VECTORS: OrderedDict = OrderedDict()  # (model, pairs, layer, chat) -> SteeringVector, a few kept
_VECTORS_LOCK = Lock()
_KEEP = 8


def pairs_from(choice, text) -> list[St.SteeringPair]:
    """The chosen built-in set, or the user's JSONL (every malformed line named, by St.parse_pairs)."""
    if choice in St.BUILTIN_PAIRS:
        return St.builtin_pairs(choice)
    if choice == MY_PAIRS:
        return St.parse_pairs(text if isinstance(text, str) else "")
    raise St.SteeringError(f"Choose a pair set: {', '.join(St.BUILTIN_PAIRS)} or '{MY_PAIRS}'.")


def whole(value, what: str, lo: int, hi: int) -> int:
    """A whole number between lo and hi from a browser value, or one sentence."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise St.SteeringError(f"The {what} must be a whole number.") from None
    if f != f or f != int(f) or not lo <= f <= hi:
        raise St.SteeringError(f"The {what} must be a whole number from {lo} to {hi}.")
    return int(f)


def vector_for(lm, pairs, layer: int, chat: bool) -> St.SteeringVector:
    key = (lm.name, id(lm), tuple(pairs), layer, bool(chat))
    with _VECTORS_LOCK:
        if key in _VECTORS:
            _VECTORS.move_to_end(key)
            return _VECTORS[key]
    vec = St.steering_vector(lm, pairs, layer, chat=chat)
    with _VECTORS_LOCK:
        _VECTORS[key] = vec
        while len(_VECTORS) > _KEEP:
            _VECTORS.popitem(last=False)
    return vec


def steer_settings(choice, pairs_text, layer, alpha, from_pos) -> dict:
    """The steering settings of an Explore trace as its state keeps them (checked again whenever
    the trace is re-run: the state is data, not trust)."""
    return {"choice": choice if isinstance(choice, str) else "", "pairs": pairs_text if isinstance(pairs_text, str) else "",
            "layer": layer, "alpha": alpha, "from": from_pos}


def edits_for(lm, steer: dict) -> tuple[dict, str]:
    """({hook name: edit}, a line saying what was added) for steer_settings(...); one sentence
    (SteeringError) for any bad value."""
    layer = whole(steer.get("layer"), "steering layer", 0, lm.shape.n_layers - 1)
    from_pos = whole(steer.get("from"), "'from position'", 0, 100_000)
    alpha = St.check_alpha(steer.get("alpha"))
    vec = vector_for(lm, pairs_from(steer.get("choice"), steer.get("pairs")), layer, False)
    name = steer.get("choice") if steer.get("choice") in St.BUILTIN_PAIRS else "your pairs"
    where = f"from position {from_pos}" if from_pos else "at every position"
    return (St.steering_edits(lm, vec, alpha, from_position=from_pos),
            f"steered: {alpha:g}·v ({name}, {vec.n_pairs} pairs, |v| {vec.norm:.2f}) added to layer {layer}'s input "
            f"{where}")
