"""Downloads of what a tab shows (issue 15 item 6): Explore's trace tensors as safetensors,
Generate's steps and Interventions' results as CSV + JSON.

The table builders are pure functions of the data the tabs keep (lists of dicts out); `write_*`
put the files into a fresh scratch folder (app.context.scratch_dir) that a gr.File output serves,
as Explore's JSON/CSV export does.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

from model_core.trace_io import save_trace


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(name))[:60].strip("-") or "model"


def _num(v):
    """JSON/CSV-safe number: NaN and infinities become empty."""
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


def write_csv(path: Path, rows: list[dict]) -> Path:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols or ["empty"])
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if _num(v) is None else v) for k, v in r.items()})
    return path


def write_json(path: Path, data) -> Path:
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return _num(x)
    path.write_text(json.dumps(clean(data), ensure_ascii=False, indent=1), encoding="utf-8")
    return path


# --- Explore: the trace itself ------------------------------------------------------------------

def trace_file(tr, folder: Path, settings: dict) -> Path:
    """The trace as `<model>-<T>tok.safetensors` in `folder` (model_core.trace_io: every captured
    tensor, the viewed layer's pattern, tokens, model id and these settings)."""
    return save_trace(tr, folder / f"trace-{_safe(tr.model_name)}-{tr.n_tokens}tok.safetensors", settings)


# --- Generate: one row per step -----------------------------------------------------------------

def steps_rows(steps: list[dict]) -> list[dict]:
    """Generate's steps as a table: the chosen token, its probability before and after the
    filters, rank, entropy, the top candidates before the filters and what removed them."""
    rows = []
    for s in steps or []:
        c = s.get("chosen") or {}
        top = s.get("top_before") or []
        rows.append({
            "step": s.get("index"), "position": s.get("position"), "token_id": c.get("id"),
            "token": c.get("token"), "shown": c.get("label") or c.get("display"),
            "prob": c.get("prob"), "prob_after_filters": c.get("prob_filtered"), "rank": c.get("rank"),
            "entropy": s.get("entropy"), "entropy_after_filters": s.get("entropy_filtered"),
            "candidates_kept": s.get("n_candidates"),
            "top_before": " | ".join(f"{t.get('token')} {t.get('prob', 0):.4f}"
                                     + (f" (removed by {t['removed_by']})" if t.get("removed_by") else "")
                                     for t in top[:10]),
            "seconds": s.get("seconds"),
        })
    return rows


def write_generation(st: dict, folder: Path) -> list[Path]:
    """steps.csv and generation.json (the settings, prompt, ids and every step's record)."""
    steps = list(st.get("steps") or [])
    meta = {k: st.get(k) for k in ("model", "prompt", "chat", "settings", "seed", "text", "prompt_len") if k in st}
    data = {**meta, "token_ids": st.get("ids"), "kv_cache": st.get("kv"), "steps": steps}
    return [write_csv(folder / "steps.csv", steps_rows(steps)), write_json(folder / "generation.json", data)]


# --- Interventions: ablation, patching, attribution ---------------------------------------------

def ablation_rows(d: dict) -> list[dict]:
    rows = [{"table": "next token", "token": t, "clean_prob": a, "ablated_prob": b, "layer": None}
            for t, a, b in zip(d.get("tokens", []), d.get("clean", []), d.get("ablated", []))]
    rows += [{"table": "logit lens", "layer": l, "token": d.get("follow"), "clean_prob": a, "ablated_prob": b,
              "clean_top": ct, "ablated_top": at}
             for l, a, b, ct, at in zip(d.get("layers", []), d.get("lens_clean", []), d.get("lens_ablated", []),
                                        d.get("top_clean", []), d.get("top_ablated", []))]
    return rows


def patching_rows(d: dict) -> list[dict]:
    labels = d.get("col_labels") or [str(c) for c in d.get("cols", [])]
    rows = []
    for i, layer in enumerate(d.get("rows", [])):
        for j, col in enumerate(d.get("cols", [])):
            rows.append({"layer": layer, ("head" if d.get("kind") == "heads" else "position"): col,
                         "label": labels[j] if j < len(labels) else col,
                         "value": d["values"][i][j], "delta": d["delta"][i][j],
                         "normalized": d["normalized"][i][j]})
    return rows


def attribution_rows(d: dict) -> list[dict]:
    rows = [{"part": "embedding", "layer": None, "head": None, "value": d.get("embed")}]
    for l, (a, m) in enumerate(zip(d.get("attn", []), d.get("mlp", []))):
        rows += [{"part": "attention", "layer": l, "head": None, "value": a},
                 {"part": "mlp", "layer": l, "head": None, "value": m}]
    for l, row in enumerate(d.get("heads", [])):
        rows += [{"part": "head", "layer": l, "head": h, "value": v} for h, v in enumerate(row)]
    return rows


def write_interventions(ablation: dict | None, patching: dict | None, attribution: dict | None,
                        folder: Path) -> list[Path]:
    """One CSV per result shown (ablation.csv, patching.csv, attribution.csv) and results.json."""
    out = []
    for name, d, rows in (("ablation", ablation, ablation_rows), ("patching", patching, patching_rows),
                          ("attribution", attribution, attribution_rows)):
        if d:
            out.append(write_csv(folder / f"{name}.csv", rows(d)))
    data = {k: v for k, v in (("ablation", ablation), ("patching", patching), ("attribution", attribution)) if v}
    out.append(write_json(folder / "results.json", data))
    return out
