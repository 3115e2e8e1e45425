"""The model's module tree with each module's output shape for the current prompt, from one
forward pass with a hook on every module; tied weights counted once.
"""

from __future__ import annotations

import pandas as pd
import torch


def module_tree(lm, token_ids, collapse_layers: bool = True) -> list[dict]:
    """One forward pass with a forward hook on every module; rows in execution order:
    {path, depth, module, shape (output, batch dim dropped), params}. With collapse_layers, only
    layer 0 is listed in full and the other layers are one summary row."""
    model, ad = lm.model, lm.adapter
    names = {id(m): n for n, m in model.named_modules()}
    layer_paths = [names[id(l)] for l in ad.layers]
    rows: list[dict] = []
    handles = []

    entered: dict[str, int] = {}

    def pre(module, inputs):
        entered.setdefault(names[id(module)], len(entered))

    def hook(module, inputs, output):
        out = output[0] if isinstance(output, (tuple, list)) else output
        for attr in ("logits", "last_hidden_state"):
            if hasattr(out, attr):
                out = getattr(out, attr)
                break
        shape = tuple(out.shape[1:]) if torch.is_tensor(out) and out.dim() >= 1 else None
        rows.append({"path": names[id(module)], "module": type(module).__name__,
                     "shape": list(shape) if shape is not None else None,
                     "params": sum(p.numel() for p in module.parameters(recurse=False)),
                     "_tensors": [(id(p), p.numel()) for p in module.parameters(recurse=False)]})

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([list(token_ids)], device=lm.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    # forward hooks fire on exit: list modules in the order they were entered (parents first)
    rows.sort(key=lambda r: entered[r["path"]])
    dedup, seen = [], set()
    for r in rows:  # a module called twice (rotary embedding per layer type) keeps its first row
        if r["path"] in seen:
            continue
        seen.add(r["path"])
        r["depth"] = 0 if r["path"] == "" else r["path"].count(".") + 1
        r["path"] = r["path"] or type(model).__name__
        dedup.append(r)
    # tied weights: a tensor is counted at the first module (in running order) that owns it; a later
    # owner (a tied lm_head) shows its size with a note, so the "counted" column sums to the total
    owner: dict[int, str] = {}
    for r in dedup:
        r["counted"], tied = 0, []
        for pid, n in r.pop("_tensors"):
            if pid in owner:
                tied.append(owner[pid])
            else:
                owner[pid] = r["path"]
                r["counted"] += n
        r["tied_to"] = tied[0] if tied else None
    total = sum(r["counted"] for r in dedup)
    # the layer list (a ModuleList) is never called, so no hook names it: add its row before layer 0
    list_path = layer_paths[0].rsplit(".", 1)[0] if "." in layer_paths[0] else None
    if list_path is not None and list_path not in seen:
        at = next(i for i, r in enumerate(dedup) if r["path"] == layer_paths[0])
        dedup.insert(at, {"path": list_path, "module": f"ModuleList ({len(layer_paths)} × {type(ad.layers[0]).__name__})",
                          "shape": None, "params": 0, "counted": 0, "tied_to": None, "depth": list_path.count(".") + 1})
    total_row = {"path": "total (each tensor counted once)", "module": "", "shape": None, "params": total,
                 "counted": total, "tied_to": None, "depth": 0, "total": True}
    if not collapse_layers or len(layer_paths) < 3:
        return dedup + [total_row]
    out, skipped, skipped_params = [], 0, 0
    keep = (layer_paths[0], layer_paths[-1])
    for r in dedup:
        in_layer = next((lp for lp in layer_paths if r["path"] == lp or r["path"].startswith(lp + ".")), None)
        if in_layer is not None and in_layer not in keep:
            if r["path"] == in_layer:
                skipped += 1
            skipped_params += r["counted"]
            continue
        if in_layer == layer_paths[-1] and r["path"] == in_layer and skipped:
            out.append({"path": f"… {skipped} more layers, same shapes as layer 0", "module": "",
                        "shape": None, "params": skipped_params, "counted": skipped_params, "tied_to": None,
                        "depth": r["depth"]})
        out.append(r)
    return out + [total_row]


def tree_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows indented by depth; a layer of the layer list is named with its list (layers.0, h.0)."""
    data = []
    for r in rows:
        indent = "\u2003" * max(0, r["depth"])
        parts = r["path"].split(".")
        leaf = r["path"] if not r["depth"] else parts[-1]
        if r["depth"] and len(parts) >= 2 and parts[-1].isdigit():
            leaf = ".".join(parts[-2:])
        if r["path"].startswith("…"):
            leaf = r["path"]
        if r.get("total"):
            leaf = r["path"]
        shape = "[" + ", ".join(str(s) for s in r["shape"]) + "]" if r["shape"] else ""
        params = f"{r['params']:,}" if r["params"] else ""
        if r.get("tied_to"):
            params += f" (tied to {r['tied_to']}: the same tensor, counted there)"
        data.append({"module": indent + leaf, "type": r["module"], "output shape": shape, "params": params})
    return pd.DataFrame(data)
