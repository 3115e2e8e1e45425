"""Top-activating contexts of every neuron and head, once per model, as a background job (kind
'neurons'; issue 15 item 9): model_core.interp.neurons.scan over the built-in corpus (the standard
library's docstrings) or texts given inline, saved as contexts.safetensors in the job's folder.

A scan of the built-in corpus is also stored where every page finds it, data/contexts/<model>.
safetensors (shared_index_path), so it runs once per model and every user's neuron and head pages
reuse it; a later scan of the same model replaces it.

Params: model, tokens (default 16,384; at most 262,144), window (tokens per context window, 8-512,
default 64), k (contexts kept per unit, 1-64, default 12), texts (optional: a list of strings, at
most 1 MB in all, instead of the built-in corpus; such a scan is not shared), batch_size.
Progress: 'loading model' (0-3 %), 'tokenizing the corpus' (3-5 %), 'scanning' (5-97 %, per batch of
windows), 'saving'. Cancel: the progress callback raises between batches. Claim, heartbeat,
cancel and the job's ending are tasks.lifecycle's.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from model_core.core.errors import SettingsError
from tasks import kinds, store
from tasks.celery_app import app
from tasks.lifecycle import Done, Job, JobTask, queue_client

MAX_TOKENS = 262_144
MAX_TEXT_BYTES = 1 << 20
ARTIFACT = "contexts.safetensors"


def validate_params(params: dict) -> dict:
    from model_core.interp.neurons import DEFAULT_TOKENS, DEFAULT_WINDOW, TOP_K

    p = dict(params or {})
    if not isinstance(p.get("model"), str) or not p["model"].strip():
        raise SettingsError("A top-contexts job needs 'model'.")
    p["model"] = p["model"].strip()
    p["tokens"] = kinds.int_setting(p, "tokens", DEFAULT_TOKENS, 64, MAX_TOKENS)
    p["window"] = kinds.int_setting(p, "window", DEFAULT_WINDOW, 8, 512)
    p["k"] = kinds.int_setting(p, "k", TOP_K, 1, 64)
    p["batch_size"] = kinds.int_setting(p, "batch_size", 16, 1, 256)
    texts = p.get("texts")
    if texts in (None, "", []):
        p["texts"] = None
    else:
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise SettingsError("'texts' must be a list of strings.")
        if sum(len(t.encode()) for t in texts) > MAX_TEXT_BYTES:
            raise SettingsError(f"'texts' are over {MAX_TEXT_BYTES >> 20} MB; use the built-in corpus.")
    return p


def shared_index_path(model: str) -> Path:
    """Where the built-in corpus scan of `model` is kept for every page (a registry or fine-tuned
    model name; anything else is reduced to a safe file name)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(model))[:120].lstrip(".") or "model"
    from model_core.core import paths

    return paths.data_dir() / "contexts" / f"{safe}.safetensors"


def active_job(model: str, owner: str | None = None) -> dict | None:
    """A queued or running scan of the built-in corpus for `model` (visible to `owner`), to follow
    instead of queueing a second one."""
    r = queue_client()
    store.reap(r)
    for rec in store.list_records(owner, 200, r):
        p = rec.get("params") or {}
        if rec.get("kind") == "neurons" and p.get("model") == model and not p.get("texts") \
                and rec.get("state") in ("queued", "running"):
            return rec
    return None


def _model(name: str):
    from model_core import load_model

    return load_model(name, allow_hub=False)


@app.task(bind=True, base=JobTask, name="lmscope.neuron_contexts")
def run_neurons(self, job: Job) -> Done:
    from model_core.interp import neurons as N

    params = validate_params(job.params)
    job.stage("loading model", 0.01, f"loading {params['model']}")
    lm = _model(params["model"])
    job.stage("tokenizing the corpus", 0.03)
    if params["texts"]:
        texts, source = params["texts"], "texts"
    else:
        from tasks.corpus import BUILTIN_VERSION, builtin_docs

        texts, source = builtin_docs("train"), BUILTIN_VERSION
    windows = N.corpus_windows(lm.tokenizer, texts, params["tokens"], params["window"])
    job.stage("scanning", 0.05, f"{windows.shape[0]} windows of {params['window']} tokens on "
                                f"{lm.shape.n_layers} layers")
    job.cancel_note = "cancelled between batches"
    t0 = time.time()
    index = N.scan(lm, windows, k=params["k"], batch_size=params["batch_size"],
                   progress=job.ticker("scanning", 0.05, 0.97, 0.25))
    job.check_cancel()
    index.meta.update(corpus=source, tokens=int(windows.numel()), seconds=round(time.time() - t0, 2))
    job.stage("saving", 0.97)
    path = index.save(job.dir / ARTIFACT)
    if not params["texts"]:  # the built-in corpus: every page reuses it
        shared = shared_index_path(params["model"])
        shared.parent.mkdir(parents=True, exist_ok=True)
        tmp = shared.with_name(shared.name + f".{job.id}.tmp")
        shutil.copyfile(path, tmp)
        tmp.replace(shared)
    return job.done(f"done: {int(windows.numel())} tokens, {index.meta['seconds']:.1f} s", path)


# ---- CLI: `lmscope jobs submit neurons ...` ------------------------------------------------

def add_arguments(s) -> None:
    add = kinds.options(s, "neurons (kind 'neurons': top contexts of every neuron and head)")
    add("--model", default=None, help="model name (default: the default model)")
    add("--tokens", type=int, default=None, help="neurons: corpus tokens to scan")
    add("--context", type=int, default=None, help="neurons: tokens per context window")


def params_from_args(args) -> tuple[dict, list]:
    from model_core.core.registry import DEFAULT_MODEL

    return {"model": args.model or DEFAULT_MODEL, "tokens": args.tokens, "window": args.context}, []


kinds.register(kinds.JobKind("neurons", validate=validate_params, task=run_neurons,
                             add_arguments=add_arguments, params_from_args=params_from_args,
                             help="top-activating contexts of every neuron and head"))
