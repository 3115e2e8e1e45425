"""After SFT: a Bradley-Terry reward model, DPO and GRPO, on TRL's trainers, and what they changed.

Plain functions with plain parameters, for the job system, the CLI, the bench and the tests:

    train_reward(model, dataset, settings, progress, should_stop, log) -> TrainResult
    train_dpo(model, dataset, settings, progress, should_stop, log)    -> TrainResult
    train_grpo(model, dataset, settings, progress, should_stop, log)   -> TrainResult

  model       a registry / fine-tuned / local model name (what sft.load_trainable takes)
  dataset     "builtin", "builtin:<set>[,<set>]", a JSONL path, or PreferenceData / TaskData
              (model_core.training.preference_data)
  settings    RewardSettings / DPOSettings / GRPOSettings (a dict with the same keys works too)
  progress    progress(step, total, metrics: dict): a row per optimizer step (metrics below) and
              phase rows {"phase": "..."} at step 0 and at the end
  should_stop polled between steps and between evaluation batches; True -> TrainingCancelled,
              nothing registered

The trainers are TRL's (RewardTrainer, DPOTrainer, GRPOTrainer; LoRA through their peft_config),
imported inside the functions: importing TRL takes seconds and the web app never pays for it.

A run loads a fresh trainable copy of the model, evaluates it on the held-out split, trains,
evaluates again, merges LoRA into the weights, writes the model with its tokenizer and
lmscope.json {kind, parent, training (settings), dataset (with its hash), metrics, before, after,
history} into a staging folder and renames it to <data dir>/models/<name> only when everything
succeeded, as SFT does: a cancelled or failed run registers nothing.

Per-step metrics (the `metrics` dict; TRL's own log keys are also kept under "trl"):
  all      loss, grad_norm, lr, tokens_seen, tokens_per_s, elapsed_s, eta_s
  reward   accuracy (r_c > r_r in the batch), margin (mean r_c - r_r), reward_mean/min/max
  dpo      accuracy and margin of the implicit reward beta * (log pi - log pi_ref), reward_chosen,
           reward_rejected, logp_chosen, logp_rejected (summed completion log-probs), entropy
  grpo     reward_mean, reward_std (the batch), reward_group_std (mean over groups), kl (when beta > 0),
           completion_length (tokens), truncated_fraction, clip_fraction, zero_std_groups, entropy,
           and groups: per prompt, each completion with its reward and TRL's advantage

Held-out evaluation (before and after; also usable on any registered model):
  preference_eval   chosen-vs-rejected accuracy and mean margin of the policy's implicit reward
                    against a reference, and of the policy's own summed log-probs
  reward_eval       the same under a reward model's scores; reward_scores for typed responses
  task_eval         mean verifiable reward of greedy answers
  token_logratios   log pi(y_t | ...) - log pi_ref(y_t | ...) per completion token: which tokens
                    training pushed up or down; they sum to the sequence log-ratio
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from model_core.core import paths
from model_core.core.checkpoints import staging_dir, sweep_staging, valid_output_name
from model_core.core.errors import SettingsError
from model_core.training import data_parallel, sft
from model_core.training.preference_data import (
    VERIFIERS,
    PreferenceData,
    PreferencePair,
    Task,
    TaskData,
    completion_text,
    preference_dataset,
    score,
    task_dataset,
    verifiable_reward,
)

ProgressFn = Callable[[int, int, dict], None]
KINDS = ("reward", "dpo", "grpo")


class PreferenceError(sft.SFTError):
    """A run that cannot start or did not finish; str() is one sentence for the user."""


class TrainingCancelled(sft.SFTCancelled):
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


SETTINGS_CLASSES = {"reward": RewardSettings, "dpo": DPOSettings, "grpo": GRPOSettings}
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
    full = {"reward": 2e-5, "dpo": 1e-5, "grpo": 1e-5}[kind]
    return full * 20 if method == "lora" else full


def validate_settings(kind: str, raw: TrainSettings | dict | None) -> TrainSettings:
    """A checked copy of the settings for `kind` (SettingsError, one sentence, for anything wrong)."""
    if kind not in SETTINGS_CLASSES:
        raise SettingsError(f"Unknown training kind {kind!r}; use {', '.join(KINDS)}.")
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
                                                                      "reference", "center_rewards")})

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
    if s.learning_rate is None:
        s.learning_rate = default_lr(kind, s.method)
    if s.lora_alpha is None:
        s.lora_alpha = 2.0 * s.lora_rank
    return s


def settings_json(s: TrainSettings) -> dict:
    d = asdict(s)
    if s.method != "lora":
        d.pop("lora_rank"), d.pop("lora_alpha")
    return d


def default_output_name(model: str, kind: str, method: str = "full", suffix: str | None = None) -> str:
    """'<model>-dpo-lora-<time>': the name says how the model was made."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model).name).strip("-.") or "model"
    return f"{base[:60]}-{kind}-{method}-{suffix or time.strftime('%Y%m%d-%H%M%S')}"


# =============================================================================================
# Tokenisation as TRL does it, and log-probabilities from a plain forward pass

def _unwrap(m):
    """A LoadedModel (registry) or a bare module -> (module, tokenizer or None)."""
    if hasattr(m, "model") and hasattr(m, "tokenizer") and not isinstance(m, torch.nn.Module):
        return m.model, m.tokenizer
    return m, None


def _device(model) -> torch.device:
    return next(model.parameters()).device


def encode_completion(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a user prompt and an assistant answer, split the way TRL's
    DPOTrainer splits them: the chat template renders the prompt with the generation prompt and the
    whole conversation; the completion starts where the two token lists part (for SmolLM2 the
    completion is the answer, <|im_end|> and the newline after it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PreferenceError("The tokenizer has no chat template; call sft.ensure_chat_template first.")
    msgs = [{"role": "user", "content": prompt}]
    p = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    full = list(tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": completion}],
                                              tokenize=True, return_dict=False))
    k = 0
    while k < min(len(p), len(full)) and p[k] == full[k]:
        k += 1
    return full[:k], full[k:]


@torch.no_grad()
def token_logps(model, sequences: list[tuple[list[int], list[int]]], batch_size: int = 8,
                should_stop: Callable[[], bool] | None = None) -> list[torch.Tensor]:
    """log p(completion token t | everything before it) for each (prompt ids, completion ids), from
    one plain forward pass per batch (right padding, fp32 log-softmax): one 1-D tensor per item."""
    model, _ = _unwrap(model)
    dev = _device(model)
    was_training = model.training
    model.eval()
    out: list[torch.Tensor | None] = [None] * len(sequences)
    # similar lengths batched together (less padding); rows right-padded, so positions are the
    # unpadded ones; only the completion positions go through the output head
    order = sorted(range(len(sequences)), key=lambda i: -(len(sequences[i][0]) + len(sequences[i][1])))
    try:
        for i in range(0, len(order), batch_size):
            if should_stop and should_stop():
                raise TrainingCancelled()
            idx = order[i:i + batch_size]
            chunk = [sequences[k] for k in idx]
            T = max(len(p) + len(c) for p, c in chunk)
            ids = torch.zeros((len(chunk), T), dtype=torch.long)
            att = torch.zeros_like(ids)
            for j, (p, c) in enumerate(chunk):
                ids[j, :len(p) + len(c)] = torch.tensor(p + c)
                att[j, :len(p) + len(c)] = 1
            first = min(len(p) for p, _ in chunk) - 1  # earliest position that predicts a completion token
            logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev),
                           logits_to_keep=torch.arange(first, T - 1, device=dev)).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, first + 1:].to(dev).unsqueeze(-1)).squeeze(-1)
            for j, (k, (p, c)) in enumerate(zip(idx, chunk)):
                out[k] = lp[j, len(p) - 1 - first: len(p) + len(c) - 1 - first].cpu()
    finally:
        model.train(was_training)
    return out


def sequence_logps(model, tokenizer, items: list[tuple[str, str]], batch_size: int = 8,
                   should_stop=None) -> list[float]:
    """Summed completion log-probs log pi(y | x) of (prompt, completion) pairs (DPO's log pi)."""
    seqs = [encode_completion(tokenizer, p, c) for p, c in items]
    return [float(t.sum()) for t in token_logps(model, seqs, batch_size, should_stop)]


# =============================================================================================
# What training changed

def token_logratios(policy, reference, prompt: str, completion: str, tokenizer=None) -> dict:
    """Per completion token: log pi(y_t | x, y_<t) - log pi_ref(y_t | x, y_<t) (> 0: training pushed the
    token up). policy / reference: LoadedModels (or modules, with `tokenizer`) sharing a vocabulary.

    Returns {"tokens": [{id, text, display, logp, logp_ref, logratio}], "total": sum of the log-ratios
    (= log pi(y|x) - log pi_ref(y|x)), "logp": log pi(y|x), "logp_ref", "prompt_tokens": n}."""
    from model_core.core.tokenization import describe_tokens

    pm, ptok = _unwrap(policy)
    rm, rtok = _unwrap(reference)
    tok = tokenizer or ptok or rtok
    if tok is None:
        raise PreferenceError("token_logratios needs a tokenizer (pass LoadedModels or tokenizer=).")
    if pm.get_output_embeddings().weight.shape[0] != rm.get_output_embeddings().weight.shape[0]:
        raise PreferenceError("These two models have different vocabularies; compare a trained model with its "
                              "parent.")
    if not getattr(tok, "chat_template", None):
        tok = copy.deepcopy(tok)  # never change a cached tokenizer
        sft.ensure_chat_template(tok)
    p_ids, c_ids = encode_completion(tok, prompt, completion)
    lp = token_logps(pm, [(p_ids, c_ids)])[0]
    lr = token_logps(rm, [(p_ids, c_ids)])[0]
    rows = describe_tokens(tok, c_ids)
    out = []
    for r, a, b in zip(rows, lp.tolist(), lr.tolist()):
        out.append({"id": r["id"], "text": r["text"], "display": r["display"], "logp": a, "logp_ref": b,
                    "logratio": a - b})
    return {"tokens": out, "total": float((lp - lr).sum()), "logp": float(lp.sum()), "logp_ref": float(lr.sum()),
            "prompt_tokens": len(p_ids)}


def _by_kind(kinds: list[str], values: list[float]) -> dict:
    acc: dict[str, list[float]] = {}
    for k, v in zip(kinds, values):
        acc.setdefault(k or "upload", []).append(v)
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


def pair_logps(model, tokenizer, pairs: list[PreferencePair], batch_size: int = 8,
               should_stop=None) -> tuple[list[float], list[float]]:
    """([log pi(chosen | prompt)], [log pi(rejected | prompt)]) summed over completion tokens."""
    lp = sequence_logps(model, tokenizer, [(p.prompt, p.chosen) for p in pairs]
                        + [(p.prompt, p.rejected) for p in pairs], batch_size, should_stop)
    return lp[:len(pairs)], lp[len(pairs):]


def preference_eval(policy, tokenizer, pairs: list[PreferencePair], reference=None, beta: float = 0.1,
                    batch_size: int = 8, should_stop=None, n_show: int = 5) -> dict | None:
    """Held-out chosen-vs-rejected preference of a policy. `reference`: a model, or its pair_logps
    on these pairs (a frozen reference's log-probs never change, so a run computes them once).

    logp_accuracy / logp_margin: share of pairs with log pi(chosen) > log pi(rejected), and the mean
    of their difference (summed completion log-probs; the policy alone, meaningful before training).
    With a reference, the DPO view: implicit reward r = beta * (log pi - log pi_ref); accuracy = share
    with r_chosen > r_rejected (strict, as TRL's rewards/accuracies; 0 when policy = reference),
    margin = mean(r_chosen - r_rejected)."""
    if not pairs:
        return None
    n = len(pairs)
    c, r = pair_logps(policy, tokenizer, pairs, batch_size, should_stop)
    d = [a - b for a, b in zip(c, r)]
    kinds = [p.kind for p in pairs]
    out = {"n": n, "logp_accuracy": sum(x > 0 for x in d) / n, "logp_margin": sum(d) / n,
           "logp_accuracy_by_kind": _by_kind(kinds, [float(x > 0) for x in d])}
    margins = None
    if reference is not None:
        ref_c, ref_r = (reference if isinstance(reference, tuple)
                        else pair_logps(reference, tokenizer, pairs, batch_size, should_stop))
        rc = [beta * (a - b) for a, b in zip(c, ref_c)]
        rr = [beta * (a - b) for a, b in zip(r, ref_r)]
        margins = [a - b for a, b in zip(rc, rr)]
        out.update({"beta": beta, "accuracy": sum(m > 0 for m in margins) / n, "margin": sum(margins) / n,
                    "reward_chosen": sum(rc) / n, "reward_rejected": sum(rr) / n,
                    "accuracy_by_kind": _by_kind(kinds, [float(m > 0) for m in margins])})
    out["examples"] = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "kind": p.kind,
                        "logp_chosen": c[i], "logp_rejected": r[i],
                        **({"margin": margins[i]} if margins is not None else {})}
                       for i, p in enumerate(pairs[:n_show])]
    return out


# ---- reward models -----------------------------------------------------------------------------

def init_reward_model(causal_lm, tokenizer, seed: int = 0):
    """A sequence-classification model (one score) with the causal LM's body and a fresh score head
    (normal(0, initializer_range), seeded), as TRL's RewardTrainer builds one from a checkpoint. The
    score is read at the last token that is not padding."""
    from transformers import AutoModelForSequenceClassification

    cfg = copy.deepcopy(causal_lm.config)
    cfg.num_labels = 1
    cfg.architectures = None
    cfg.pad_token_id = tokenizer.pad_token_id
    cfg.problem_type = "regression"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rm = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    missing, _unexpected = rm.load_state_dict(causal_lm.state_dict(), strict=False)
    missing = [k for k in missing if not k.startswith("score.")]
    if missing:
        raise PreferenceError(f"Cannot build a reward model on this architecture ({len(missing)} body weights do not "
                              "match its causal LM).")
    return rm.to(_device(causal_lm))


def load_reward_model(name: str, device: str | None = None):
    """A registered reward model (or a local reward-model folder) -> (model, tokenizer), eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from model_core.core.registry import resolve_device

    p = paths.finetuned_dir() / name if "/" not in name and not name.startswith(".") else Path(name)
    if not (p / "config.json").exists():
        raise PreferenceError(f"No reward model named '{name}'.")
    info = json.loads((p / "lmscope.json").read_text()) if (p / "lmscope.json").exists() else {}
    if info.get("kind") != "reward":
        raise PreferenceError(f"'{name}' is not a reward model (it was made by {info.get('kind', 'something else')}).")
    dev, _ = resolve_device(device)
    model = AutoModelForSequenceClassification.from_pretrained(str(p), dtype=torch.float32).to(dev).eval()
    tok = AutoTokenizer.from_pretrained(str(p))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _conversation_ids(tokenizer, prompt: str, response: str) -> list[int]:
    """The ids TRL's RewardTrainer scores: the whole conversation through the chat template."""
    msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False))


@torch.no_grad()
def reward_scores(reward_model, tokenizer, items: list[tuple[str, str]], batch_size: int = 8,
                  should_stop=None) -> list[float]:
    """The reward model's score of each (prompt, response); right-padded batches, the score at the
    last real token (the model's own pooling)."""
    model, _ = _unwrap(reward_model)
    dev = _device(model)
    was = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[float] = []
    try:
        for i in range(0, len(items), batch_size):
            if should_stop and should_stop():
                raise TrainingCancelled()
            seqs = [_conversation_ids(tokenizer, p, r) for p, r in items[i:i + batch_size]]
            T = max(map(len, seqs))
            ids = torch.full((len(seqs), T), pad, dtype=torch.long)
            att = torch.zeros_like(ids)
            for j, s in enumerate(seqs):
                ids[j, :len(s)] = torch.tensor(s)
                att[j, :len(s)] = 1
            out += model(input_ids=ids.to(dev), attention_mask=att.to(dev)).logits[:, 0].float().cpu().tolist()
    finally:
        model.train(was)
    return out


def reward_eval(reward_model, tokenizer, pairs: list[PreferencePair], batch_size: int = 8, should_stop=None,
                n_show: int = 5) -> dict | None:
    """Held-out accuracy (share with score(chosen) > score(rejected)) and mean margin of a reward model."""
    if not pairs:
        return None
    s = reward_scores(reward_model, tokenizer, [(p.prompt, p.chosen) for p in pairs]
                      + [(p.prompt, p.rejected) for p in pairs], batch_size, should_stop)
    n = len(pairs)
    m = [a - b for a, b in zip(s[:n], s[n:])]
    return {"n": n, "accuracy": sum(x > 0 for x in m) / n, "margin": sum(m) / n,
            "score_chosen": sum(s[:n]) / n, "score_rejected": sum(s[n:]) / n,
            "accuracy_by_kind": _by_kind([p.kind for p in pairs], [float(x > 0) for x in m]),
            "examples": [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "kind": p.kind,
                          "score_chosen": s[i], "score_rejected": s[n + i]} for i, p in enumerate(pairs[:n_show])]}


# ---- verifiable tasks -------------------------------------------------------------------------------

def task_eval(model, tokenizer, tasks: list[Task], max_new_tokens: int = 16, should_stop=None,
              n_show: int = 5) -> dict | None:
    """Mean verifiable reward of greedy answers to held-out prompts (the same verifiers GRPO trains with)."""
    if not tasks:
        return None
    m, _ = _unwrap(model)
    got = sft.greedy_answers(m, tokenizer, [[{"role": "user", "content": t.prompt}] for t in tasks],
                             max_new_tokens, should_stop=should_stop)
    rewards = [score(g, t.answer, t.verifier) for g, t in zip(got, tasks)]
    lengths = [len(tokenizer(g, add_special_tokens=False)["input_ids"]) for g in got]
    return {"n": len(tasks), "mean_reward": sum(rewards) / len(rewards), "mean_length": sum(lengths) / len(lengths),
            "reward_by_kind": _by_kind([t.kind for t in tasks], rewards), "max_new_tokens": max_new_tokens,
            "examples": [{"prompt": t.prompt, "answer": t.answer, "verifier": t.verifier, "completion": g,
                          "reward": r} for t, g, r in list(zip(tasks, got, rewards))[:n_show]]}


# =============================================================================================
# The run: shared harness

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


_METRIC_KEYS = {
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
_COMMON_KEYS = {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "lr", "num_tokens": "tokens_seen"}


def _grpo_groups(trainer, group_size: int) -> list[dict]:
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


def _callback(kind: str, total: int, emit: ProgressFn, stop: Callable[[], bool], group_size: int | None):
    from transformers import TrainerCallback

    class _Progress(TrainerCallback):
        def __init__(self):
            self.history: list[dict] = []
            self.cancelled = False
            self.nan_step: int | None = None
            self.train_time = 0.0
            self.t0 = self.t_last = None
            self.trainer = None

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = self.t_last = time.time()

        def on_step_end(self, args, state, control, **kw):
            now = time.time()
            self.train_time += now - self.t_last
            self.t_last = now
            if data_parallel.agreed(stop()):  # every process stops after the same step
                self.cancelled = True
                control.should_training_stop = True
                control.should_log = False

        def on_log(self, args, state, control, logs=None, **kw):
            logs = dict(logs or {})
            if "loss" not in logs:
                return
            step = state.global_step
            row: dict = {"step": step, "total": total}
            for src, dst in {**_COMMON_KEYS, **_METRIC_KEYS[kind]}.items():
                if logs.get(src) is not None:
                    row[dst] = float(logs[src])
            if "tokens_seen" not in row and self.history:  # GRPO logs it only on steps that generate
                row["tokens_seen"] = self.history[-1].get("tokens_seen")
            toks = row.get("tokens_seen")
            row["tokens_per_s"] = toks / self.train_time if toks and self.train_time > 0 else None
            elapsed = time.time() - self.t0
            row["elapsed_s"] = round(elapsed, 2)
            row["eta_s"] = round(elapsed / step * (total - step), 1) if step else None
            if kind == "grpo" and self.trainer is not None and "reward_mean" in row:  # a step that generated
                groups = _grpo_groups(self.trainer, group_size)
                if groups:
                    row["groups"] = groups
                    row["reward_group_std"] = sum(g["std"] for g in groups) / len(groups)
            row["trl"] = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in logs.items()}
            self.history.append(row)
            emit(step, total, row)
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

    return _Progress()


def _lora_config(s: TrainSettings, task_type: str):
    from peft import LoraConfig

    # as sft.apply_lora: every linear layer of the body (peft leaves the output head out)
    return LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                      task_type=task_type)


def _common_args(s: TrainSettings, staging: Path, dev: torch.device) -> dict:
    use_cuda = dev.type == "cuda"
    return dict(
        output_dir=str(staging / "trainer"), max_steps=s.max_steps, per_device_train_batch_size=data_parallel.per_process_batch(s.batch_size),
        gradient_accumulation_steps=1, learning_rate=s.learning_rate, lr_scheduler_type="constant_with_warmup",
        warmup_steps=s.warmup_steps, weight_decay=0.0, max_grad_norm=1.0, seed=s.seed, data_seed=s.seed,
        logging_steps=1, logging_nan_inf_filter=False, save_strategy="no", report_to="none", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, use_cpu=not use_cuda,
        bf16=use_cuda and torch.cuda.is_bf16_supported(), optim="adamw_torch",
    )


def _run(kind: str, model_name: str, s: TrainSettings, data, progress: ProgressFn | None,
         should_stop: Callable[[], bool] | None, log: Callable[[str], None] | None,
         build: Callable, evaluate: Callable, extra_info: Callable[[], dict] | None = None) -> TrainResult:
    """Load, evaluate, build the TRL trainer (build(model, tok, dev, staging, callback) -> (trainer,
    eval_reference or None)), train, evaluate, merge, save, register."""
    from transformers import set_seed
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    emit = progress or (lambda step, total, m: None)
    stop = should_stop or (lambda: False)
    say = log or (lambda m: None)
    name = s.output_name or default_output_name(model_name, kind, s.method)
    final = paths.finetuned_dir() / name
    if final.exists() and not s.overwrite:
        raise PreferenceError(f"A model named '{name}' already exists; choose another output name.")
    from model_core.core.registry import REGISTRY

    if name in REGISTRY:
        raise PreferenceError(f"'{name}' is a built-in model name; choose another output name.")
    sweep_staging("preference")
    staging = staging_dir(name, "preference")
    staging.mkdir(parents=True)
    t_start = time.time()
    try:
        emit(0, s.max_steps, {"phase": "loading model"})
        sft.quiet_datasets()
        set_seed(s.seed)
        try:
            model, tok, dev = sft.load_trainable(model_name, s.device)
        except torch.cuda.OutOfMemoryError:
            raise PreferenceError(f"Model '{model_name}' does not fit in GPU memory.") from None
        added_template = sft.ensure_chat_template(tok)
        if added_template:
            say("the tokenizer has no chat template; using lmscope's simple 'role: content<eos>' template")
        n_params = sum(p.numel() for p in model.parameters())
        say(f"data: {data.describe()}")
        if stop():
            raise TrainingCancelled()

        main = data_parallel.is_main_process()  # with several GPUs, the one process that evaluates and saves
        emit(0, s.max_steps, {"phase": "evaluating before"})
        before = evaluate("before", model, tok, None) if main else None
        if before is not None:
            say(f"held-out before: {_headline(kind, before)}")
        group = s.num_generations if isinstance(s, GRPOSettings) else None
        cb = _callback(kind, s.max_steps, emit, stop, group)
        trainer, eval_ref = build(model, tok, dev, staging, cb)
        cb.trainer = trainer
        for c in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(c)
        total, trainable = sft.count_params(trainer.model)
        say(f"training {kind} {s.method} ({trainable:,} of {total:,} parameters trainable) for {s.max_steps} "
            f"steps, lr {s.learning_rate:g}, on {dev}")
        if stop():
            raise TrainingCancelled()
        sft.train_checked(trainer, cb, stop, PreferenceError, TrainingCancelled)
        trained = trainer.model
        del trainer
        if not main:
            return None
        if hasattr(trained, "peft_config"):
            trained = trained.merge_and_unload()
        trained.eval()
        emit(s.max_steps, s.max_steps, {"phase": "evaluating after"})
        after = evaluate("after", trained, tok, eval_ref)
        if after is not None:
            say(f"held-out after: {_headline(kind, after)}")
        if stop():
            raise TrainingCancelled()

        emit(s.max_steps, s.max_steps, {"phase": "saving"})
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
        shutil.rmtree(staging / "trainer", ignore_errors=True)
        shutil.rmtree(staging / "reference", ignore_errors=True)
        trained.to("cpu").save_pretrained(staging, safe_serialization=True)
        tok.save_pretrained(staging)
        (staging / "lmscope.json").write_text(json.dumps(info, indent=1))
        if stop():
            raise TrainingCancelled()
        if final.exists() and s.overwrite:
            shutil.rmtree(final)
        os.rename(staging, final)  # atomic on one filesystem: the model appears complete or not at all
        say(f"registered model '{name}' at {final}")
        emit(s.max_steps, s.max_steps, {"phase": "done", "elapsed_s": round(time.time() - t_start, 2)})
        return TrainResult(kind=kind, name=name, path=final, metrics=summary, before=before, after=after,
                           history=cb.history, info=info)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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


def _dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(rows)


def _limit(rows: list, n: int) -> list:
    return rows[:n] if n else []


# =============================================================================================
# Reward model (Bradley-Terry)

def train_reward(model: str, dataset: str | PreferenceData = "builtin", settings: RewardSettings | dict | None = None,
                 progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
                 log: Callable[[str], None] | None = None) -> TrainResult:
    """Train a Bradley-Terry reward model: a score head on the model's body, loss
    -log sigmoid(r(x, y_chosen) - r(x, y_rejected)) (TRL's RewardTrainer). The registered folder is a
    sequence-classification model (lmscope.json kind "reward"; load it with load_reward_model)."""
    s = validate_settings("reward", settings)
    data = preference_dataset(dataset, s.builtin_train_size, s.eval_examples, s.seed, s.eval_fraction)
    test = _limit(data.test, s.eval_examples)
    state: dict = {}

    def evaluate(when, m, tok, _ref):
        if when == "before":  # the reward model does not exist yet: build it here, score with its fresh head
            state["rm"] = init_reward_model(m, tok, s.seed)
            m = state["rm"]
        return reward_eval(m, tok, test, should_stop=should_stop) if test else None

    def build(m, tok, dev, staging, cb):
        from trl import RewardConfig, RewardTrainer

        rm = state.pop("rm", None) or init_reward_model(m, tok, s.seed)
        del m
        args = data_parallel.one_gpu_each(RewardConfig(
            max_length=s.max_length, center_rewards_coefficient=s.center_rewards, **_common_args(s, staging, dev)))
        trainer = RewardTrainer(model=rm, args=args, train_dataset=_dataset([p.conversational() for p in data.train]),
                                processing_class=tok, callbacks=[cb],
                                peft_config=_lora_config(s, "SEQ_CLS") if s.method == "lora" else None)
        return trainer, None

    return _run("reward", model, s, data, progress, should_stop, log, build, evaluate)


# =============================================================================================
# DPO

def train_dpo(model: str, dataset: str | PreferenceData = "builtin", settings: DPOSettings | dict | None = None,
              progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
              log: Callable[[str], None] | None = None) -> TrainResult:
    """Direct preference optimisation against a frozen reference (TRL's DPOTrainer): loss
    -log sigmoid(beta * ((log pi(y_c|x) - log pi_ref(y_c|x)) - (log pi(y_r|x) - log pi_ref(y_r|x)))),
    log-probs summed over the completion tokens. The reference is the starting model (LoRA: the model
    with the adapter switched off) unless settings.reference names another model with the same
    tokenizer."""
    s = validate_settings("dpo", settings)
    data = preference_dataset(dataset, s.builtin_train_size, s.eval_examples, s.seed, s.eval_fraction)
    test = _limit(data.test, s.eval_examples)
    state: dict = {}

    def named_reference(tok):
        ref, rtok, _ = sft.load_trainable(s.reference, s.device)
        sft.ensure_chat_template(rtok)
        if rtok.get_vocab() != tok.get_vocab():
            raise PreferenceError(f"The reference '{s.reference}' has another tokenizer than '{model}'; DPO needs "
                                  "both to score the same tokens.")
        ref.requires_grad_(False)
        return ref.eval()

    def evaluate(when, m, tok, _ref):
        if not test:
            return None
        if when == "before":  # the reference's held-out log-probs, once (the start model's own, by default)
            if s.reference:
                state["ref"] = named_reference(tok)
                state["ref_logps"] = pair_logps(state["ref"], tok, test, should_stop=should_stop)
            else:
                state["ref_logps"] = pair_logps(m, tok, test, should_stop=should_stop)
        return preference_eval(m, tok, test, reference=state["ref_logps"], beta=s.beta, should_stop=should_stop)

    def build(m, tok, dev, staging, cb):
        from trl import DPOConfig, DPOTrainer

        lora = s.method == "lora"
        if s.reference:
            ref = state.get("ref") or named_reference(tok)
        else:  # LoRA: TRL switches the adapter off for the reference; full: a frozen copy of the start
            ref = None if lora else copy.deepcopy(m).requires_grad_(False).eval()
        args = data_parallel.one_gpu_each(DPOConfig(beta=s.beta, loss_type=s.loss_type, max_length=s.max_length,
                                                    **_common_args(s, staging, dev)))
        trainer = DPOTrainer(model=m, ref_model=ref, args=args,
                             train_dataset=_dataset([p.conversational() for p in data.train]), processing_class=tok,
                             callbacks=[cb], peft_config=_lora_config(s, "CAUSAL_LM") if lora else None)
        return trainer, None

    return _run("dpo", model, s, data, progress, should_stop, log, build, evaluate,
                extra_info=lambda: {"reference": s.reference or model})


# =============================================================================================
# GRPO

def train_grpo(model: str, dataset: str | TaskData = "builtin", settings: GRPOSettings | dict | None = None,
               progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
               log: Callable[[str], None] | None = None) -> TrainResult:
    """RL with verifiable rewards (TRL's GRPOTrainer): for each prompt, num_generations sampled
    completions, each scored by its verifier (plain code, model_core.training.preference_data.VERIFIERS);
    group-relative advantages, no value network; loss_type picks the variant (GRPO_LOSS_TYPES).
    Held-out evaluation: mean verifiable reward of greedy answers."""
    s = validate_settings("grpo", settings)
    data = task_dataset(dataset, s.verifier, s.builtin_train_size, s.eval_examples, s.seed, s.eval_fraction)
    test = _limit(data.test, s.eval_examples)

    def evaluate(when, m, tok, _ref):
        return task_eval(m, tok, test, s.max_completion_length, should_stop=should_stop) if test else None

    def build(m, tok, dev, staging, cb):
        from trl import GRPOConfig, GRPOTrainer

        lora = s.method == "lora"
        src = str(getattr(m.config, "_name_or_path", "") or "")
        if s.beta > 0 and not lora and not (src and Path(src).is_dir()):
            # TRL builds the full-fine-tuning reference with from_pretrained(config._name_or_path); a model
            # built in memory (random-* configs) has no folder, so give it one.
            ref_dir = staging / "reference"
            m.save_pretrained(ref_dir, safe_serialization=True)
            m.config._name_or_path = str(ref_dir)
        args = data_parallel.one_gpu_each(GRPOConfig(
            num_generations=s.num_generations, max_completion_length=s.max_completion_length,
            temperature=s.temperature, top_p=1.0, top_k=0, beta=s.beta, loss_type=s.loss_type,
            scale_rewards="none" if s.loss_type == "dr_grpo" else "group", epsilon=s.epsilon,
            epsilon_high=s.epsilon_high, num_iterations=s.num_iterations, mask_truncated_completions=False,
            log_completions=False, **_common_args(s, staging, dev)))
        trainer = GRPOTrainer(model=m, reward_funcs=[verifiable_reward], args=args,
                              train_dataset=_dataset([t.conversational() for t in data.train]),
                              processing_class=tok, callbacks=[cb],
                              peft_config=_lora_config(s, "CAUSAL_LM") if lora else None)
        return trainer, None

    return _run("grpo", model, s, data, progress, should_stop, log, build, evaluate,
                extra_info=lambda: {"loss_label": GRPO_LOSS_TYPES[s.loss_type],
                                    "verifiers": {v: VERIFIERS[v].description for v in data.describe()["verifiers"]}})


# =============================================================================================
# Every GPU of the machine

def train_on_gpus(kind: str, model: str, dataset: str = "builtin", settings: TrainSettings | dict | None = None,
                  progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
                  log: Callable[[str], None] | None = None, processes: int | None = None) -> TrainResult:
    """train_reward / train_dpo / train_grpo on every GPU of the machine, one process each, or in this
    process with fewer than two GPUs (data_parallel.train). batch_size stays the whole step's (GRPO:
    prompts_per_step x num_generations completions)."""
    train = {"reward": train_reward, "dpo": train_dpo, "grpo": train_grpo}[kind]
    return data_parallel.train(f"model_core.training.preference:{train.__name__}", asdict(validate_settings(kind, settings)),
                               before=(model, dataset), processes=processes, progress=progress,
                               should_stop=should_stop, log=log, error_cls=PreferenceError)
