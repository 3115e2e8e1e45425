"""One training run from its output name to a registered model: the protocol fine-tuning
(sft.run_sft), the preference trainers (preference_trl.run_trl: reward model, DPO, GRPO) and
pretraining (pretrain.run_pretrain) share, so that each of them supplies only its training.

    with TrainingRun(name, error_cls=..., cancelled_cls=..., overwrite=..., progress=...,
                     should_stop=..., log=...) as run:
        run.phase("loading model")           # a progress row
        ...                                  # load, train, evaluate; run.check_stop() between stages
        run.reserve_checkpoints(steps)       # optional: '<name>-step<S>' models registered beside it
        run.save(model, tokenizer, info)     # weights, tokenizer and lmscope.json into the staging folder
        run.register()                       # renamed into <data dir>/models/<name>; the 'done' row
    # leaving the block removes the staging folder and the checkpoints' folders, whatever happened

What each step holds to:
  name      checked when the run is made (and for each checkpoint by reserve_checkpoints): a name
            that is taken (unless overwrite) or is a built-in registry name is refused with one
            sentence of error_cls, before anything is loaded
  staging   everything is written under <data dir>/<kind>-staging (model_core.core.checkpoints, in a
            folder named with this process's pid, so the next run sweeps a dead run's folder);
            nothing under data/models until register
  progress  one shape: progress(row) with row = {"phase", "step", "max_steps", ...}. Per-step rows
            (phase "training") come from the trainer's callback (trainer_callbacks, or pretraining's
            own loop), every other phase from run.phase. `positional` feeds the same rows to the
            preference trainers' published callback progress(step, total, metrics).
  cancel    should_stop() is polled between stages (check_stop), between steps by the callbacks and
            once more before the rename; a cancel raises cancelled_cls and registers nothing
  record    lmscope.json beside the weights: what the run was (the caller's info dict)
  register  checkpoints first, the final model last, each one os.rename (atomic on one filesystem):
            a run's models all appear complete, or none do. An overwrite replaces the earlier run
            of that name, its registered checkpoints included.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from model_core.core import paths
from model_core.core.checkpoints import builtin_names, checkpoint_name, name_taken, staging_dir, sweep_staging

log = logging.getLogger(__name__)

Progress = Callable[[dict], None]
MAX_NAME = 100  # as model_core.core.checkpoints.OUTPUT_NAME


class TrainingRun:
    """The staging folder, progress rows, cancel checks, run record and registration of one run
    (see the module docstring). A context manager: leaving it removes what was not registered."""

    def __init__(self, name: str, *, error_cls: type[Exception], cancelled_cls: type[BaseException],
                 overwrite: bool = False, staging_kind: str = "sft", progress: Progress | None = None,
                 should_stop: Callable[[], bool] | None = None, log: Callable[[str], None] | None = None,
                 max_steps: int | None = None):
        self.name = name
        self.error_cls, self.cancelled_cls = error_cls, cancelled_cls
        self.overwrite = bool(overwrite)
        self.staging_kind = staging_kind
        self.progress: Progress = progress or (lambda row: None)
        self.should_stop: Callable[[], bool] = should_stop or (lambda: False)
        self.say: Callable[[str], None] = log or (lambda m: None)
        self.max_steps = max_steps
        self.root = paths.finetuned_dir()
        self.final = self.root / name
        self.staging: Path | None = None
        self.checkpoints: dict[int, Path] = {}  # step -> the staging folder its model was saved into
        self.t_start = time.time()
        why = name_taken(name, self.overwrite)
        if why:
            raise error_cls(why)

    # ---- staging ----------------------------------------------------------------------------------

    def __enter__(self) -> TrainingRun:
        swept = sweep_staging(self.staging_kind)
        if swept:
            log.info("removed %d staging folder(s) of runs whose process died", swept)
        self.staging = staging_dir(self.name, self.staging_kind)
        self.staging.mkdir(parents=True)
        return self

    def __exit__(self, *exc) -> bool:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)  # gone already when the run registered
        for d in self.checkpoints.values():
            shutil.rmtree(d, ignore_errors=True)
        return False

    def scratch(self, sub: str) -> Path:
        """A folder inside the staging folder for the trainer's own files (its output_dir, a reference
        model's copy); save() removes it before the model is written."""
        return self.staging / sub

    # ---- progress and cancel ----------------------------------------------------------------------

    def phase(self, phase: str, step: int = 0, **fields) -> None:
        """A progress row for a stage of the run (per-step rows come from the trainer's callback)."""
        self.progress({"phase": phase, "step": step, "max_steps": self.max_steps, **fields})

    def check_stop(self) -> None:
        if self.should_stop():
            raise self.cancelled_cls()

    def train(self, trainer, callback) -> None:
        """trainer.train() with the endings every Trainer-based run shares (train_checked)."""
        train_checked(trainer, callback, self.should_stop, self.error_cls, self.cancelled_cls)

    # ---- checkpoints ------------------------------------------------------------------------------

    def reserve_checkpoints(self, steps: list[int]) -> None:
        """Refuse the run now when a checkpoint's name '<name>-step<S>' is too long, taken or built in."""
        if steps and len(checkpoint_name(self.name, steps[-1])) > MAX_NAME:
            raise self.error_cls(f"The name '{self.name}' is too long to also name its checkpoints '<name>-step<S>' "
                                 f"(max {MAX_NAME} characters); shorten it or keep no checkpoints.")
        builtin = builtin_names()
        for st in steps:
            cname = checkpoint_name(self.name, st)
            if (self.root / cname).exists() and not self.overwrite:
                raise self.error_cls(f"A model named '{cname}' already exists (this run's checkpoint at step {st} "
                                     "would take that name); choose another output name.")
            if cname in builtin:
                raise self.error_cls(f"'{cname}' is a built-in model name; choose another output name.")

    def checkpoint_dir(self, step: int) -> Path:
        """A fresh staging folder for the model at `step`, registered as '<name>-step<S>' by register()."""
        d = staging_dir(checkpoint_name(self.name, step), self.staging_kind)
        self.checkpoints[step] = d
        return d

    def checkpoint_list(self) -> list[dict]:
        """[{name, step}] of the checkpoints saved so far, by step (the run record's 'checkpoints')."""
        return [{"name": checkpoint_name(self.name, st), "step": st} for st in sorted(self.checkpoints)]

    def save_checkpoint_record(self, step: int, info: dict) -> None:
        write_record(self.checkpoints[step], info)

    # ---- the record and registration ----------------------------------------------------------------

    def save(self, model, tokenizer, info: dict) -> None:
        """The trained model (moved to the CPU), its tokenizer and lmscope.json into the staging
        folder; the trainer's scratch folders go first (they are not part of the model)."""
        for sub in self.staging.iterdir():
            if sub.is_dir():
                shutil.rmtree(sub, ignore_errors=True)
        model.to("cpu").save_pretrained(self.staging, safe_serialization=True)
        tokenizer.save_pretrained(self.staging)
        write_record(self.staging, info)

    def register(self) -> Path:
        """Rename the saved checkpoints, then the final model, into <data dir>/models, log each and
        send the 'done' row. A cancel still counts until here; a name that appeared meanwhile is
        refused; a rename that fails takes back the ones before it."""
        self.check_stop()
        names = {st: checkpoint_name(self.name, st) for st in sorted(self.checkpoints)}
        if self.overwrite:
            remove_checkpoints_of(self.name)
            for n in names.values():
                shutil.rmtree(self.root / n, ignore_errors=True)
            shutil.rmtree(self.final, ignore_errors=True)
        for n in [*names.values(), self.name]:
            if (self.root / n).exists():
                raise self.error_cls(f"A model named '{n}' appeared while this run trained; choose another "
                                     "output name.")
        registered: list[Path] = []
        try:
            for st, n in names.items():
                os.rename(self.checkpoints[st], self.root / n)
                registered.append(self.root / n)
            os.rename(self.staging, self.final)  # the model appears complete or not at all
        except BaseException:
            for target in registered:
                shutil.rmtree(target, ignore_errors=True)
            raise
        for st, n in names.items():
            self.say(f"registered checkpoint '{n}' (step {st})")
        self.say(f"registered model '{self.name}' at {self.final}")
        self.phase("done", self.max_steps or 0, elapsed_s=round(time.time() - self.t_start, 2))
        return self.final


def write_record(folder: Path, info: dict) -> None:
    """lmscope.json: what made the model in `folder` (the registry and the views read it)."""
    (folder / "lmscope.json").write_text(json.dumps(info, indent=1))


def remove_checkpoints_of(name: str) -> None:
    """Remove registered checkpoints of an earlier run named `name` (an overwrite replaces the run)."""
    for d in paths.finetuned_dir().iterdir():
        try:
            info = json.loads((d / "lmscope.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("checkpoint_of") == name:
            shutil.rmtree(d, ignore_errors=True)


def train_checked(trainer, callback, stop, error_cls: type, cancelled_cls: type) -> None:
    """trainer.train(), then the endings every trainer here shares: out of GPU memory or a non-finite
    loss (callback.nan_step) as one sentence of `error_cls`, a cancel as `cancelled_cls`."""
    try:
        trainer.train()
    except torch.cuda.OutOfMemoryError:
        raise error_cls("Training ran out of GPU memory; lower the batch size or max length, or use LoRA.") from None
    if callback.nan_step is not None:
        raise error_cls(f"The loss became NaN/inf at step {callback.nan_step}; training stopped. Lower the learning "
                        "rate (or check the data).")
    if callback.cancelled or stop():
        raise cancelled_cls()


def positional(progress: Callable[[int, int, dict], None] | None) -> Progress | None:
    """The rows as the preference trainers' published callback takes them, progress(step, total,
    metrics): a stage as (step, max_steps, {"phase", ...}), a training step as (step, max_steps,
    the row without its phase and max_steps)."""
    if progress is None:
        return None

    def emit(row: dict) -> None:
        drop = ("phase", "max_steps") if row.get("phase") == "training" else ("step", "max_steps")
        progress(row.get("step", 0), row.get("max_steps"), {k: v for k, v in row.items() if k not in drop})

    return emit
