"""Downloads of what a tab shows (issue 15 item 6): Explore's trace tensors as safetensors,
Generate's steps and Interventions' results as CSV + JSON.

The table builders are pure functions of the data the tabs keep (lists of dicts out); `write_*`
put the files into a fresh scratch folder (app.shared.context.scratch_dir) that a gr.File output serves,
as Explore's JSON/CSV export does.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

from model_core.interp.trace_io import save_trace


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
    """The trace as `<model>-<T>tok.safetensors` in `folder` (model_core.interp.trace_io: every captured
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


# --- any table a tab shows (a gr.Dataframe's value) ---------------------------------------------

def table_rows(table, columns: list[str] | None = None) -> list[dict]:
    """A table as a tab shows it (a pandas DataFrame, or a list of rows with `columns`) -> one dict
    per row, keyed by the column headers, numbers as numbers."""
    if table is None:
        return []
    if hasattr(table, "to_dict") and hasattr(table, "columns"):  # a pandas DataFrame (a gr.Dataframe's value)
        columns = [str(c) for c in table.columns]
        values = table.values.tolist()
    else:
        values = [list(r) for r in table]
        columns = list(columns or [f"column {i + 1}" for i in range(max((len(r) for r in values), default=0))])
    out = []
    for row in values:
        out.append({c: _plain(v) for c, v in zip(columns, row)})
    return out


def _plain(v):
    """numpy scalars and the like as plain Python values."""
    if hasattr(v, "item") and not isinstance(v, (list, tuple, dict, str, bytes)):
        try:
            return v.item()
        except (ValueError, AttributeError):
            return v
    return v


def write_table(table, folder: Path, name: str, columns: list[str] | None = None, meta: dict | None = None) -> list[Path]:
    """`<name>.csv` (the rows as shown) and `<name>.json` ({"columns", "rows", **meta})."""
    rows = table_rows(table, columns)
    cols = list(rows[0]) if rows else list(columns or [])
    return [write_csv(folder / f"{name}.csv", rows) if rows else header_only_csv(folder / f"{name}.csv", cols),
            write_json(folder / f"{name}.json", {**(meta or {}), "columns": cols, "rows": rows})]


def header_only_csv(path: Path, cols: list[str]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerow(cols or ["empty"])
    return path


# --- Explore: what each sampling stage did ------------------------------------------------------

STAGE_COLUMNS = ["stage", "removed", "mass_kept"]


def stage_rows(next_view: dict) -> list[dict]:
    """Explore's stage table (app.tabs.explore.views.next_token_view's "stages"): one row per stage after the
    model's own distribution: how many tokens it removed and the mass it kept of what entered it."""
    return [{"stage": s["stage"], "removed": int(s["removed"]), "mass_kept": float(s["mass_kept"])}
            for s in (next_view or {}).get("stages", [])]


def write_stages(next_view: dict, folder: Path, meta: dict | None = None) -> list[Path]:
    """stages.csv (the table) and stages.json: the settings in `meta` (model, prompt, temperature,
    top-k, top-p, min-p, repetition penalty, epsilon, eta), the summary line, the stages, and the
    top tokens with their probability before and after the filters and the stage that removed each."""
    nv = next_view or {}
    top = [{"token": t, "prob": float(b), "prob_after_filters": float(f), "removed_by": r or None}
           for t, b, f, r in zip(nv.get("tokens", []), nv.get("base", []), nv.get("final", []),
                                 nv.get("removed_by", []))]
    data = {**(meta or {}), "summary": nv.get("summary"), "stages": stage_rows(nv), "top_tokens": top}
    rows = stage_rows(nv)
    return [write_csv(folder / "stages.csv", rows) if rows else header_only_csv(folder / "stages.csv", STAGE_COLUMNS),
            write_json(folder / "stages.json", data)]


# --- Generate: the N samples table --------------------------------------------------------------

SAMPLE_COLUMNS = ["seed", "text", "tokens", "mean p", "finish"]


def samples_rows(table) -> tuple[list[dict], str]:
    """Generate's samples table (rows [seed, text, tokens, mean p, finish] and, once all are drawn,
    a last row ["", "k distinct texts out of n", ...]) -> (one dict per sample, the summary line)."""
    rows, summary = [], ""
    for r in table_rows(table, SAMPLE_COLUMNS):
        seed = r.get("seed")
        if seed in ("", None) or (isinstance(seed, float) and math.isnan(seed)):
            summary = str(r.get("text") or "")
            continue
        rows.append({"seed": int(seed), "text": r.get("text"), "tokens": _int_or(r.get("tokens")),
                     "mean_p": _num(float(r["mean p"])) if r.get("mean p") not in ("", None) else None,
                     "finish": r.get("finish")})
    return rows, summary


def _int_or(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return v


def write_samples(table, folder: Path, meta: dict | None = None) -> list[Path]:
    """samples.csv (one row per sample) and samples.json ({**meta, "summary", "samples"})."""
    rows, summary = samples_rows(table)
    cols = ["seed", "text", "tokens", "mean_p", "finish"]
    return [write_csv(folder / "samples.csv", rows) if rows else header_only_csv(folder / "samples.csv", cols),
            write_json(folder / "samples.json", {**(meta or {}), "summary": summary, "samples": rows})]


