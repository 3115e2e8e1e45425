"""Whole-model activation-patching sweeps as a background job: model_core.interventions.patch_residual
(layers x positions) or patch_heads (layers x heads) on the worker, result saved as patching.json.

Params: model, clean, corrupted, target, other (optional: then the metric is the logit difference
target - other, else log p(target)), sweep ('residual' | 'heads'), align ('error' | 'right'),
batch_size (optional; default: model_core's token budget), layers / positions (optional subsets).

Progress: 'loading model' (0-3 %), 'clean and corrupted runs' (3-5 %), 'patching' (5-97 %, one step
per layer of each batch of patched runs), 'saving' (97-100 %). Cancel: the progress callback raises
between layers when the cancel flag is set (the revoke from jobs.cancel_job also terminates the process).
The record machinery (claim, heartbeat thread, final-state writes) is the tokenizer job's.
"""

from __future__ import annotations

import json
import time

from model_core.errors import LmscopeError, SettingsError
from tasks import store
from tasks.celery_app import app
from tasks.tokenizer_job import _finish, _finish_unexpected, _Progress, start_job

SWEEPS = ("residual", "heads")
MAX_PROMPT_CHARS = 20_000
_PUSH_EVERY_S = 0.25  # at most this often a progress write to the record from the batch loop


class Cancelled(Exception):
    pass


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
    bs = p.get("batch_size")
    if bs not in (None, ""):
        if int(bs) < 1:
            raise SettingsError("batch_size must be at least 1.")
        p["batch_size"] = int(bs)
    else:
        p["batch_size"] = None
    for k in ("layers", "positions"):
        v = p.get(k)
        p[k] = None if v in (None, "", []) else [int(x) for x in v]
    return p


def submit_patching(params: dict, owner: str = "cli") -> dict:
    """Validate, record and queue a patching job (called by tasks.jobs.submit)."""
    from tasks import jobs

    p = validate_params(params)
    r = jobs._r()
    rec = store.new_record("patching", p, owner)
    return jobs.enqueue(run_patching, rec, r)


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
    from model_core.interventions import make_metric, patch_heads, patch_residual

    m = make_metric(lm, params["target"], params.get("other"))
    kw = dict(align=params["align"], batch_size=params.get("batch_size"), progress=progress,
              layers=params.get("layers"))
    if params["sweep"] == "heads":
        return patch_heads(lm, params["clean"], params["corrupted"], m, **kw)
    return patch_residual(lm, params["clean"], params["corrupted"], m, positions=params.get("positions"), **kw)


@app.task(bind=True, name="lmscope.patching_sweep", acks_late=True, reject_on_worker_lost=True)
def run_patching(self, job_id: str) -> str:
    started = start_job(self, job_id, _Progress)
    if started is None:
        return "skipped"
    rec, prog, jdir = started
    attempt = rec["attempts"]

    def cancelled() -> bool:
        return prog.cancelled.is_set() or store.cancel_requested(job_id)

    try:
        params = validate_params(rec["params"])
        prog.set("loading model", 0.01, f"loading {params['model']}")
        lm = _model(params["model"])
        prog.set("clean and corrupted runs", 0.03, f"{params['sweep']} sweep on {lm.shape.n_layers} layers")
        last_push = [0.0]

        def on_batch(f: float) -> None:
            # as each layer of a batch starts: stop if cancelled, else report (writes throttled; the
            # heartbeat thread pushes the latest value anyway)
            if cancelled():
                raise Cancelled()
            with prog.lock:
                prog.stage, prog.fraction, prog.est = "patching", 0.05 + 0.92 * f, None
            now = time.time()
            if now - last_push[0] >= _PUSH_EVERY_S or f >= 1.0:
                last_push[0] = now
                prog.push()

        t0 = time.time()
        res = run_sweep(lm, params, progress=on_batch)
        if cancelled():
            raise Cancelled()
        secs = time.time() - t0
        prog.set("saving", 0.97, f"{res.values.numel()} cells in {res.n_forward} forward passes "
                                 f"(batches of {res.batch_size}), {secs:.2f} s")
        rows, cols = labels(lm, res)
        out = {**res.to_dict(), "model": params["model"], "sweep": params["sweep"], "params": params,
               "row_labels": rows, "col_labels": cols, "metric_description": res.metric.describe(lm)}
        path = jdir / "patching.json"
        tmp = jdir / "patching.json.tmp"
        tmp.write_text(json.dumps(out, ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)
        n = res.normalized
        _finish(job_id, attempt, state="succeeded",
                artifacts=[{"name": path.name, "path": str(path), "bytes": path.stat().st_size}],
                log=f"done: clean {res.clean_value:.3f}, corrupted {res.corrupted_value:.3f}, "
                    f"max restored {float(n.nan_to_num(nan=-1e9).max()):.2f}")
        return "succeeded"
    except Cancelled:
        _finish(job_id, attempt, state="cancelled", log="cancelled during the sweep")
        return "cancelled"
    except LmscopeError as e:
        _finish(job_id, attempt, state="failed", error=str(e), log=f"failed: {e}")
        return "failed"
    except Exception as e:  # noqa: BLE001 - the record gets one line, the worker log the traceback
        _finish_unexpected(job_id, attempt, e)
        raise
    finally:
        prog.stop.set()


def read_result(rec: dict) -> dict | None:
    """The patching.json of a finished job, or None."""
    from tasks import jobs

    p = jobs.artifact_path(rec, "patching.json")
    if p is None:
        return None
    return json.loads(p.read_text(encoding="utf-8"))
