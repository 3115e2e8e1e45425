"""The attribution graph's view: named supernodes (groups of nodes drawn as one), pinned nodes, and
"pinned only". It lives as JSON in a hidden box of the page, so the page can mirror it into the URL
(with the set, target and thresholds) and a link reproduces the view; everything read back from the
box or a link is checked here, as input from anyone."""

from __future__ import annotations

import json
import re

MAX_GROUPS = 24
MAX_MEMBERS = 256
MAX_PINS = 256
MAX_NAME = 40
MAX_JSON = 20_000
URL_KEYS = ["circuits", "ctarget", "cnode", "cedge", "cview"]  # set, target, thresholds, this view
NODE_ID = re.compile(r"^(F\d{1,3}\.\d{1,5}\.\d{1,8}|E\d{1,3}\.\d{1,5}|T\d{1,5}|logit)$")
_NAME = re.compile(r"^[\w .,:'()+\-]{1,40}$")


class ViewError(ValueError):
    pass


def empty() -> dict:
    return {"groups": {}, "pins": [], "pinned_only": False}


def dumps(view: dict) -> str:
    return json.dumps(view, separators=(",", ":"), ensure_ascii=False)


def _ids(xs, cap: int) -> list[str]:
    if not isinstance(xs, list):
        return []
    return list(dict.fromkeys(x for x in xs if isinstance(x, str) and NODE_ID.match(x)))[:cap]


def parse(text) -> dict:
    """A view from the page or a link; whatever does not fit the shape is left out."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_JSON:
        return empty()
    try:
        raw = json.loads(text)
    except ValueError:
        return empty()
    if not isinstance(raw, dict):
        return empty()
    groups, taken = {}, set()
    if isinstance(raw.get("groups"), dict):
        for name, members in list(raw["groups"].items())[:MAX_GROUPS]:
            ids = [m for m in _ids(members, MAX_MEMBERS) if m != "logit" and m not in taken]  # a node in one group
            if isinstance(name, str) and _NAME.match(name) and ids:
                groups[name] = ids
                taken.update(ids)
    return {"groups": groups, "pins": _ids(raw.get("pins"), MAX_PINS), "pinned_only": raw.get("pinned_only") is True}


def check_name(name) -> str:
    name = str(name or "").strip()
    if not name:
        raise ViewError("Name the supernode first (the box beside the button).")
    if not _NAME.match(name):
        raise ViewError(f"A supernode's name is up to {MAX_NAME} letters, digits, spaces or . , : ' ( ) + -.")
    return name


def chosen_ids(chosen, graph: dict) -> list[str]:
    """The chosen nodes that are in the graph (a group's member stays itself)."""
    known = {n["id"] for n in graph["nodes"]}
    return [c for c in (chosen or []) if isinstance(c, str) and c in known] if isinstance(chosen, list) else []


def group(view: dict, name, chosen: list[str]) -> tuple[dict, str]:
    """The chosen nodes become the supernode `name` (a node leaves any group it was in)."""
    name = check_name(name)
    members = [c for c in chosen if c != "logit"]
    if len(members) < 2:
        raise ViewError("Choose at least two nodes (click them in the graph) to group them.")
    if name not in view["groups"] and len(view["groups"]) >= MAX_GROUPS:
        raise ViewError(f"A view holds at most {MAX_GROUPS} supernodes; ungroup one first.")
    groups = {g: [m for m in ms if m not in members] for g, ms in view["groups"].items() if g != name}
    groups = {g: ms for g, ms in groups.items() if ms}
    groups[name] = members[:MAX_MEMBERS]
    return {**view, "groups": groups}, f"Grouped {len(members)} nodes as the supernode '{name}'."


def ungroup(view: dict, name) -> tuple[dict, str]:
    name = str(name or "").strip()
    if name not in view["groups"]:
        have = ", ".join(repr(g) for g in view["groups"]) or "none"
        raise ViewError(f"There is no supernode named {name!r} (the view has: {have}).")
    return {**view, "groups": {g: ms for g, ms in view["groups"].items() if g != name}}, f"Ungrouped '{name}'."


def toggle_pins(view: dict, chosen: list[str]) -> tuple[dict, str]:
    """Pins the chosen nodes; when every chosen node is pinned already, unpins them."""
    if not chosen:
        raise ViewError("Choose nodes (click them in the graph) to pin them.")
    pins = list(view["pins"])
    if all(c in pins for c in chosen):
        pins = [p for p in pins if p not in chosen]
        return {**view, "pins": pins}, f"Unpinned {len(chosen)} node(s)."
    pins = list(dict.fromkeys(pins + chosen))[:MAX_PINS]
    return {**view, "pins": pins}, f"Pinned {len(chosen)} node(s); {len(pins)} pinned in all."


def from_query(q: dict) -> dict | None:
    """A link's circuits keys -> the panel's values, or None when the link has none."""
    name = q.get("circuits")
    if not isinstance(name, str) or not name:
        return None

    def number(key, default):
        try:
            x = float(q.get(key, default))
        except (TypeError, ValueError):
            return default
        return x if 0 < x <= 1 else default
    return {"set": name[:120], "target": str(q.get("ctarget") or "")[:100], "node_threshold": number("cnode", 0.8),
            "edge_threshold": number("cedge", 0.98), "view": parse(q.get("cview"))}
