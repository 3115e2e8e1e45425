"""What fine-tuning changed, over a corpus, as a background job (kind 'diff'):
model_core.interp.model_diff.diff_corpus of a tuned model against its base on the built-in corpus's
held-out split or an uploaded .txt/.jsonl file, saved as diff.json in the job's folder.

Params: tuned (a fine-tuned or registry model), base (default: the tuned model's parent, from its
lmscope.json), dataset ('builtin' or 'upload' with one file), max_tokens (corpus tokens compared,
256-65,536, default 4,096), window (tokens per context, 16-512, default 64), follow (up to 16
prompts followed across the run; default: the corpus's top-ranked contexts).
Progress: 'loading models' (0-5 %), 'comparing' (5-90 %, per window), 'across the run' (90-97 %,
per checkpoint, when the tuned model's run kept checkpoints), 'saving'. Cancel: between windows and
checkpoints. Claim, heartbeat, cancel and the job's ending are tasks.lifecycle's.

`precompute` is the short pass a training job runs on its own model when it finishes (SFT, DPO,
GRPO, PPO): PRECOMPUTE_TOKENS of the built-in held-out split, written as diff.json beside the run's
other results, so "What changed" opens at once.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from model_core.core.errors import LmscopeError, SettingsError
from tasks import config, corpus, kinds
from tasks.celery_app import app
from tasks.lifecycle import Done, Job, JobTask, queue

log = logging.getLogger(__name__)

ARTIFACT = "diff.json"
DEFAULT_TOKENS, DEFAULT_WINDOW = 4096, 64
PRECOMPUTE_TOKENS, PRECOMPUTE_WINDOW = 2048, 64  # a training job's own pass: 32 contexts of 64 tokens
FOLLOWED = 8  # top-ranked contexts followed across a run when no prompts are given
MAX_FOLLOW_CHARS = 2000


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
    follow = p.get("follow") or []
    if isinstance(follow, str):
        follow = [follow]
    if not isinstance(follow, list) or len(follow) > 16 or not all(
            isinstance(t, str) and t.strip() and len(t) <= MAX_FOLLOW_CHARS for t in follow):
        raise SettingsError(f"Follow at most 16 prompts across the run, each non-empty text of at most "
                            f"{MAX_FOLLOW_CHARS:,} characters.")
    p["follow"] = follow
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
    d = diff_corpus(base, tuned, windows, progress=job.ticker("comparing", 0.05, 0.90, 0.25))
    job.check_cancel()
    d.meta.update(corpus=source)
    report = d.to_dict()
    try:
        report["across_run"] = across_run(job, base, tuned, report, p["follow"])
    except LmscopeError as e:  # the corpus diff stands; the curve says why it is missing
        report["across_run"] = None
        job.say(f"across the run: {e}")
    job.stage("saving", 0.97)
    path = job.write_json(ARTIFACT, report)
    return job.done(f"done: {d.tokens} tokens in {d.seconds:.1f} s, mean KL {d.mean_kl:.4f} nats", path)


def _transient(name: str):
    """A model loaded for one pass and freed after it (not kept in load_model's cache, so a worker
    holds no run's checkpoints or tuned model once the pass is over)."""
    from model_core.core.registry import load_uncached, resolve_device

    lm = load_uncached(name, *resolve_device(None, None), allow_hub=False)
    lm.model.eval()
    lm.model.requires_grad_(False)
    return lm


def across_run(job: Job, base, tuned, report: dict, follow: list[str], lo: float = 0.90,
               hi: float = 0.97) -> dict | None:
    """KL at every checkpoint the tuned model's run kept, for the followed prompts (default: the
    corpus's top-ranked contexts, cut to their last MAX_PROMPT_TOKENS tokens); None without checkpoints."""
    from model_core.interp.model_diff_run import MAX_PROMPT_TOKENS, kl_across_run, run_checkpoints

    steps = run_checkpoints(tuned.name)  # tuned: the loaded run's model, its last point (not loaded again)
    if not steps:
        return None
    job.stage("across the run", lo, f"KL at {len(steps)} points of the run ({', '.join(n for _, n in steps)})")
    models = [(st, tuned if name == tuned.name else (lambda n=name: _transient(n))) for st, name in steps]
    tick = job.ticker("across the run", lo, hi, 0.25)
    if follow:
        r = kl_across_run(base, models, prompts=follow, progress=tick)
    else:
        ids = [c["ids"][-MAX_PROMPT_TOKENS:] for c in report["contexts"][:FOLLOWED]]
        r = kl_across_run(base, models, token_ids=ids, progress=tick)
    return r.to_dict()


def precompute(job: Job, tuned: str, base: str | None = None) -> Path | None:
    """A training job's own short diff of the model it registered against its base (diff.json in the
    job's folder). Never changes how the training job ends: whatever goes wrong here, a cancel
    included (the model is registered by now), is a log line."""
    from model_core import load_model
    from model_core.interp.model_diff import diff_corpus
    from model_core.interp.neurons import corpus_windows

    base = base or parent_of(tuned)
    if not base:
        return None
    job.stage("what changed", 0.98, f"comparing '{tuned}' with {base} over {PRECOMPUTE_TOKENS:,} tokens of the "
                                    f"built-in held-out split")
    try:
        b, t = load_model(base, allow_hub=False), _transient(tuned)
        windows = corpus_windows(b.tokenizer, corpus.builtin_docs("heldout"), PRECOMPUTE_TOKENS, PRECOMPUTE_WINDOW)
        d = diff_corpus(b, t, windows)
        d.meta.update(corpus=f"{corpus.BUILTIN_VERSION} held-out split", precomputed=True,
                      max_tokens=PRECOMPUTE_TOKENS, window=PRECOMPUTE_WINDOW)
        report = d.to_dict()
        report["across_run"] = across_run(job, b, t, report, [], 0.98, 0.995)
        path = job.write_json(ARTIFACT, report)
    except Exception as e:  # noqa: BLE001 - the run succeeded; its diff is a bonus (a cancel is skipped too)
        log.warning("what changed of %s not precomputed: %r", tuned, e)
        job.say(f"what changed: not precomputed ({str(e) or type(e).__name__})")
        return None
    job.say(f"what changed: mean KL({base} ‖ {tuned}) {d.mean_kl:.4f} nats over {d.tokens:,} tokens "
            f"({d.seconds:.1f} s)")
    return path


# ---- CLI: `lmscope jobs submit diff ...` ---------------------------------------------------

def add_arguments(s) -> None:
    add = kinds.options(s, "diff (kind 'diff': what fine-tuning changed, over a corpus)")
    add("--tuned", default=None, help="diff: the fine-tuned model")
    add("--base", default=None, help="diff: the model it is compared with (default: its parent)")
    add("--dataset", default="builtin", help="diff: 'builtin' (held-out docstrings) or a .txt/.jsonl file")
    add("--max-tokens", type=int, default=None, help="diff: corpus tokens compared")
    add("--window", type=int, default=None, help="diff: tokens per context")
    add("--follow", action="append", default=None,
        help="diff: a prompt followed across the run's checkpoints (repeat; default: the top-ranked contexts)")


def params_from_args(args) -> tuple[dict, list]:
    dataset = getattr(args, "dataset", "builtin") or "builtin"
    files = [] if dataset == "builtin" else [dataset]
    return {"tuned": args.tuned, "base": args.base, "max_tokens": getattr(args, "max_tokens", None),
            "window": getattr(args, "window", None), "follow": getattr(args, "follow", None) or []}, files


kinds.register(kinds.JobKind("diff", validate=validate_params, task=run_diff, submit=submit_diff,
                             add_arguments=add_arguments, params_from_args=params_from_args,
                             flags=("--tuned", "--base", "--dataset", "--max-tokens", "--window", "--follow"),
                             help="what fine-tuning changed over a corpus: contexts ranked by KL"))
