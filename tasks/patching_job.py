"""Whole-model activation-patching sweeps as a background job: model_core.interp.interventions.patch_residual
(layers x positions) or patch_heads (layers x heads) on the worker, result saved as patching.json.

Params: model, clean, corrupted, target, other (optional: then the metric is the logit difference
target - other, else log p(target)), sweep ('residual' | 'heads'), align ('error' | 'right'),
batch_size (optional; default: model_core's token budget), layers / positions (optional subsets).

Progress: 'loading model' (0-3 %), 'clean and corrupted runs' (3-5 %), 'patching' (5-97 %, one step
per layer of each batch of patched runs), 'saving' (97-100 %). Cancel: the progress callback raises
between layers when the cancel flag is set (the revoke from jobs.cancel_job also terminates the process).
Claim, heartbeat, cancel and the job's ending are tasks.lifecycle's.
"""

from __future__ import annotations

import time

from model_core.core.errors import SettingsError
from tasks import kinds
from tasks.celery_app import app
from tasks.lifecycle import Done, Job, JobTask, read_json_artifact

SWEEPS = ("residual", "heads")
MAX_PROMPT_CHARS = 20_000
_PUSH_EVERY_S = 0.25  # at most this often a progress write to the record from the batch loop


def validate_params(params: dict) -> dict:
    """Normalise and check what can be checked without the model; one sentence on bad input."""
    p = dict(params or {})
    for k in ("model", "clean", "corrupted", "target"):
        v = p.get(k)
        if not isinstance(v, str) or not v.strip():
            raise SettingsError(f"A patching job needs '{k}'.")
        if len(v) > MAX_PROMPT_CHARS:
            raise SettingsError(f"'{k}' is longer than {MAX_PROMPT_CHARS} characters.")
    p["model"] = p["model"].strip()
    p["other"] = p.get("other") or None
    sweep = {"resid": "residual"}.get(p.get("sweep") or "residual", p.get("sweep") or "residual")
    if sweep not in SWEEPS:
        raise SettingsError(f"Unknown sweep '{sweep}'; use 'residual' or 'heads'.")
    p["sweep"] = sweep
    p["align"] = p.get("align") or "error"
    if p["align"] not in ("error", "right"):
        raise SettingsError("align must be 'error' or 'right'.")
    p["batch_size"] = kinds.int_setting(p, "batch_size", None, 1, 1 << 20)
    for k in ("layers", "positions"):
        v = p.get(k)
        try:
            p[k] = None if v in (None, "", []) else [int(x) for x in v]
        except (TypeError, ValueError):
            raise SettingsError(f"'{k}' must be a list of whole numbers.") from None
    return p


def _model(name: str):
    """model_core keeps loaded models cached per process; no hub downloads from a job."""
    from model_core import load_model

    return load_model(name, allow_hub=False)


def labels(lm, result) -> tuple[list[str], list[str]]:
    """Row and column labels for the heatmap: L<layer>; '<pos>:<token>' or H<head>."""
    rows = [f"L{l}" for l in result.rows]
    if result.kind == "heads":
        return rows, [f"H{h}" for h in result.cols]
    toks = [repr(lm.tokenizer.decode([int(t)]))[1:-1] or "∅" for t in result.corrupted_ids]
    return rows, [f"{p}:{toks[p]}" for p in result.cols]


def run_sweep(lm, params: dict, progress=None):
    """The sweep itself (also what the tests compare against): a PatchingResult."""
    from model_core.interp.interventions import make_metric, patch_heads, patch_residual

    m = make_metric(lm, params["target"], params.get("other"))
    kw = dict(align=params["align"], batch_size=params.get("batch_size"), progress=progress,
              layers=params.get("layers"))
    if params["sweep"] == "heads":
        return patch_heads(lm, params["clean"], params["corrupted"], m, **kw)
    return patch_residual(lm, params["clean"], params["corrupted"], m, positions=params.get("positions"), **kw)


@app.task(bind=True, base=JobTask, name="lmscope.patching_sweep")
def run_patching(self, job: Job) -> Done:
    params = validate_params(job.params)
    job.stage("loading model", 0.01, f"loading {params['model']}")
    lm = _model(params["model"])
    job.stage("clean and corrupted runs", 0.03, f"{params['sweep']} sweep on {lm.shape.n_layers} layers")
    job.cancel_note = "cancelled during the sweep"
    t0 = time.time()
    # called as each layer of a batch starts: stops if cancelled, else reports
    res = run_sweep(lm, params, progress=job.ticker("patching", 0.05, 0.97, _PUSH_EVERY_S))
    job.check_cancel()
    secs = time.time() - t0
    job.stage("saving", 0.97, f"{res.values.numel()} cells in {res.n_forward} forward passes "
                              f"(batches of {res.batch_size}), {secs:.2f} s")
    rows, cols = labels(lm, res)
    path = job.write_json("patching.json", {
        **res.to_dict(), "model": params["model"], "sweep": params["sweep"], "params": params,
        "row_labels": rows, "col_labels": cols, "metric_description": res.metric.describe(lm)})
    n = res.normalized
    return job.done(f"done: clean {res.clean_value:.3f}, corrupted {res.corrupted_value:.3f}, "
                    f"max restored {float(n.nan_to_num(nan=-1e9).max()):.2f}", path)


def read_result(rec: dict) -> dict | None:
    """The patching.json of a finished job, or None."""
    return read_json_artifact(rec, "patching.json")


# ---- CLI: `lmscope jobs submit patching ...` -----------------------------------------------

def add_arguments(s) -> None:
    add = kinds.options(s, "patching (kind 'patching': activation-patching sweep, clean -> corrupted)")
    add("--model", default=None, help="model name (default: the default model)")
    add("--clean", default=None, help="clean prompt")
    add("--corrupted", default=None, help="corrupted prompt")
    add("--target", default=None, help="target token, one token, mind the leading space: ' Paris'")
    add("--other", default=None, help="second token: the metric becomes logit[target] - logit[other]")
    add("--kind", dest="sweep", choices=["residual", "heads"], default="residual",
        help="residual: layers x positions; heads: layers x heads (default residual)")
    add("--align", choices=["error", "right"], default="error",
        help="prompts of different lengths: refuse (error) or align at the last token (right)")
    add("--batch-size", type=int, default=None, help="patched runs per forward pass")


def params_from_args(args) -> tuple[dict, list]:
    from model_core.core.registry import DEFAULT_MODEL

    return {"model": args.model or DEFAULT_MODEL, "clean": args.clean, "corrupted": args.corrupted,
            "target": args.target, "other": args.other, "sweep": args.sweep, "align": args.align,
            "batch_size": args.batch_size}, []


kinds.register(kinds.JobKind("patching", validate=validate_params, task=run_patching,
                             add_arguments=add_arguments, params_from_args=params_from_args,
                             help="activation-patching sweep over layers x positions or heads"))
