"""The Fine-tune tab's runs table as files: runs.csv as shown and runs.json as the jobs recorded them."""

from pathlib import Path

from app.shared.exports import header_only_csv, table_rows, write_csv, write_json
from app.tabs.finetune.figures import runs_table


def runs_rows(records: list[dict]) -> list[dict]:
    """The Fine-tune tab's runs table (app.tabs.finetune.figures.runs_table) as rows, one per run, with its
    job id first."""
    rows = table_rows(runs_table(records))
    return [{"job": rec.get("id"), **row} for rec, row in zip(records, rows)]


def write_runs(records: list[dict], folder: Path) -> list[Path]:
    """runs.csv (the table as shown, with job ids) and runs.json (each run's id, state, settings,
    metrics, held-out accuracy before/after and loss history, as its job recorded them)."""
    recs = [r for r in records or [] if isinstance(r, dict)]
    keep = ("metrics", "accuracy_before", "accuracy_after", "dataset_lines", "model_name", "history")
    data = [{"job": r.get("id"), "state": r.get("state"), "params": r.get("params") or {},
             "created": r.get("created"), "started": r.get("started"), "finished": r.get("finished"),
             **{k: (r.get("sft") or {}).get(k) for k in keep if (r.get("sft") or {}).get(k) is not None}}
            for r in recs]
    rows = runs_rows(recs)
    return [write_csv(folder / "runs.csv", rows) if rows else header_only_csv(folder / "runs.csv", ["job"]),
            write_json(folder / "runs.json", {"runs": data})]
