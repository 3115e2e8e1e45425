"""What fine-tuning changed, over a corpus, as a background job (kind 'diff'):
model_core.interp.model_diff.diff_corpus of a tuned model against its base on the built-in corpus's
held-out split or an uploaded .txt/.jsonl file, saved as diff.json in the job's folder.

Params: tuned (a fine-tuned or registry model), base (default: the tuned model's parent, from its
lmscope.json), dataset ('builtin' or 'upload' with one file), max_tokens (corpus tokens compared,
256-65,536, default 4,096), window (tokens per context, 16-512, default 64).
Progress: 'loading models' (0-5 %), 'comparing' (5-97 %, per window), 'saving'. Cancel: between
windows. Claim, heartbeat, cancel and the job's ending are tasks.lifecycle's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from model_core.core.errors import SettingsError
from tasks import config, corpus, kinds
from tasks.celery_app import app
from tasks.lifecycle import Done, Job, JobTask, queue

ARTIFACT = "diff.json"
DEFAULT_TOKENS, DEFAULT_WINDOW = 4096, 64


def parent_of(name: str) -> str | None:
    """The model a fine-tuned model was trained from (its lmscope.json), else None."""
    from model_core.core.registry import finetuned_path

    folder = finetuned_path(name) if isinstance(name, str) else None
    if folder is None:
        return None
    try:
        return json.loads((folder / "lmscope.json").read_text()).get("parent")
    except (OSError, ValueError, AttributeError):
        return None


def _known_model(name, what: str, allow_paths: bool) -> str:
    from model_core.core.registry import REGISTRY, finetuned_path

    if not isinstance(name, str) or not name.strip():
        raise SettingsError(f"The {what} must be a model name.")
    name = name.strip()
    if name in REGISTRY or finetuned_path(name) is not None or (allow_paths and Path(name).is_dir()):
        return name
    raise SettingsError(f"Unknown {what} '{name}'; pick a registry or fine-tuned model.")


def validate_params(params: dict, allow_paths: bool = False) -> dict:
    p = dict(params or {})
    p["tuned"] = _known_model(p.get("tuned"), "tuned model", allow_paths)
    base = p.get("base") or parent_of(p["tuned"])
    if not base:
        raise SettingsError(f"'{p['tuned']}' has no recorded parent; name the base model to compare it with.")
    p["base"] = _known_model(base, "base model", allow_paths)
    p["max_tokens"] = kinds.int_setting(p, "max_tokens", DEFAULT_TOKENS, 256, 65_536)
    p["window"] = kinds.int_setting(p, "window", DEFAULT_WINDOW, 16, 512)
    if p.get("dataset") not in (None, "builtin", "upload"):
        raise SettingsError("The dataset is 'builtin' or an uploaded file.")
    p["dataset"] = p.get("dataset") or "builtin"
    return p


def submit_diff(params: dict, owner: str = "cli", files: list | None = None) -> dict:
    """Validate, record and queue a diff job; an uploaded corpus is checked first (one sentence,
    nothing queued)."""
    files = [Path(f) for f in (files or [])]
    if len(files) > 1:
        raise SettingsError("Upload one corpus file.")
    p = validate_params({**(params or {}), "dataset": "upload" if files else "builtin"}, allow_paths=owner == "cli")
    if files:
        corpus.check_upload(files[0])
        p["corpus_file"] = files[0].name

    def copy_input(rec: dict) -> None:
        if files:
            inp = config.job_dir(rec["id"]) / "input"
            inp.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(files[0], inp / files[0].name)

    return queue(run_diff, "diff", p, owner, copy_input)


@app.task(bind=True, base=JobTask, name="lmscope.model_diff")
def run_diff(self, job: Job) -> Done:
    from model_core import load_model
    from model_core.interp.model_diff import diff_corpus
    from model_core.interp.neurons import corpus_windows

    p = job.params
    job.stage("loading models", 0.01, f"loading {p['base']} and {p['tuned']}")
    base, tuned = load_model(p["base"], allow_hub=False), load_model(p["tuned"], allow_hub=False)
    if p["dataset"] == "upload":
        texts, source = corpus.file_docs(job.dir / "input" / p["corpus_file"]), p["corpus_file"]
    else:
        texts, source = corpus.builtin_docs("heldout"), f"{corpus.BUILTIN_VERSION} held-out split"
    windows = corpus_windows(base.tokenizer, texts, p["max_tokens"], p["window"])
    job.stage("comparing", 0.05, f"{windows.shape[0]} windows of {p['window']} tokens from {source}")
    job.cancel_note = "cancelled between windows"
    d = diff_corpus(base, tuned, windows, progress=job.ticker("comparing", 0.05, 0.97, 0.25))
    job.check_cancel()
    d.meta.update(corpus=source)
    job.stage("saving", 0.97)
    path = job.dir / ARTIFACT
    path.write_text(json.dumps(d.to_dict(), ensure_ascii=False), encoding="utf-8")
    return job.done(f"done: {d.tokens} tokens in {d.seconds:.1f} s, mean KL {d.mean_kl:.4f} nats", path)


# ---- CLI: `lmscope jobs submit diff ...` ---------------------------------------------------

def add_arguments(s) -> None:
    add = kinds.options(s, "diff (kind 'diff': what fine-tuning changed, over a corpus)")
    add("--tuned", default=None, help="diff: the fine-tuned model")
    add("--base", default=None, help="diff: the model it is compared with (default: its parent)")
    add("--dataset", default="builtin", help="diff: 'builtin' (held-out docstrings) or a .txt/.jsonl file")
    add("--max-tokens", type=int, default=None, help="diff: corpus tokens compared")
    add("--window", type=int, default=None, help="diff: tokens per context")


def params_from_args(args) -> tuple[dict, list]:
    dataset = getattr(args, "dataset", "builtin") or "builtin"
    files = [] if dataset == "builtin" else [dataset]
    return {"tuned": args.tuned, "base": args.base, "max_tokens": getattr(args, "max_tokens", None),
            "window": getattr(args, "window", None)}, files


kinds.register(kinds.JobKind("diff", validate=validate_params, task=run_diff, submit=submit_diff,
                             add_arguments=add_arguments, params_from_args=params_from_args,
                             flags=("--tuned", "--base", "--dataset", "--max-tokens", "--window"),
                             help="what fine-tuning changed over a corpus: contexts ranked by KL"))
