"""After SFT as background jobs: kinds 'reward' (a Bradley-Terry reward model), 'dpo', 'grpo' and 'ppo'
(PPO against a reward model the reward job trained), each running
model_core.training.preference.train_<kind> on the worker.

Params: model (a registry or fine-tuned name; a local directory from the CLI only), dataset
('builtin', 'builtin:<set>[,<set>]', or an uploaded JSONL: then 'upload' and dataset_file) and the
fields of the kind's settings class (preference.RewardSettings / DPOSettings / GRPOSettings:
method, learning_rate, max_steps, batch_size, beta, loss_type, num_generations, ...). Submission
validates the settings (one sentence), the model's name and the dataset: an upload is parsed with
model_core.training.preference_data's parser, so malformed lines are reported by line number and nothing is
queued. The output name is fixed at submission (default '<model>-<kind>-<method>-<job id>') and
refused when taken.

Progress: 'loading model' (0-3 %), 'evaluating before' (3-10 %), 'training' (10-88 %, by step),
'evaluating after' (88-97 %), 'saving' (97-100 %). The record gets `preference`: {kind, history:
[{step, total, loss, grad_norm, lr, tokens_seen, tokens_per_s, elapsed_s, eta_s, and per kind:
accuracy, margin, reward_chosen/rejected, logp_chosen/rejected (dpo); accuracy, margin,
reward_mean/min/max (reward); reward_mean, reward_std, reward_group_std, kl, completion_length,
truncated_fraction, clip_fraction, zero_std_groups (grpo); reward_mean, reward_std, kl, kl_k3, beta,
non_score_reward, policy_loss, value_loss, clip_fraction, value_clip_fraction, approx_kl, entropy,
value_mean, return_mean, advantage_std, completion_length, step_s (ppo)}], latest, groups (grpo: the
last step's completions per prompt with rewards and advantages), samples (ppo: the last step's first
rollouts token by token: tokens, kl, rewards, values, advantages, returns, score), model_name, dataset
(uploads: {file, lines}), and at the end: before, after (held-out evaluation:
preference.preference_eval / reward_eval / task_eval / ppo_eval), metrics (the run's summary),
model_path, data (the data's description), samples_by_step (ppo)}.

PPO params add reward_model: a reward model the reward job registered, on the policy's tokenizer;
a missing one, a model that is not a reward model or one on another tokenizer is refused at
submission with one sentence (model_core.training.ppo.check_reward_model), nothing queued.

Cancel: the run polls the job's cancel flag (job.cancelled is its should_stop) between steps and
evaluation batches (the revoke from jobs.cancel_job also terminates the process); the core writes
into a staging folder and renames it into <data dir>/models only when everything succeeded, so a
cancelled, failed or killed run registers nothing. Claim, heartbeat, cancel and the job's ending are
tasks.lifecycle's.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import fields
from pathlib import Path

from model_core.core.errors import SettingsError
from model_core.training import preference as P
from model_core.training import preference_data as D
from model_core.training import sft
from tasks import config, kinds
from tasks.celery_app import app
from tasks.lifecycle import CurvesProgress, Done, Job, JobTask, queue

KINDS = (*P.KINDS, "ppo")  # ("reward", "dpo", "grpo", "ppo")
TASK_KINDS = ("grpo", "ppo")  # their data: prompts with answers (preference_data.TaskData)
_PUSH_EVERY_S = 0.5
PHASES = {"loading model": (0.0, 0.03), "evaluating before": (0.03, 0.10), "training": (0.10, 0.88),
          "evaluating after": (0.88, 0.97), "saving": (0.97, 1.0), "done": (1.0, 1.0)}
_NOT_JOB_SETTINGS = ("device",)  # the worker's to choose


def _known_model(name: str, what: str, allow_paths: bool) -> None:
    from model_core.core.registry import REGISTRY, finetuned_path

    if not isinstance(name, str) or not name.strip():
        raise SettingsError(f"The {what} must be a model name.")
    ft = finetuned_path(name)
    if ft is not None and _made_by(ft) == "reward":
        raise SettingsError(f"'{name}' is a reward model (a score head), not a language model; pick a language model "
                            f"as the {what}.")
    if name in REGISTRY or ft is not None or (allow_paths and Path(name).is_dir()):
        return
    raise SettingsError(f"Unknown {what} '{name}'; pick a registry or fine-tuned model.")


def _made_by(folder: Path) -> str | None:
    try:
        return json.loads((folder / "lmscope.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def validate_params(kind: str, params: dict, allow_paths: bool = False) -> dict:
    """The params as the worker will use them (JSON-able): model, dataset, dataset_file and the
    kind's checked settings. SettingsError (one sentence) for a bad value, an unknown setting or
    model. Local model directories only with allow_paths (the CLI on the server)."""
    from model_core.core.registry import DEFAULT_MODEL

    if kind not in KINDS:
        raise SettingsError(f"Unknown kind '{kind}'; use {', '.join(KINDS)}.")
    p = {k: v for k, v in dict(params or {}).items() if not (v is None or v == "")}
    model = p.pop("model", DEFAULT_MODEL)
    dataset = str(p.pop("dataset", D.BUILTIN)).strip() or D.BUILTIN
    dataset_file = p.pop("dataset_file", None)
    bad = [k for k in _NOT_JOB_SETTINGS if k in p]
    if bad:
        raise SettingsError(f"Setting '{bad[0]}' is chosen by the worker, not by a job.")
    s = P.validate_settings(kind, p)
    _known_model(model, "model", allow_paths)
    if kind == "dpo" and s.reference:
        _known_model(s.reference, "reference model", allow_paths)
    if kind == "ppo":
        P.check_reward_model(model, s.reward_model, allow_paths)
    if dataset != "upload":
        _check_builtin(kind, dataset)
    out = {"model": model, "dataset": dataset, "dataset_file": dataset_file}
    out.update({f.name: getattr(s, f.name) for f in fields(s) if f.name not in _NOT_JOB_SETTINGS})
    return out


def _check_builtin(kind: str, spec: str) -> None:
    """'builtin' or 'builtin:<sets>' of the kind's built-in data; anything else is refused (a file
    comes as an upload)."""
    if spec != D.BUILTIN and not spec.startswith(D.BUILTIN + ":"):
        raise SettingsError(f"Dataset must be 'builtin', 'builtin:<set>' or an uploaded JSONL file, got {spec!r}.")
    try:  # a handful of examples: the check that the named sets exist, cheap
        if kind in TASK_KINDS:
            D.task_dataset(spec, None, 2, 1, 0)
        else:
            D.preference_dataset(spec, 2, 1, 0)
    except D.DatasetError as e:
        raise SettingsError(str(e)) from None


def check_dataset(kind: str, path, settings: dict | None = None):
    """Parse an uploaded JSONL as the run will (preference_data's parser), without queueing:
    -> PreferenceData (reward, dpo) or TaskData (grpo, ppo). Raises PreferenceDataError naming every
    malformed line by number (DatasetError for a missing or too large file)."""
    f = Path(path)
    if not f.is_file():
        raise D.PreferenceDataError(f"Dataset file '{f.name}' does not exist.")
    if f.stat().st_size > config.upload_max_bytes():
        raise D.PreferenceDataError(f"Dataset file '{f.name}' is larger than {config.upload_max_bytes() // 2**20} MB.")
    s = settings or {}
    frac, seed = s.get("eval_fraction", 0.1), s.get("seed", 0)
    if kind in TASK_KINDS:
        return D.load_task_jsonl(f, s.get("verifier"), frac, seed)
    return D.load_preference_jsonl(f, frac, seed)


def _file_path(f) -> Path:
    return Path(f if isinstance(f, (str, Path)) else getattr(f, "name", f))


def submit_preference(kind: str, params: dict, owner: str = "cli", files: list | None = None) -> dict:
    """Validate, record and queue a reward / DPO / GRPO / PPO job (called by tasks.jobs.submit). `files`:
    one uploaded JSONL (then dataset = 'upload'); the CLI also passes params['dataset'] as a path."""
    if kind not in KINDS:
        raise SettingsError(f"Unknown kind '{kind}'.")
    p = dict(params or {})
    paths = [_file_path(f) for f in (files or [])]
    ds = str(p.get("dataset") or D.BUILTIN).strip()
    if not paths and ds != "upload" and not (ds == D.BUILTIN or ds.startswith(D.BUILTIN + ":")):
        if owner != "cli":  # a server path is the CLI's to name; the web uploads a file
            raise SettingsError(f"Dataset must be 'builtin', 'builtin:<set>' or an uploaded JSONL file, got {ds!r}.")
        paths = [Path(ds)]
    if len(paths) > 1:
        raise D.DatasetError("Upload one JSONL dataset file.")
    if ds == "upload" and not paths:
        raise D.DatasetError("No dataset file was uploaded.")
    if paths:
        p["dataset"] = "upload"
    p.pop("dataset_file", None)
    v = validate_params(kind, p, allow_paths=owner == "cli")
    data = None
    if paths:  # malformed lines fail here, each named by its line number, and nothing is queued
        data = check_dataset(kind, paths[0], v)
        v["dataset_file"] = paths[0].name

    def prepare(rec: dict) -> None:
        from model_core.core.checkpoints import name_taken

        if not v["output_name"]:
            v["output_name"] = P.default_output_name(v["model"], kind, v["method"], suffix=rec["id"][:8])
        name = v["output_name"]
        why = name_taken(name, bool(v.get("overwrite")))
        if why:
            raise SettingsError(why)
        rec["preference"] = {"kind": kind, "history": [], "latest": None, "model_name": name,
                             "before": None, "after": None}
        if paths:
            inp = config.job_dir(rec["id"]) / "input"
            inp.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(paths[0], inp / paths[0].name)
            rec["preference"]["dataset"] = {"file": paths[0].name, "train": len(data.train),
                                            "test": len(data.test), **data.describe()}

    return queue(TASKS[kind], kind, v, owner, prepare)


class PreferenceProgress(CurvesProgress):
    """Progress of a reward / DPO / GRPO / PPO run: its curves, GRPO's latest groups and PPO's latest
    samples, in record['preference']."""

    section = "preference"

    def __init__(self, job_id: str, attempt: int):
        super().__init__(job_id, attempt)
        self.groups: list[dict] | None = None
        self.samples: list[dict] | None = None

    def on_step(self, step: int, total: int, metrics: dict) -> None:
        """The train_* progress callback: a phase row, or a row per optimizer step."""
        phase = metrics.get("phase")
        force = phase is not None
        with self.lock:
            if phase is not None:
                lo, _hi = PHASES.get(phase, (self.fraction, self.fraction))
                self.stage, self.fraction, self.est = phase, max(self.fraction, lo), None
                self.row_eta = 0.0 if phase == "done" else None  # evaluating / saving: the elapsed-time estimate
            else:
                lo, hi = PHASES["training"]
                self.stage, self.est = "training", None
                self.fraction = max(self.fraction, lo + (hi - lo) * step / max(1, total))
                row = {k: v for k, v in metrics.items() if k not in ("groups", "trl", "samples")}
                self.history.append(row)
                self.latest = row
                self.row_eta = row.get("eta_s")
                if metrics.get("groups"):
                    self.groups = metrics["groups"]
                    force = True
                if metrics.get("samples"):
                    self.samples = metrics["samples"]
        self.push_if_due(_PUSH_EVERY_S, force=force or step >= total)

    def snapshot(self) -> dict:
        out = super().snapshot()
        if self.groups is not None:
            out["groups"] = {"step": (self.latest or {}).get("step"), "groups": self.groups}
        if self.samples is not None:
            out["samples"] = {"step": (self.latest or {}).get("step"), "samples": self.samples}
        return out


def _headline(kind: str, before: dict | None, after: dict | None) -> str:
    if not before or not after:
        return ""
    if kind == "ppo":
        return (f", held-out reward-model score {before['mean_score']:.3f} -> {after['mean_score']:.3f} "
                f"(verifiable reward {before['mean_reward']:.3f} -> {after['mean_reward']:.3f})")
    if kind == "grpo":
        return f", held-out mean reward {before['mean_reward']:.3f} -> {after['mean_reward']:.3f}"
    if kind == "reward":
        return (f", held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, "
                f"margin {before['margin']:.3f} -> {after['margin']:.3f}")
    s = f", held-out log-prob accuracy {before['logp_accuracy']:.3f} -> {after['logp_accuracy']:.3f}"
    if "margin" in after:
        s += f", implicit-reward margin {before.get('margin', 0.0):.3f} -> {after['margin']:.3f}"
    return s


def run_preference(job: Job, kind: str) -> Done:
    job.cancel_note = "cancelled; no model was registered"
    params = dict(job.params)
    model, dataset, dataset_file = params.pop("model"), params.pop("dataset"), params.pop("dataset_file", None)
    if dataset == "upload":
        dataset = str(job.dir / "input" / dataset_file)
    settings = P.validate_settings(kind, params)
    if kind == "ppo":  # one process: the rollouts, the reference and the reward model live beside the policy
        res = P.train_ppo(model, dataset, settings, progress=job.progress.on_step, should_stop=job.cancelled,
                          log=job.say)
    else:
        res = P.train_on_gpus(kind, model, dataset, settings, progress=job.progress.on_step,
                              should_stop=job.cancelled, log=job.say)
    job.progress.report(before=res.before, after=res.after, metrics=res.metrics, model_name=res.name,
                        model_path=str(res.path), data=res.info.get("dataset"),
                        **({"groups_by_step": res.info["groups"]} if res.info.get("groups") else {}),
                        **({"samples_by_step": res.info["samples"], "reward_model": res.info["reward_model"]}
                           if kind == "ppo" else {}))
    what = "reward model" if kind == "reward" else "model"
    diff = None
    if kind != "reward":  # a reward model scores; its next-token distributions are not what it learned
        from tasks.diff_job import precompute  # "What changed", ready when the run's page opens

        diff = precompute(job, res.name, model)
    return job.done(f"done: {what} '{res.name}' registered{_headline(kind, res.before, res.after)}",
                    *[res.path / n for n in ("lmscope.json",) if (res.path / n).exists()], *([diff] if diff else []))


_CANCELLED = (P.TrainingCancelled, sft.SFTCancelled)


@app.task(bind=True, base=JobTask, name="lmscope.reward", progress_cls=PreferenceProgress, cancelled_by=_CANCELLED)
def run_reward_job(self, job: Job) -> Done:
    return run_preference(job, "reward")


@app.task(bind=True, base=JobTask, name="lmscope.dpo", progress_cls=PreferenceProgress, cancelled_by=_CANCELLED)
def run_dpo_job(self, job: Job) -> Done:
    return run_preference(job, "dpo")


@app.task(bind=True, base=JobTask, name="lmscope.grpo", progress_cls=PreferenceProgress, cancelled_by=_CANCELLED)
def run_grpo_job(self, job: Job) -> Done:
    return run_preference(job, "grpo")


@app.task(bind=True, base=JobTask, name="lmscope.ppo", progress_cls=PreferenceProgress, cancelled_by=_CANCELLED)
def run_ppo_job(self, job: Job) -> Done:
    return run_preference(job, "ppo")


TASKS = {"reward": run_reward_job, "dpo": run_dpo_job, "grpo": run_grpo_job, "ppo": run_ppo_job}


# ---- CLI: `lmscope jobs submit reward|dpo|grpo|ppo ...` (wired from tasks/cli.py) ---------------

def add_preference_arguments(s) -> None:
    """Options for kinds 'reward', 'dpo', 'grpo', 'ppo'; flags another kind defined (--model, --lr,
    --max-steps, --batch-size, --method, --lora-rank, --dataset, ...) are shared."""
    add = kinds.options(s, "reward / dpo / grpo / ppo (after SFT: reward model, DPO, GRPO, PPO)")
    add("--model", default=None, help="model to train (default: the default model)")
    add("--dataset", default="builtin",
        help="'builtin', 'builtin:date,style' (reward/dpo), 'builtin:arithmetic,date' (grpo/ppo), or a .jsonl path")
    add("--method", choices=["full", "lora"], default=None, help="full or lora (default per kind)")
    add("--lora-rank", type=int, default=None)
    add("--lr", type=float, default=None, help="learning rate (default per kind and method)")
    add("--max-steps", type=int, default=None)
    add("--batch-size", type=int, default=None, help="reward/dpo: pairs per step")
    add("--max-length", type=int, default=None)
    add("--eval-fraction", type=float, default=None)
    add("--seed", type=int, default=None)
    add("--output-name", default=None, help="name of the registered model")
    add("--warmup-steps", type=int, default=None)
    add("--train-size", type=int, default=None, help="reward/dpo/grpo: built-in training examples")
    add("--eval-examples", type=int, default=None, help="reward/dpo/grpo: held-out examples evaluated before/after")
    add("--beta", type=float, default=None,
        help="dpo: implicit KL strength (default 0.1); grpo: KL penalty (default 0.04, 0 = none); ppo: KL "
             "coefficient (default 0.05; the start value with --kl-target)")
    add("--loss-type", default=None,
        help=f"dpo: {', '.join(P.DPO_LOSS_TYPES)}; grpo: {', '.join(P.GRPO_LOSS_TYPES)}")
    add("--reference", default=None, help="dpo: reference model (default: the starting model)")
    add("--center-rewards", type=float, default=None, help="reward: coefficient of mean((r_c + r_r)^2)")
    add("--group-size", type=int, default=None,
        help="grpo: completions per prompt (num_generations, default 8); ppo: rollouts per prompt (default 4)")
    add("--prompts-per-step", type=int, default=None, help="grpo/ppo: prompts per step (default 2)")
    add("--max-completion-length", type=int, default=None, help="grpo: tokens per completion (default 12; ppo 16)")
    add("--temperature", type=float, default=None, help="grpo: sampling temperature (default 0.7; ppo 1.0)")
    add("--epsilon", type=float, default=None, help="grpo/ppo: PPO clip (default 0.2)")
    add("--epsilon-high", type=float, default=None, help="grpo: upper clip (dapo default 0.28)")
    add("--num-iterations", type=int, default=None, help="grpo: optimizer passes per generated batch")
    add("--verifier", default=None, help=f"grpo uploads: {', '.join(D.VERIFIERS)}")
    add("--reward-model", default=None, help="ppo: a reward model the reward job trained (same tokenizer)")
    add("--kl-target", type=float, default=None, help="ppo: adaptive KL towards this many nats (default: fixed beta)")
    add("--value-clip", type=float, default=None, help="ppo: value clip range (default 0.2)")
    add("--vf-coef", type=float, default=None, help="ppo: value loss coefficient (default 0.1)")
    add("--gamma", type=float, default=None, help="ppo: discount (default 1.0)")
    add("--lam", type=float, default=None, help="ppo: GAE lambda (default 0.95)")
    add("--ppo-epochs", type=int, default=None, help="ppo: optimizer steps per batch of rollouts (default 4)")


_COMMON = {"method": "method", "lora_rank": "lora_rank", "learning_rate": "lr", "max_steps": "max_steps",
           "batch_size": "batch_size", "max_length": "max_length", "eval_fraction": "eval_fraction", "seed": "seed",
           "output_name": "output_name", "warmup_steps": "warmup_steps", "builtin_train_size": "train_size",
           "eval_examples": "eval_examples"}
_PER_KIND = {
    "reward": {"center_rewards": "center_rewards"},
    "dpo": {"beta": "beta", "loss_type": "loss_type", "reference": "reference"},
    "grpo": {"beta": "beta", "loss_type": "loss_type", "num_generations": "group_size",
             "prompts_per_step": "prompts_per_step", "max_completion_length": "max_completion_length",
             "temperature": "temperature", "epsilon": "epsilon", "epsilon_high": "epsilon_high",
             "num_iterations": "num_iterations", "verifier": "verifier"},
    "ppo": {"reward_model": "reward_model", "beta": "beta", "num_generations": "group_size",
            "prompts_per_step": "prompts_per_step", "max_completion_length": "max_completion_length",
            "temperature": "temperature", "epsilon": "epsilon", "kl_target": "kl_target", "value_clip": "value_clip",
            "vf_coef": "vf_coef", "gamma": "gamma", "lam": "lam", "ppo_epochs": "ppo_epochs"},
}


def preference_params_from_args(args) -> tuple[dict, list]:
    """(params, files) for `lmscope jobs submit <reward|dpo|grpo|ppo>`; a flag of another kind is refused."""
    from model_core.core.registry import DEFAULT_MODEL

    kind = args.kind
    mine = {**_COMMON, **_PER_KIND[kind]}
    others = {a for k, m in _PER_KIND.items() if k != kind for a in m.values()} - set(mine.values())
    given = sorted(a for a in others if getattr(args, a, None) is not None)
    if given:
        raise SettingsError(f"--{given[0].replace('_', '-')} is not an option of a '{kind}' job.")
    params = {key: getattr(args, attr, None) for key, attr in mine.items()}
    if params["method"] is None and params["lora_rank"]:
        params["method"] = "lora"
    params["model"] = args.model or DEFAULT_MODEL
    ds = getattr(args, "dataset", None) or D.BUILTIN
    builtin = ds == D.BUILTIN or ds.startswith(D.BUILTIN + ":")
    params["dataset"] = ds if builtin else "upload"
    return {k: v for k, v in params.items() if v is not None}, ([] if builtin else [ds])


_HELP = {"reward": "a Bradley-Terry reward model (score head) on preference pairs",
         "dpo": "direct preference optimisation (full or LoRA) on preference pairs",
         "grpo": "GRPO / Dr. GRPO / DAPO with verifiable rewards on prompts with answers",
         "ppo": "RLHF: PPO against a reward model (KL penalty, GAE, value head) on prompts"}

for _k in KINDS:
    kinds.register(kinds.JobKind(_k, validate=lambda p, _k=_k: validate_params(_k, p), task=TASKS[_k],
                                 submit=lambda p, owner="cli", files=None, _k=_k: submit_preference(_k, p, owner, files),
                                 add_arguments=add_preference_arguments, params_from_args=preference_params_from_args,
                                 help=_HELP[_k]))
