"""Supervised fine-tuning as a background job: model_core.training.sft.run_sft on the worker.

Params: model_core.training.sft.SFTSettings fields (model, dataset 'builtin' or an uploaded JSONL, method
full|lora, lora_rank, learning_rate, max_steps / epochs, batch_size, max_length, eval_fraction,
seed, output_name, ...). Submission validates the settings and parses an uploaded dataset, so bad
input (malformed JSONL with line numbers, no assistant turn, unknown model, name taken) fails at
once and nothing is queued. With the job option `skip_bad_lines` (not an SFT setting), malformed
lines are skipped instead: the job's input holds the good lines only, and record['sft']
['dataset_lines'] = {file, kept, skipped, skipped_lines: [{line, reason}]} says what was left out
(a file with no good line still fails). `check_dataset` runs the same check without queueing.

Progress: 'loading model' (0-2 %), 'accuracy before' (2-5 %), 'training' (5-90 %, by step),
'accuracy after' (90-97 %), 'saving' (97-100 %). The record gets an extra field `sft`:
{history: [{step, loss, eval_loss, lr, tokens_per_s, eta_s, ...}], latest, data, accuracy_before,
accuracy_after, model_name, dataset_lines (uploads), samples, checkpoints}; the Jobs/SFT tabs draw
loss curves from it. `samples` grows while the job runs (settings sample_every, sample_prompts):
[{step, index, prompt, completion, expected, correct}], step 0 first, thinned to
sft.MAX_SAMPLE_STEPS steps (app.tabs.finetune.figures.samples_table_html draws it). `checkpoints` (setting
keep_checkpoints), set when the run succeeds: [{name, step}], each a registered model '<name>-step<S>'.

Cancel: run_sft polls the cancel flag between steps (the revoke from jobs.cancel_job also
terminates the process); either way the staging directory is never renamed into <data dir>/models,
so a cancelled or killed run registers nothing (a killed run's staging dir is swept by the next run).
Claim, heartbeat, cancel and the job's ending are tasks.lifecycle's.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

from model_core.core.checkpoints import name_taken
from model_core.core.errors import SettingsError
from model_core.training import sft
from tasks import config, kinds, store
from tasks.celery_app import app
from tasks.lifecycle import CurvesProgress, Done, Job, JobTask, artifact, queue

_PUSH_EVERY_S = 0.5
PHASES = {"loading model": (0.0, 0.02), "accuracy before": (0.02, 0.05), "training": (0.05, 0.90),
          "accuracy after": (0.90, 0.97), "saving": (0.97, 1.0), "done": (1.0, 1.0)}


def validate_params(params: dict, allow_paths: bool = False) -> dict:
    """Settings as run_sft will see them (a JSON-able dict); SettingsError for bad values. Local model
    directories only with allow_paths (the CLI on the server), never from the browser."""
    from model_core.core.registry import REGISTRY, finetuned_path

    p = dict(params or {})
    p.pop("dataset_file", None)
    skip = parse_skip_bad_lines(p.pop("skip_bad_lines", False))
    s = sft.validate_settings(p)
    if s.model not in REGISTRY and finetuned_path(s.model) is None and not (allow_paths and Path(s.model).is_dir()):
        raise SettingsError(f"Unknown model '{s.model}'; pick a registry or fine-tuned model.")
    out = {k: v for k, v in s.__dict__.items()}
    out["dataset_file"] = params.get("dataset_file")
    out["skip_bad_lines"] = skip
    return out


def parse_skip_bad_lines(value) -> bool:
    """The job option `skip_bad_lines` (train on an upload's good lines, skip its malformed ones)."""
    if value is None or value == "":
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise SettingsError(f"Setting 'skip_bad_lines' must be true or false, got {value!r}.")


def check_dataset(path, skip_bad_lines: bool = False) -> tuple[list, dict]:
    """Parse an uploaded chat JSONL as submit_sft will, without queueing anything (a panel can show
    the result before the user submits). -> (conversations, report) with report = {file,
    lines_kept, lines_skipped, skipped: [{line, reason}] (first 5), message}; message is one
    sentence ("Kept 4 of 6 lines of 'x.jsonl'; skipped 2 malformed: line 2: ...; line 5: ...").
    Raises sft.DatasetError (one sentence naming the bad lines) when a bad line is found and
    skip_bad_lines is off, or when no good line is left."""
    f = Path(path)
    if not f.exists():
        raise sft.DatasetError(f"Dataset file '{f.name}' does not exist.")
    if f.stat().st_size > config.upload_max_bytes():
        raise sft.DatasetError(f"Dataset file '{f.name}' is larger than {config.upload_max_bytes() // 2**20} MB.")
    if parse_skip_bad_lines(skip_bad_lines):
        return sft.load_jsonl(f, skip_bad=True)
    convs = sft.load_jsonl(f)  # malformed lines fail here, with line numbers
    return convs, {"file": f.name, "lines_kept": len(convs), "lines_skipped": 0, "skipped": [],
                   "message": f"All {len(convs)} lines of '{f.name}' are good."}


def submit_sft(params: dict, owner: str = "cli", files: list | None = None) -> dict:
    """Validate, record and queue an SFT job (called by tasks.jobs.submit). `files`: one uploaded
    JSONL (then dataset = 'upload'); or params['dataset'] = 'builtin' or a JSONL path."""
    p = dict(params or {})
    skip = parse_skip_bad_lines(p.pop("skip_bad_lines", False))
    files = [Path(f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", f)) for f in (files or [])]
    ds = str(p.get("dataset") or sft.BUILTIN)
    if not files and ds not in (sft.BUILTIN, "upload"):
        files = [Path(ds)]
    if len(files) > 1:
        raise sft.DatasetError("Upload one JSONL dataset file.")
    if ds == "upload" and not files:
        raise sft.DatasetError("No dataset file was uploaded.")
    convs, check = None, None
    if files:
        f = files[0]
        # malformed lines fail here, with line numbers, and nothing is queued; with skip_bad_lines
        # the good lines are kept (none left: still an error)
        convs, check = check_dataset(f, skip)
        p["dataset"], p["dataset_file"] = "upload", f.name
    else:
        p["dataset"] = sft.BUILTIN
    p["output_name"] = p.get("output_name") or None
    v = validate_params({**p, "dataset": sft.BUILTIN}, allow_paths=owner == "cli")  # dataset path: see worker
    v["dataset"], v["dataset_file"], v["skip_bad_lines"] = p["dataset"], p.get("dataset_file"), skip

    def prepare(rec: dict) -> None:
        if not v["output_name"]:
            v["output_name"] = sft.default_output_name(v["model"], rec["id"][:8], v.get("method", "full"))
        why = name_taken(v["output_name"], bool(v.get("overwrite")))
        if why:
            raise sft.SFTError(why)
        rec["sft"] = {"history": [], "latest": None, "model_name": v["output_name"], "samples": [], "checkpoints": []}
        if files:
            inp = config.job_dir(rec["id"]) / "input"
            inp.mkdir(parents=True, exist_ok=True)
            if check["lines_skipped"]:
                # the worker trains on what was checked here: the good lines only, as parsed
                (inp / files[0].name).write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n"
                                                         for c in convs), encoding="utf-8")
                rec["log"].append(store.log_line(check["message"]))
            else:
                shutil.copyfile(files[0], inp / files[0].name)
            rec["sft"]["dataset_lines"] = {"file": check["file"], "kept": check["lines_kept"],
                                           "skipped": check["lines_skipped"], "skipped_lines": check["skipped"]}

    return queue(run_sft_job, "sft", v, owner, prepare)


class SFTProgress(CurvesProgress):
    """Progress of a fine-tuning run: its curves and samples in record['sft']."""

    section = "sft"

    def __init__(self, job_id: str, attempt: int):
        super().__init__(job_id, attempt)
        self.samples: list[dict] = []

    def on_row(self, row: dict) -> None:
        """run_sft's progress callback: a row per step, phase change or batch of samples."""
        phase = row.get("phase", "training")
        with self.lock:
            if phase == "samples":  # generations at a step: a table, not a stage
                self.samples.extend(row.get("samples") or [])
            else:
                lo, hi = PHASES.get(phase, (0.0, 0.0))
                f = lo
                if phase == "training" and row.get("max_steps"):
                    f = lo + (hi - lo) * row["step"] / row["max_steps"]
                self.stage, self.fraction, self.est = phase, max(self.fraction, f), None
            if phase == "training":
                if row.get("loss") is not None or row.get("eval_loss") is not None:
                    self.history.append({k: v for k, v in row.items() if k != "phase"})
                self.latest = row
                self.row_eta = row.get("eta_s")
        self.push_if_due(_PUSH_EVERY_S, force=phase != "training" or row.get("eval_loss") is not None)

    def snapshot(self) -> dict:
        return {**super().snapshot(), "samples": sft.thin_samples(self.samples)}


TB_DIR = "tensorboard"  # <job dir>/tensorboard/<model name>/events.out.tfevents.*


def tensorboard_artifact(jdir: Path) -> list[dict]:
    """[tensorboard.zip]: the run's TensorBoard event files, zipped as tensorboard/<model name>/... so
    that several jobs' zips unpacked into one folder are several runs of `tensorboard --logdir
    tensorboard`. [] when none were written (tensorboardX missing, or the run failed before training)."""
    src = jdir / TB_DIR
    try:
        files = [p for p in sorted(src.rglob("*")) if p.is_file() and not p.is_symlink()] if src.is_dir() else []
        if not files:
            return []
        out = jdir / "tensorboard.zip"
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            for p in files:
                z.write(p, f"{TB_DIR}/{p.relative_to(src).as_posix()}")
        return [artifact(out)]
    except OSError:  # the logs are a bonus: never let them change how the job ends
        return []


@app.task(bind=True, base=JobTask, name="lmscope.sft", progress_cls=SFTProgress, cancelled_by=(sft.SFTCancelled,))
def run_sft_job(self, job: Job) -> Done:
    job.cancel_note = "cancelled; no model was registered"
    job.end_artifacts = lambda: tensorboard_artifact(job.dir)  # whatever the ending
    params = dict(job.params)
    if params.get("dataset") == "upload":
        params["dataset"] = str(job.dir / "input" / params["dataset_file"])
    params.pop("dataset_file", None)
    params.pop("skip_bad_lines", None)  # applied at submit: input/ holds the good lines only
    settings = sft.validate_settings(params)
    res = sft.run_sft_on_gpus(settings, progress=job.progress.on_row, should_stop=job.cancelled, log=job.say,
                      tensorboard_dir=job.dir / TB_DIR / (settings.output_name or "run"))
    info = res.info
    job.progress.report(data=info["data"], accuracy_before=info["accuracy_before"],
                        accuracy_after=info["accuracy_after"], metrics=info["metrics"], model_name=res.name,
                        model_path=str(res.path), sampling=info.get("sampling"),
                        checkpoints=[{"name": c["name"], "step": c["step"]} for c in res.checkpoints])
    acc = ""
    if info["accuracy_before"] and info["accuracy_after"]:
        acc = (f", held-out accuracy {info['accuracy_before']['accuracy']:.0%} -> "
               f"{info['accuracy_after']['accuracy']:.0%}")
    ck = f" (and {len(res.checkpoints)} checkpoint(s): {', '.join(c['name'] for c in res.checkpoints)})" \
        if res.checkpoints else ""
    from tasks.diff_job import precompute  # "What changed", ready when the run's page opens

    diff = precompute(job, res.name, settings.model)
    return job.done(f"done: model '{res.name}' registered{ck}{acc}",
                    *[res.path / n for n in ("lmscope.json", "model.safetensors") if (res.path / n).exists()],
                    *([diff] if diff else []))


# ---- CLI: `lmscope jobs submit sft ...` (wired from tasks/cli.py) ----------------------------

def add_sft_arguments(s) -> None:
    """Options for kind 'sft'. --model and --batch-size are shared with other kinds when present."""
    add = kinds.options(s, "sft (kind 'sft': supervised fine-tuning)")
    add("--model", default=None, help="model to fine-tune (default: the default model)")
    add("--batch-size", type=int, default=None, help="examples per step (sft default 8)")
    add("--dataset", default="builtin", help="'builtin' (date-reformat task) or a chat .jsonl path")
    add("--method", choices=["full", "lora"], default=None, help="full (default) or lora; --lora-rank implies lora")
    add("--lora-rank", type=int, default=None)
    add("--lr", type=float, default=None, help="learning rate (default 1e-4 full, 1e-3 LoRA)")
    add("--max-steps", type=int, default=None)
    add("--epochs", type=float, default=None)
    add("--max-length", type=int, default=None)
    add("--eval-fraction", type=float, default=None)
    add("--seed", type=int, default=None)
    add("--output-name", default=None, help="name of the registered model")
    add("--sample-every", type=int, default=None,
        help="generate the held-out samples every N steps (default: about 4 times a run; 0 = off)")
    add("--sample-prompts", type=int, default=None, help="held-out prompts to sample (default 3)")
    add("--keep-checkpoints", type=int, default=None,
        help="also register the model at N evenly spaced steps as <name>-step<S> (default 0)")
    add("--packing", action="store_true", default=False,
        help="pack each step's examples into rows of --max-length tokens without padding (pays when lengths vary)")
    add("--skip-bad-lines", action="store_true", default=False,
        help="train on the dataset's good lines and skip malformed ones (default: refuse the file)")


def sft_params_from_args(args) -> tuple[dict, list]:
    from model_core.core.registry import DEFAULT_MODEL

    method = args.method or ("lora" if args.lora_rank else "full")
    params = {"model": args.model or DEFAULT_MODEL, "method": method, "lora_rank": args.lora_rank,
              "learning_rate": args.lr, "max_steps": args.max_steps, "epochs": args.epochs,
              "batch_size": getattr(args, "batch_size", None), "max_length": args.max_length,
              "eval_fraction": args.eval_fraction, "seed": args.seed, "output_name": args.output_name,
              "sample_every": getattr(args, "sample_every", None), "sample_prompts": getattr(args, "sample_prompts", None),
              "keep_checkpoints": getattr(args, "keep_checkpoints", None),
              "packing": True if getattr(args, "packing", False) else None,
              "dataset": "builtin", "skip_bad_lines": bool(getattr(args, "skip_bad_lines", False)) or None}
    files = [] if args.dataset in (None, "builtin") else [args.dataset]
    return {k: v for k, v in params.items() if v is not None}, files


kinds.register(kinds.JobKind("sft", validate=validate_params, task=run_sft_job, submit=submit_sft,
                             add_arguments=add_sft_arguments, params_from_args=sft_params_from_args,
                             help="supervised fine-tuning (full or LoRA) of a registry model"))
