"""The transformers TrainerCallbacks of the Trainer-based runs: fine-tuning (SFTCallback) and the
preference trainers on TRL (PreferenceCallback). Both send their per-step rows in the one progress
shape of model_core.training.run ({"phase": "training", "step", "max_steps", ...}), stop between
steps on a cancel every process agrees on, and stop on a non-finite loss (nan_step; run.train_checked
turns it into the run's error).

Imported only inside a run: importing transformers' trainer takes seconds, and the web app, which
imports the training modules for their settings and views, never pays for it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from model_core.training import data_parallel
from model_core.training.preference_data import completion_text, verifiable_reward

Progress = Callable[[dict], None]


def quiet(trainer) -> None:
    """No console progress bar or printed log dicts from the Trainer (the rows go to `progress`)."""
    for c in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(c)


class StepCallback(TrainerCallback):
    """What every run's callback does per optimizer step: time the steps (train_time counts the
    steps, not this callback's own work) and stop after a step when should_stop() says so in any
    process (data_parallel.agreed: every process stops after the same step)."""

    def __init__(self, emit: Progress, stop: Callable[[], bool], max_steps: int):
        self.emit, self.stop, self.max_steps = emit, stop, max_steps
        self.history: list[dict] = []
        self.nan_step: int | None = None
        self.cancelled = False
        self.train_time = 0.0
        self.t_last: float | None = None
        self.t_train0: float | None = None

    def on_train_begin(self, args, state, control, **kw):
        self.t_last = self.t_train0 = time.time()

    def on_step_end(self, args, state, control, **kw):
        now = time.time()
        self.train_time += now - self.t_last
        self.t_last = now
        if data_parallel.agreed(self.stop()):
            self.cancelled = True
            control.should_training_stop = True
            control.should_evaluate = False
            control.should_log = False

    def _not_finite(self, value: float, state, control) -> None:
        if not math.isfinite(value):
            self.nan_step = state.global_step
            control.should_training_stop = True
            control.should_evaluate = False


# ---- fine-tuning ---------------------------------------------------------------------------------

class SFTCallback(StepCallback):
    """Fine-tuning's rows: {phase, step, max_steps, epoch, tokens_seen, tokens_per_s, elapsed_s (since
    the run started at t_start), eta_s, loss, lr, grad_norm, eval_loss}. `at_step(step)` (optional)
    runs at step 0 (train begin) and after every optimizer step that was not cancelled, outside the
    measured training time (samples, checkpoints)."""

    def __init__(self, emit: Progress, stop: Callable[[], bool], max_steps: int, t_start: float,
                 at_step: Callable[[int], None] | None = None):
        super().__init__(emit, stop, max_steps)
        self.t_start = t_start
        self.at_step = at_step
        self.last_eval: float | None = None

    def on_train_begin(self, args, state, control, **kw):
        if self.at_step is not None:
            self.at_step(0)
        super().on_train_begin(args, state, control, **kw)

    def on_step_end(self, args, state, control, **kw):
        super().on_step_end(args, state, control, **kw)
        if not self.cancelled and self.at_step is not None:
            self.at_step(state.global_step)
            self.t_last = time.time()

    def _row(self, state, **extra) -> dict:
        step = state.global_step
        elapsed = time.time() - self.t_train0
        eta = elapsed / step * (self.max_steps - step) if step else None
        toks = state.num_input_tokens_seen or 0
        return {"phase": "training", "step": step, "max_steps": self.max_steps,
                "epoch": round(state.epoch or 0.0, 4), "tokens_seen": int(toks),
                "tokens_per_s": toks / self.train_time if self.train_time > 0 else None,
                "elapsed_s": round(time.time() - self.t_start, 3),
                "eta_s": round(eta, 1) if eta is not None else None, **extra}

    def on_log(self, args, state, control, logs=None, **kw):
        logs = logs or {}
        if "loss" in logs:
            loss = float(logs["loss"])
            row = self._row(state, loss=loss, lr=logs.get("learning_rate"), eval_loss=None,
                            grad_norm=logs.get("grad_norm"))
            self.history.append(row)
            self.emit(row)
            self._not_finite(loss, state, control)
        self.t_last = time.time()

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        ev = (metrics or {}).get("eval_loss")
        if ev is not None:
            ev = float(ev)
            for r in reversed(self.history):
                if r["step"] == state.global_step:
                    r["eval_loss"] = ev
                    break
            self.last_eval = ev
            self.emit(self._row(state, eval_loss=ev, loss=None, lr=None))
            if not math.isfinite(ev):
                self.nan_step = state.global_step
                control.should_training_stop = True
        self.t_last = time.time()

    def summary(self, n_params, upto: int | None = None, train_time: float | None = None) -> dict:
        """Run metrics; upto: as they stood at that step (a checkpoint's record)."""
        hist = self.history if upto is None else [r for r in self.history if r["step"] <= upto]
        last = hist[-1] if hist else {}
        tps = last.get("tokens_per_s")
        first_loss = next((r["loss"] for r in hist if r.get("loss") is not None), None)
        evals = [r["eval_loss"] for r in hist if r.get("eval_loss") is not None]
        last_eval = self.last_eval if upto is None else (evals[-1] if evals else None)
        train_time = self.train_time if train_time is None else train_time
        return {"steps": last.get("step", 0), "train_seconds": round(train_time, 2),
                "tokens_seen": last.get("tokens_seen", 0), "tokens_per_s": tps,
                "first_loss": first_loss, "final_loss": last.get("loss"), "final_eval_loss": last_eval,
                "training_flops": 6 * n_params * last.get("tokens_seen", 0)}


class SettingsTensorBoard(TensorBoardCallback):
    """transformers' TensorBoard writer (sft.tensorboard_callback) that also writes the run's settings
    as text when training begins."""

    def __init__(self, tb_writer, settings: dict):
        super().__init__(tb_writer=tb_writer)
        self.settings = settings

    def on_train_begin(self, args, state, control, **kw):
        if self.tb_writer is not None:
            text = json.dumps(self.settings, indent=1).replace("\n", "\n    ")  # indented: a code block
            self.tb_writer.add_text("lmscope/settings", "    " + text)


# ---- reward model, DPO, GRPO (TRL) ------------------------------------------------------------------

# TRL's log keys -> the names of lmscope's rows, per kind
METRIC_KEYS = {
    "reward": {"accuracy": "accuracy", "margin": "margin", "mean_reward": "reward_mean", "min_reward": "reward_min",
               "max_reward": "reward_max"},
    "dpo": {"rewards/accuracies": "accuracy", "rewards/margins": "margin", "rewards/chosen": "reward_chosen",
            "rewards/rejected": "reward_rejected", "logps/chosen": "logp_chosen", "logps/rejected": "logp_rejected",
            "entropy": "entropy"},
    "grpo": {"reward": "reward_mean", "reward_std": "reward_std", "kl": "kl",
             "completions/mean_length": "completion_length", "completions/clipped_ratio": "truncated_fraction",
             "clip_ratio/region_mean": "clip_fraction", "frac_reward_zero_std": "zero_std_groups",
             "entropy": "entropy"},
}
COMMON_KEYS = {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "lr", "num_tokens": "tokens_seen"}


def grpo_groups(trainer, group_size: int) -> list[dict]:
    """This step's completions grouped by prompt, with TRL's rewards and advantages (read from the
    trainer's completion log, which holds the last generation batch)."""
    logs = getattr(trainer, "_logs", None)
    if not logs:
        return []
    n = int(getattr(trainer.args, "generation_batch_size", 0) or 0)
    prompts, comps, advs = list(logs["prompt"])[-n:], list(logs["completion"])[-n:], list(logs["advantages"])[-n:]
    rewards = list(logs["rewards"].get(verifiable_reward.__name__, []))[-n:]
    if not (len(prompts) == len(comps) == len(advs) == len(rewards) == n) or n % group_size:
        return []
    if any(prompts[i] != prompts[i - i % group_size] for i in range(n)):
        return []  # not laid out as TRL's RepeatSampler lays it out: no grouping to show
    groups = []
    for g in range(0, n, group_size):
        rs = [float(x) for x in rewards[g:g + group_size]]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (len(rs) - 1)) if len(rs) > 1 else 0.0
        p = prompts[g]
        groups.append({"prompt": completion_text(p[-1:] if isinstance(p, list) else p),
                       "completions": [completion_text(c) for c in comps[g:g + group_size]],
                       "rewards": rs, "advantages": [float(a) for a in advs[g:g + group_size]],
                       "mean": mean, "std": std})
    return groups


class PreferenceCallback(StepCallback):
    """The preference trainers' rows: TRL's logged metrics under lmscope's names (METRIC_KEYS), with
    {step, total, tokens_per_s, elapsed_s (since training began), eta_s}, GRPO's groups of the step
    and TRL's own keys under "trl". history keeps each row without its phase and max_steps. Set
    `trainer` once the trainer exists (GRPO reads its completion log)."""

    def __init__(self, kind: str, emit: Progress, stop: Callable[[], bool], max_steps: int,
                 group_size: int | None = None):
        super().__init__(emit, stop, max_steps)
        self.kind, self.group_size = kind, group_size
        self.trainer = None

    def on_log(self, args, state, control, logs=None, **kw):
        logs = dict(logs or {})
        if "loss" not in logs:
            return
        step, total = state.global_step, self.max_steps
        row: dict = {"step": step, "total": total}
        for src, dst in {**COMMON_KEYS, **METRIC_KEYS[self.kind]}.items():
            if logs.get(src) is not None:
                row[dst] = float(logs[src])
        if "tokens_seen" not in row and self.history:  # GRPO logs it only on steps that generate
            row["tokens_seen"] = self.history[-1].get("tokens_seen")
        toks = row.get("tokens_seen")
        row["tokens_per_s"] = toks / self.train_time if toks and self.train_time > 0 else None
        elapsed = time.time() - self.t_train0
        row["elapsed_s"] = round(elapsed, 2)
        row["eta_s"] = round(elapsed / step * (total - step), 1) if step else None
        if self.kind == "grpo" and self.trainer is not None and "reward_mean" in row:  # a step that generated
            groups = grpo_groups(self.trainer, self.group_size)
            if groups:
                row["groups"] = groups
                row["reward_group_std"] = sum(g["std"] for g in groups) / len(groups)
        row["trl"] = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in logs.items()}
        self.history.append(row)
        self.emit({"phase": "training", "max_steps": total, **row})
        if not math.isfinite(row["loss"]):
            self.nan_step = step
            control.should_training_stop = True
        self.t_last = time.time()

    def summary(self) -> dict:
        h = self.history
        last = h[-1] if h else {}
        keys = ("loss", "accuracy", "margin", "reward_mean", "reward_std", "kl", "completion_length")
        first_of = {k: next((r[k] for r in h if r.get(k) is not None), None) for k in keys}
        last_of = {k: next((r[k] for r in reversed(h) if r.get(k) is not None), None) for k in keys}
        return {"steps": last.get("step", 0), "train_seconds": round(self.train_time, 2),
                "tokens_seen": int(last.get("tokens_seen") or 0), "tokens_per_s": last.get("tokens_per_s"),
                **{f"first_{k}": v for k, v in first_of.items() if v is not None},
                **{f"final_{k}": v for k, v in last_of.items() if v is not None}}
