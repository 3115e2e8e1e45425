"""The preference trainers' settings, errors and names: RewardSettings, DPOSettings, GRPOSettings,
PPOSettings (validate_settings: one sentence per bad value), the loss variants they offer (DPO_LOSS_TYPES,
GRPO_LOSS_TYPES, described), the default learning rates and the default output name.
Re-exported by model_core.training.preference, the module callers import."""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from model_core.core.checkpoints import valid_output_name
from model_core.core.errors import SettingsError
from model_core.training.preference_data import VERIFIERS
from model_core.training.sft_settings import SFTCancelled, SFTError

KINDS = ("reward", "dpo", "grpo")  # the TRL kinds; PPO (model_core.training.ppo) is its own loop


class PreferenceError(SFTError):
    """A run that cannot start or did not finish; str() is one sentence for the user."""


class TrainingCancelled(SFTCancelled):
    """should_stop() asked the run to stop; nothing was registered."""


# =============================================================================================
# Settings

@dataclass
class TrainSettings:
    method: str = "full"  # "full" | "lora"
    learning_rate: float | None = None  # default per method and kind (see default_lr)
    max_steps: int = 20
    batch_size: int = 8  # preference pairs per step (GRPO: prompts_per_step x num_generations instead)
    max_length: int = 256  # tokens of prompt + completion
    lora_rank: int = 8
    lora_alpha: float | None = None  # default 2 x rank
    warmup_steps: int = 0
    seed: int = 0
    builtin_train_size: int = 128
    eval_examples: int = 40  # held-out examples evaluated before and after (0 = skip)
    eval_fraction: float = 0.1  # of an upload, held out
    output_name: str | None = None  # default "<model>-<kind>-<method>-<time>"
    overwrite: bool = False
    device: str | None = None


@dataclass
class RewardSettings(TrainSettings):
    max_steps: int = 12  # the measured built-in run (bench/preference.py)
    batch_size: int = 4
    builtin_train_size: int = 48
    eval_examples: int = 24
    center_rewards: float | None = None  # coefficient of mean((r_c + r_r)^2), keeps scores near 0


@dataclass
class DPOSettings(TrainSettings):
    # the defaults below are the measured built-in run (bench/preference.py); LoRA: see the bench too
    max_steps: int = 12
    batch_size: int = 4
    builtin_train_size: int = 48
    eval_examples: int = 24
    beta: float = 0.1  # strength of the implicit KL: higher keeps the policy nearer the reference
    loss_type: str = "sigmoid"  # "sigmoid" (DPO), "ipo", "hinge" (TRL's names)
    reference: str | None = None  # default: the starting model itself


@dataclass
class GRPOSettings(TrainSettings):
    method: str = "lora"  # the defaults below are the measured built-in run (bench/preference.py)
    loss_type: str = "grpo"  # "grpo" | "dr_grpo" | "dapo" (GRPO_LOSS_TYPES)
    beta: float = 0.04  # KL penalty to the reference (0 = none, and no KL shown)
    num_generations: int = 8  # completions per prompt (the group)
    prompts_per_step: int = 2
    max_completion_length: int = 12
    temperature: float = 0.7
    epsilon: float = 0.2  # PPO clip: ratio kept in [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # default epsilon; DAPO's clip-higher: 0.28
    num_iterations: int = 1  # optimizer passes over each generated batch (mu); clipping acts only when > 1
    verifier: str | None = None  # for uploads whose lines name none
    builtin_train_size: int = 64
    eval_examples: int = 20
    max_steps: int = 20


@dataclass
class PPOSettings(TrainSettings):
    """PPO against a reward model (model_core.training.ppo); batch_size = prompts_per_step x num_generations."""
    method: str = "lora"
    reward_model: str | None = None  # a model trained by the reward job, on the policy's tokenizer (required)
    num_generations: int = 4  # sampled rollouts per prompt
    prompts_per_step: int = 2
    max_completion_length: int = 16
    temperature: float = 1.0  # sampling; log-probs are of the same temperature-scaled policy
    beta: float = 0.05  # KL penalty coefficient (the start value when kl_target is set)
    kl_target: float | None = None  # nats per response; set: adaptive beta (Ziegler et al.), None: fixed
    kl_horizon: int = 10_000
    epsilon: float = 0.2  # policy ratio clipped to [1 - epsilon, 1 + epsilon]
    value_clip: float = 0.2  # value moves at most this far from the rollout's value per update
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    ppo_epochs: int = 4  # optimizer steps on each batch of rollouts
    whiten_advantages: bool = True
    value_learning_rate: float | None = None  # default 10 x learning_rate: the value head starts at zero
    show_samples: int = 3  # rollouts per step kept token by token for the page
    builtin_train_size: int = 64
    eval_examples: int = 16
    max_steps: int = 10


SETTINGS_CLASSES = {"reward": RewardSettings, "dpo": DPOSettings, "grpo": GRPOSettings, "ppo": PPOSettings}
DPO_LOSS_TYPES = {
    "sigmoid": "DPO: -log sigmoid(beta * (chosen log-ratio - rejected log-ratio))",
    "ipo": "IPO: (margin of the length-normalised log-ratios - 1 / (2 beta))^2, a squared loss that does not "
           "push the margin to infinity",
    "hinge": "SLiC hinge: max(0, 1 - beta * margin)",
}

# What each GRPO variant changes, from the formulas TRL 1.x implements. With G completions o_i of one
# prompt, rewards r_i, token ratio rho_it = pi(o_it) / pi_old(o_it) and token loss
# l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) + beta KL_it:
GRPO_LOSS_TYPES = {
    "grpo": "GRPO (DeepSeekMath): advantage A_i = (r_i - mean r) / std r within the prompt's group; loss = "
            "mean over completions of (1/|o_i|) sum_t l_it, so each completion's tokens are averaged over its own "
            "length: a long wrong answer is penalised less per token, a short right one rewarded more (length bias).",
    "dr_grpo": "Dr. GRPO: A_i = r_i - mean r (no division by the group's std, which over-weights prompts that are "
               "almost always right or wrong); loss = sum_it l_it / (G x max_completion_length), a constant in "
               "place of each completion's length, which removes the length bias.",
    "dapo": "DAPO: A_i = (r_i - mean r) / std r; loss = sum_it l_it / sum_i |o_i| (every token of the batch weighs "
            "the same); clip-higher: eps_high = 0.28 > eps_low = 0.2 lets unlikely tokens with positive advantage "
            "grow further (acts only when num_iterations > 1, since the ratio is 1 on the first pass). TRL has no "
            "dynamic sampling: groups whose rewards are all equal get zero advantage and no gradient.",
}



def default_lr(kind: str, method: str) -> float:
    """Learning rates that move SmolLM2-135M visibly in 20-40 steps."""
    full = {"reward": 2e-5, "dpo": 1e-5, "grpo": 1e-5, "ppo": 1e-5}[kind]
    return full * 20 if method == "lora" else full


def validate_settings(kind: str, raw: TrainSettings | dict | None) -> TrainSettings:
    """A checked copy of the settings for `kind` (SettingsError, one sentence, for anything wrong)."""
    if kind not in SETTINGS_CLASSES:
        raise SettingsError(f"Unknown training kind {kind!r}; use {', '.join(SETTINGS_CLASSES)}.")
    cls = SETTINGS_CLASSES[kind]
    if raw is None:
        d = {}
    elif isinstance(raw, dict):
        d = dict(raw)
    elif isinstance(raw, cls):
        d = asdict(raw)
    else:
        raise SettingsError(f"{kind} needs {cls.__name__}, got {type(raw).__name__}.")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise SettingsError(f"Unknown {kind} setting(s): {', '.join(unknown)}.")
    s = cls(**{k: v for k, v in d.items() if v is not None or k in ("learning_rate", "lora_alpha", "output_name",
                                                                      "device", "epsilon_high", "verifier",
                                                                      "reference", "center_rewards",
                                                                      "reward_model", "kl_target",
                                                                      "value_learning_rate")})

    def num(name, cast, lo, hi, optional=False):
        v = getattr(s, name)
        if v is None and optional:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (cast is int and float(v) != int(v)):
            raise SettingsError(f"Setting '{name}' must be {'an integer' if cast is int else 'a number'}, got {v!r}.")
        if not math.isfinite(float(v)) or not lo <= v <= hi:
            raise SettingsError(f"Setting '{name}' must be between {lo} and {hi}, got {v}.")
        setattr(s, name, cast(v))

    s.method = str(s.method).lower()
    if s.method not in ("full", "lora"):
        raise SettingsError(f"Method must be 'full' or 'lora', got {s.method!r}.")
    num("learning_rate", float, 1e-9, 1.0, optional=True)
    num("max_steps", int, 1, 10**6)
    num("batch_size", int, 1, 4096)
    num("max_length", int, 16, 1 << 16)
    num("lora_rank", int, 1, 1024)
    num("lora_alpha", float, 1e-6, 1e6, optional=True)
    num("warmup_steps", int, 0, 10**6)
    num("seed", int, 0, 2**31 - 1)
    num("builtin_train_size", int, 2, 100_000)
    num("eval_examples", int, 0, 10_000)
    num("eval_fraction", float, 0.0, 0.5)
    if s.output_name is not None:
        s.output_name = str(s.output_name).strip() or None
        if s.output_name and not valid_output_name(s.output_name):
            raise SettingsError("The output name may use letters, digits, '.', '_' and '-' (max 100), and must "
                                "start with a letter or digit.")
    if isinstance(s, RewardSettings):
        num("center_rewards", float, 0.0, 100.0, optional=True)
    if isinstance(s, DPOSettings):
        num("beta", float, 1e-4, 100.0)
        if s.loss_type not in DPO_LOSS_TYPES:
            raise SettingsError(f"DPO loss type must be one of {', '.join(DPO_LOSS_TYPES)}, got {s.loss_type!r}.")
    if isinstance(s, GRPOSettings):
        if s.loss_type not in GRPO_LOSS_TYPES:
            raise SettingsError(f"GRPO loss type must be one of {', '.join(GRPO_LOSS_TYPES)}, got {s.loss_type!r}.")
        num("beta", float, 0.0, 100.0)
        num("num_generations", int, 2, 256)
        num("prompts_per_step", int, 1, 1024)
        num("max_completion_length", int, 1, 1 << 14)
        num("temperature", float, 0.05, 10.0)
        num("epsilon", float, 0.0, 10.0)
        num("epsilon_high", float, 0.0, 10.0, optional=True)
        num("num_iterations", int, 1, 64)
        if s.epsilon_high is None and s.loss_type == "dapo":
            s.epsilon_high = 0.28
        if s.verifier is not None and s.verifier not in VERIFIERS:
            raise SettingsError(f"Unknown verifier {s.verifier!r}; use one of {', '.join(VERIFIERS)}.")
        s.batch_size = s.prompts_per_step * s.num_generations
    if isinstance(s, PPOSettings):
        _check_ppo(s, num)
    if s.learning_rate is None:
        s.learning_rate = default_lr(kind, s.method)
    if isinstance(s, PPOSettings) and s.value_learning_rate is None:
        s.value_learning_rate = 10 * s.learning_rate
    if s.lora_alpha is None:
        s.lora_alpha = 2.0 * s.lora_rank
    return s


def _check_ppo(s: PPOSettings, num) -> None:
    if s.reward_model is None or not str(s.reward_model).strip():
        raise SettingsError("PPO needs a reward model (--reward-model), one trained by the reward job.")
    s.reward_model = str(s.reward_model).strip()
    num("num_generations", int, 1, 256)
    num("prompts_per_step", int, 1, 1024)
    num("max_completion_length", int, 1, 1 << 14)
    num("temperature", float, 0.05, 10.0)
    num("beta", float, 0.0, 100.0)
    num("kl_target", float, 1e-6, 1e4, optional=True)
    num("kl_horizon", int, 1, 10**9)
    num("epsilon", float, 1e-4, 10.0)
    num("value_clip", float, 1e-4, 1e6)
    num("vf_coef", float, 0.0, 1e3)
    num("gamma", float, 0.0, 1.0)
    num("lam", float, 0.0, 1.0)
    num("ppo_epochs", int, 1, 64)
    num("value_learning_rate", float, 1e-9, 1.0, optional=True)
    num("show_samples", int, 0, 64)
    if not isinstance(s.whiten_advantages, bool):
        raise SettingsError(f"Setting 'whiten_advantages' must be true or false, got {s.whiten_advantages!r}.")
    s.batch_size = s.prompts_per_step * s.num_generations


def settings_json(s: TrainSettings) -> dict:
    d = asdict(s)
    if s.method != "lora":
        d.pop("lora_rank"), d.pop("lora_alpha")
    return d


def default_output_name(model: str, kind: str, method: str = "full", suffix: str | None = None) -> str:
    """'<model>-dpo-lora-<time>': the name says how the model was made."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model).name).strip("-.") or "model"
    return f"{base[:60]}-{kind}-{method}-{suffix or time.strftime('%Y%m%d-%H%M%S')}"
