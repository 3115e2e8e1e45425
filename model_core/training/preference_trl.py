"""The preference trainers' shared harness on TRL: one run of a reward model, DPO or GRPO from a
loaded model to a registered one. `run_trl` does what every kind does (load a fresh trainable copy,
evaluate the held-out split, build the kind's TRL trainer, train, evaluate again, merge LoRA, save
with lmscope.json {kind, parent, training, dataset, metrics, before, after, history}); the name
checks, staging, progress rows, cancel and registration are model_core.training.run's; the kind
supplies `build` (its TRL trainer) and `evaluate` (its held-out evaluation). The train_* functions
of model_core.training.preference call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_core.training import data_parallel
from model_core.training.preference_settings import (
    GRPOSettings,
    PreferenceError,
    TrainingCancelled,
    TrainSettings,
    default_output_name,
    settings_json,
)
from model_core.training.run import TrainingRun, positional
from model_core.training.sft import count_params, load_for_training, quiet_datasets

ProgressFn = Callable[[int, int, dict], None]


@dataclass
class TrainResult:
    kind: str  # "reward" | "dpo" | "grpo"
    name: str  # the registered model's name
    path: Path  # <data dir>/models/<name>
    metrics: dict  # run summary: steps, train_seconds, tokens_seen, tokens_per_s, first/final loss, ...
    before: dict | None  # held-out evaluation before training
    after: dict | None  # ... and after
    history: list[dict] = field(default_factory=list)  # the per-step metrics rows
    info: dict = field(default_factory=dict)  # lmscope.json


def lora_config(s: TrainSettings, task_type: str):
    from peft import LoraConfig

    # as sft.apply_lora: every linear layer of the body (peft leaves the output head out)
    return LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                      task_type=task_type)


def common_args(s: TrainSettings, output_dir: Path, dev: torch.device) -> dict:
    """The TRL config arguments every kind shares: constant rate after warm-up, clipping at 1.0, a
    log row per step, no saving or evaluation by the trainer, bf16 on a GPU."""
    use_cuda = dev.type == "cuda"
    return dict(
        output_dir=str(output_dir), max_steps=s.max_steps,
        per_device_train_batch_size=data_parallel.per_process_batch(s.batch_size),
        gradient_accumulation_steps=1, learning_rate=s.learning_rate, lr_scheduler_type="constant_with_warmup",
        warmup_steps=s.warmup_steps, weight_decay=0.0, max_grad_norm=1.0, seed=s.seed, data_seed=s.seed,
        logging_steps=1, logging_nan_inf_filter=False, save_strategy="no", report_to="none", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, use_cpu=not use_cuda,
        bf16=use_cuda and torch.cuda.is_bf16_supported(), optim="adamw_torch",
    )


def run_trl(kind: str, model_name: str, s: TrainSettings, data, progress: ProgressFn | None,
            should_stop: Callable[[], bool] | None, log: Callable[[str], None] | None,
            build: Callable, evaluate: Callable, extra_info: Callable[[], dict] | None = None) -> TrainResult | None:
    """Load, evaluate, build the TRL trainer (build(model, tok, dev, scratch, callback) -> (trainer,
    eval_reference or None); scratch(sub) is a folder in the staging folder for the trainer's own
    files), train, evaluate, merge, save, register. progress(step, total, metrics) gets the run's
    rows through run.positional. None in a data-parallel process other than the main one."""
    name = s.output_name or default_output_name(model_name, kind, s.method)
    with TrainingRun(name, error_cls=PreferenceError, cancelled_cls=TrainingCancelled, overwrite=s.overwrite,
                     staging_kind="preference", progress=positional(progress), should_stop=should_stop, log=log,
                     max_steps=s.max_steps) as run:
        return _train(kind, model_name, s, data, run, build, evaluate, extra_info)


def _train(kind: str, model_name: str, s: TrainSettings, data, run: TrainingRun, build: Callable,
           evaluate: Callable, extra_info: Callable[[], dict] | None) -> TrainResult | None:
    from transformers import set_seed

    from model_core.training.trainer_callbacks import PreferenceCallback, quiet

    say, stop = run.say, run.should_stop
    run.phase("loading model")
    quiet_datasets()
    set_seed(s.seed)
    model, tok, dev, added_template = load_for_training(model_name, s.device, PreferenceError, say)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"data: {data.describe()}")
    run.check_stop()

    main = data_parallel.is_main_process()  # with several GPUs, the one process that evaluates and saves
    run.phase("evaluating before")
    before = evaluate("before", model, tok, None) if main else None
    if before is not None:
        say(f"held-out before: {_headline(kind, before)}")
    group = s.num_generations if isinstance(s, GRPOSettings) else None
    cb = PreferenceCallback(kind, run.progress, stop, s.max_steps, group)
    trainer, eval_ref = build(model, tok, dev, run.scratch, cb)
    cb.trainer = trainer
    quiet(trainer)
    total, trainable = count_params(trainer.model)
    say(f"training {kind} {s.method} ({trainable:,} of {total:,} parameters trainable) for {s.max_steps} "
        f"steps, lr {s.learning_rate:g}, on {dev}")
    run.check_stop()
    run.train(trainer, cb)
    trained = trainer.model
    del trainer
    if not main:
        return None
    if hasattr(trained, "peft_config"):
        trained = trained.merge_and_unload()
    trained.eval()
    run.phase("evaluating after", s.max_steps)
    after = evaluate("after", trained, tok, eval_ref)
    if after is not None:
        say(f"held-out after: {_headline(kind, after)}")
    run.check_stop()

    run.phase("saving", s.max_steps)
    summary = cb.summary()
    history = [{k: v for k, v in r.items() if k not in ("groups", "trl")} for r in cb.history]
    info = {
        "kind": kind, "parent": model_name, "parameters": n_params, "training": settings_json(s),
        "dataset": data.describe(), "metrics": summary, "before": before, "after": after, "history": history,
        "created": time.time(), "chat_template_added": added_template,
        "description": _description(kind, model_name, s),
        **(extra_info() if extra_info else {}),
    }
    if kind == "grpo":
        info["groups"] = _thin_groups(cb.history)
    run.save(trained, tok, info)
    path = run.register()
    return TrainResult(kind=kind, name=run.name, path=path, metrics=summary, before=before, after=after,
                       history=cb.history, info=info)


def _headline(kind: str, ev: dict) -> str:
    if kind == "grpo":
        return f"mean reward {ev['mean_reward']:.3f} over {ev['n']} prompts (mean length {ev['mean_length']:.1f})"
    if kind == "reward":
        return f"accuracy {ev['accuracy']:.3f}, margin {ev['margin']:.3f} over {ev['n']} pairs"
    s = f"log-prob accuracy {ev['logp_accuracy']:.3f}, margin {ev['logp_margin']:.2f}"
    if "accuracy" in ev:
        s += f"; implicit-reward accuracy {ev['accuracy']:.3f}, margin {ev['margin']:.3f}"
    return s + f" over {ev['n']} pairs"


def _description(kind: str, model: str, s: TrainSettings) -> str:
    if kind == "reward":
        return f"reward model (a score head, not a language model) trained from {model}"
    if kind == "dpo":
        return f"DPO ({s.method}, beta {s.beta:g}) of {model}"
    return f"GRPO ({s.method}, {s.loss_type}) of {model}"


def _thin_groups(history: list[dict], max_steps: int = 20) -> list[dict]:
    rows = [r for r in history if r.get("groups")]
    if len(rows) > max_steps:
        keep = {round(i * (len(rows) - 1) / (max_steps - 1)) for i in range(max_steps)}
        rows = [r for i, r in enumerate(rows) if i in keep]
    return [{"step": r["step"], "groups": r["groups"]} for r in rows]


def hf_dataset(rows: list[dict]):
    """A datasets.Dataset of the rows, as TRL's trainers take their data."""
    from datasets import Dataset

    return Dataset.from_list(rows)


def limit(rows: list, n: int) -> list:
    """The first n held-out rows (none when n is 0)."""
    return rows[:n] if n else []
