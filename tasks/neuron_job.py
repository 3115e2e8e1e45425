"""Top-activating contexts of every neuron and head, once per model, as a background job (kind
'neurons'; issue 15 item 9): model_core.neurons.scan over the built-in corpus (the standard
library's docstrings) or texts given inline, saved as contexts.safetensors in the job's folder.

A scan of the built-in corpus is also stored where every page finds it, data/contexts/<model>.
safetensors (shared_index_path), so it runs once per model and every user's neuron and head pages
reuse it; a later scan of the same model replaces it.

Params: model, tokens (default 16,384; at most 262,144), window (tokens per context window, 8-512,
default 64), k (contexts kept per unit, 1-64, default 12), texts (optional: a list of strings, at
most 1 MB in all, instead of the built-in corpus; such a scan is not shared), batch_size.
Progress: 'loading model' (0-3 %), 'tokenizing the corpus' (3-5 %), 'scanning' (5-97 %, per batch of
windows), 'saving'. Cancel: the progress callback raises between batches.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from model_core.errors import LmscopeError, SettingsError
from tasks import store
from tasks.celery_app import app
from tasks.tokenizer_job import _finish, _finish_unexpected, _Progress, start_job

MAX_TOKENS = 262_144
MAX_TEXT_BYTES = 1 << 20
ARTIFACT = "contexts.safetensors"


class Cancelled(Exception):
    pass


def _int(p: dict, k: str, default: int, lo: int, hi: int) -> int:
    v = p.get(k)
    if v in (None, ""):
        return default
    try:
        v = int(v)
    except (TypeError, ValueError):
        raise SettingsError(f"'{k}' must be a whole number.") from None
    if not lo <= v <= hi:
        raise SettingsError(f"'{k}' must be between {lo:,} and {hi:,}.")
    return v


def validate_params(params: dict) -> dict:
    from model_core.neurons import DEFAULT_TOKENS, DEFAULT_WINDOW, TOP_K

    p = dict(params or {})
    if not isinstance(p.get("model"), str) or not p["model"].strip():
        raise SettingsError("A top-contexts job needs 'model'.")
    p["model"] = p["model"].strip()
    p["tokens"] = _int(p, "tokens", DEFAULT_TOKENS, 64, MAX_TOKENS)
    p["window"] = _int(p, "window", DEFAULT_WINDOW, 8, 512)
    p["k"] = _int(p, "k", TOP_K, 1, 64)
    p["batch_size"] = _int(p, "batch_size", 16, 1, 256)
    texts = p.get("texts")
    if texts in (None, "", []):
        p["texts"] = None
    else:
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise SettingsError("'texts' must be a list of strings.")
        if sum(len(t.encode()) for t in texts) > MAX_TEXT_BYTES:
            raise SettingsError(f"'texts' are over {MAX_TEXT_BYTES >> 20} MB; use the built-in corpus.")
    return p


def submit_neurons(params: dict, owner: str = "cli") -> dict:
    from tasks import jobs

    p = validate_params(params)
    r = jobs._r()
    rec = store.new_record("neurons", p, owner)
    return jobs.enqueue(run_neurons, rec, r)


def shared_index_path(model: str) -> Path:
    """Where the built-in corpus scan of `model` is kept for every page (a registry or fine-tuned
    model name; anything else is reduced to a safe file name)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(model))[:120].lstrip(".") or "model"
    from model_core import paths

    return paths.data_dir() / "contexts" / f"{safe}.safetensors"


def active_job(model: str, owner: str | None = None) -> dict | None:
    """A queued or running scan of the built-in corpus for `model` (visible to `owner`), to follow
    instead of queueing a second one."""
    from tasks import jobs

    for rec in jobs.list_jobs(owner=owner, limit=200):
        p = rec.get("params") or {}
        if rec.get("kind") == "neurons" and p.get("model") == model and not p.get("texts") \
                and rec.get("state") in ("queued", "running"):
            return rec
    return None


def _model(name: str):
    from model_core import load_model

    return load_model(name, allow_hub=False)


@app.task(bind=True, name="lmscope.neuron_contexts", acks_late=True, reject_on_worker_lost=True)
def run_neurons(self, job_id: str) -> str:
    started = start_job(self, job_id, _Progress)
    if started is None:
        return "skipped"
    rec, prog, jdir = started
    attempt = rec["attempts"]

    def cancelled() -> bool:
        return prog.cancelled.is_set() or store.cancel_requested(job_id)

    try:
        from model_core import neurons as N

        params = validate_params(rec["params"])
        prog.set("loading model", 0.01, f"loading {params['model']}")
        lm = _model(params["model"])
        prog.set("tokenizing the corpus", 0.03)
        if params["texts"]:
            texts, source = params["texts"], "texts"
        else:
            from tasks.corpus import BUILTIN_VERSION, builtin_docs

            texts, source = builtin_docs("train"), BUILTIN_VERSION
        windows = N.corpus_windows(lm.tokenizer, texts, params["tokens"], params["window"])
        prog.set("scanning", 0.05, f"{windows.shape[0]} windows of {params['window']} tokens on "
                                   f"{lm.shape.n_layers} layers")
        last = [0.0]

        def on_batch(f: float) -> None:
            if cancelled():
                raise Cancelled()
            with prog.lock:
                prog.stage, prog.fraction, prog.est = "scanning", 0.05 + 0.92 * f, None
            if time.time() - last[0] >= 0.25 or f >= 1.0:
                last[0] = time.time()
                prog.push()

        t0 = time.time()
        index = N.scan(lm, windows, k=params["k"], batch_size=params["batch_size"], progress=on_batch)
        if cancelled():
            raise Cancelled()
        index.meta.update(corpus=source, tokens=int(windows.numel()), seconds=round(time.time() - t0, 2))
        prog.set("saving", 0.97)
        path = index.save(jdir / ARTIFACT)
        if not params["texts"]:  # the built-in corpus: every page reuses it
            shared = shared_index_path(params["model"])
            shared.parent.mkdir(parents=True, exist_ok=True)
            tmp = shared.with_name(shared.name + f".{job_id}.tmp")
            shutil.copyfile(path, tmp)
            tmp.replace(shared)
        _finish(job_id, attempt, state="succeeded",
                artifacts=[{"name": path.name, "path": str(path), "bytes": path.stat().st_size}],
                log=f"done: {int(windows.numel())} tokens, {index.meta['seconds']:.1f} s")
        return "succeeded"
    except Cancelled:
        _finish(job_id, attempt, state="cancelled", log="cancelled between batches")
        return "cancelled"
    except LmscopeError as e:
        _finish(job_id, attempt, state="failed", error=str(e), log=f"failed: {e}")
        return "failed"
    except Exception as e:  # noqa: BLE001 - the record gets one line, the worker log the traceback
        _finish_unexpected(job_id, attempt, e)
        raise
    finally:
        prog.stop.set()
