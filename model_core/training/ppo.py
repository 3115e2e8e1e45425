"""RLHF with PPO against a reward model (the InstructGPT pipeline's third stage), on transformers
and PEFT. TRL 1.16 ships no PPO trainer (neither trl nor trl.experimental), and the maintained
PPO libraries (OpenRLHF, veRL) run on Ray with vLLM / DeepSpeed workers, not in one CPU or
one-GPU job process, so the loop is written here, small, beside the formulas it uses.

    train_ppo(model, dataset, settings, progress, should_stop, log) -> TrainResult

  model       the policy to start from (the SFT model; a registry / fine-tuned / local name)
  dataset     prompts: a task set as GRPO's ("builtin", "builtin:arithmetic,date", a JSONL path whose
              lines each name their verifier, or TaskData); the answers feed only the verifiable
              side metric, the reward is the reward model's
  settings    PPOSettings (settings.reward_model: a model trained by the reward job, same tokenizer)

One step: prompts_per_step prompts x num_generations sampled rollouts (the model's own generate,
temperature sampling, no top-k / top-p); a no-grad forward gives the rollout's token log-probs
log pi_old, the values V (a linear value head on the policy's last hidden states) and the frozen
reference's log-probs (LoRA: the adapter switched off; full: a frozen copy of the start);
the reward model scores prompt + response (the whole conversation through the chat template, as the
reward job trained it). Per response token t:

    kl_t     = log pi_old(y_t) - log pi_ref(y_t)                      (k1; k3 is reported beside it)
    r_t      = -beta kl_t, plus the reward model's score at the last token
    delta_t  = r_t + gamma V_{t+1} - V_t          (V after the last token is 0: the episode ends)
    A_t      = delta_t + gamma lam A_{t+1}        (GAE), returns R_t = A_t + V_t
    A        whitened over the batch's tokens (whiten_advantages)

then ppo_epochs passes over the batch, each one optimizer step on
    loss = -mean_t min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)
           + vf_coef 0.5 mean_t max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2)
with rho_t = pi(y_t) / pi_old(y_t); beta is fixed, or adapted towards kl_target after each step
(Ziegler et al. 2019: beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * batch / horizon).

Evaluation before and after: greedy answers to the held-out prompts, scored by the reward model
(mean_score) and by the tasks' verifiers (mean_reward). The run registers the policy (LoRA merged)
as a fine-tuned model with lmscope.json kind "ppo", and the value head beside it
(value_head.safetensors; Explore and the registry ignore it).
"""

from __future__ import annotations

import copy
import inspect
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from model_core.core.errors import SettingsError
from model_core.training.preference_data import Task, TaskData, score, task_dataset
from model_core.training.preference_eval import load_reward_model, reward_scores
from model_core.training.preference_settings import (
    PPOSettings,
    PreferenceError,
    TrainingCancelled,
    default_output_name,
    settings_json,
    validate_settings,
)
from model_core.training.preference_trl import ProgressFn, TrainResult, limit
from model_core.training.run import TrainingRun, positional
from model_core.training.sft import apply_lora, load_for_training
from model_core.training.sft_eval import greedy_answers

# =============================================================================================
# The formulas, on [batch, tokens] tensors; `mask` is 1 on response tokens, 0 on padding


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked entries (population variance); 0 where masked."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (Schulman's k1/k2/k3):
    k1 = log r, k2 = (log r)^2 / 2, k3 = 1/r - 1 + log r, with r = pi / pi_ref. k1 is unbiased but
    can be negative per token; k3 is unbiased and never negative."""
    log_r = logprobs - ref_logprobs
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r ** 2
    if kind == "k3":
        return torch.exp(-log_r) - 1 + log_r
    raise ValueError(f"Unknown KL estimator {kind!r}; use k1, k2 or k3.")


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """r_t = -beta kl_t on every response token, plus the sequence's score at its last token."""
    r = -beta * kl * mask
    last = (mask.sum(1).long() - 1).clamp(min=0)
    r[torch.arange(r.shape[0], device=r.device), last] += scores.to(r.device, r.dtype)
    return r * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) -> (advantages, returns).
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, R_t = A_t + V_t; the
    value after a response's last token is 0 (the episode ends there). Responses are right-padded."""
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(T)):
        going_on = mask[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        next_value = values[:, t + 1] * going_on if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running * going_on) * mask[:, t]
        adv[:, t] = running
    return adv, (adv + values) * mask


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, eps: float) -> tuple[torch.Tensor, dict]:
    """-mean_t min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t), rho = exp(logprobs - old_logprobs);
    clip_fraction: the share of tokens where the clipped term is the smaller (its gradient is 0)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps) * advantages
    loss = -masked_mean(torch.min(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {"clip_fraction": float(masked_mean((clipped < unclipped).float(), mask)),
                 "approx_kl": float(masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask)),
                 "ratio_mean": float(masked_mean(ratio, mask))}
    return loss, stats


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip: float) -> tuple[torch.Tensor, dict]:
    """0.5 mean_t max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2)."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    plain, clipped = (values - returns) ** 2, (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(plain, clipped), mask)
    with torch.no_grad():
        stats = {"value_clip_fraction": float(masked_mean((clipped > plain).float(), mask))}
    return loss, stats


class KLController:
    """beta, fixed (target None) or adaptive (Ziegler et al. 2019): after a step with measured KL
    (nats per sequence) over n_samples rollouts, beta *= 1 + clip(KL / target - 1, -0.2, 0.2) n / horizon."""

    def __init__(self, beta: float, target: float | None = None, horizon: int = 10_000):
        self.beta, self.target, self.horizon = float(beta), target, horizon

    def update(self, kl: float, n_samples: int) -> float:
        if self.target:
            err = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.beta *= 1.0 + err * n_samples / self.horizon
        return self.beta


# =============================================================================================
# The reward model: a model the reward job trained, on the policy's tokenizer

def _reward_model_dir(name: str, allow_paths: bool = True) -> Path:
    from model_core.core.registry import finetuned_path

    if not isinstance(name, str) or not name.strip():
        raise SettingsError("PPO needs a reward model (--reward-model), one trained by the reward job.")
    p = finetuned_path(name)
    if p is None and allow_paths and Path(name).expanduser().is_dir():
        p = Path(name).expanduser()
    if p is None or not (p / "config.json").exists():
        raise SettingsError(f"No reward model named '{name}'; train one with the reward job first.")
    try:
        kind = json.loads((p / "lmscope.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind != "reward":
        raise SettingsError(f"'{name}' is not a reward model (it was made by {kind or 'something else'}); pass a "
                            "model trained by the reward job.")
    return p


def _policy_tokenizer(model: str):
    """The tokenizer of model `model` without loading its weights; None when that needs a conversion first."""
    from transformers import AutoTokenizer

    from model_core.core.registry import REGISTRY, converted_dir, finetuned_path, is_ready
    from model_core.core.tokenization import byte_tokenizer

    entry = REGISTRY.get(model)
    if entry is not None:
        if entry.source == "random":
            return byte_tokenizer()
        return AutoTokenizer.from_pretrained(str(converted_dir(model))) if is_ready(model) else None
    folder = finetuned_path(model) or (Path(model).expanduser() if Path(model).expanduser().is_dir() else None)
    return AutoTokenizer.from_pretrained(str(folder)) if folder is not None else None


def check_reward_model(model: str, reward_model: str, allow_paths: bool = True, policy_tokenizer=None) -> Path:
    """The reward model's folder; SettingsError (one sentence) when it is missing, is not a reward
    model, or tokenizes differently from the policy (its scores would read other tokens)."""
    from transformers import AutoTokenizer

    folder = _reward_model_dir(reward_model, allow_paths)
    ptok = policy_tokenizer if policy_tokenizer is not None else _policy_tokenizer(model)
    if ptok is not None and AutoTokenizer.from_pretrained(str(folder)).get_vocab() != ptok.get_vocab():
        raise SettingsError(f"The reward model '{reward_model}' uses another tokenizer than '{model}'; train the "
                            f"reward model from '{model}' or a model of the same base.")
    return folder


# =============================================================================================
# Rollouts and their log-probs and values

def _prompt_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for j, s in enumerate(seqs):
        ids[j, T - len(s):] = torch.tensor(s)
        att[j, T - len(s):] = 1
    return ids, att


def _end_ids(tok, model) -> set[int]:
    ends = {tok.eos_token_id}
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ends |= set(gen) if isinstance(gen, (list, tuple)) else {gen}
    return {int(e) for e in ends if e is not None}


@torch.no_grad()
def rollout(policy, tok, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
            dev: torch.device) -> dict:
    """Sampled responses to left-padded prompts -> {query, query_mask, response, response_mask}; a
    response ends at (and includes) its first end token, the rest is padding."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    q, qm = _left_pad(prompt_ids, pad)
    ends = _end_ids(tok, policy)
    out = policy.generate(input_ids=q.to(dev), attention_mask=qm.to(dev), do_sample=True, temperature=temperature,
                          top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=sorted(ends),
                          pad_token_id=pad)
    resp = out[:, q.shape[1]:].cpu()
    mask = torch.ones_like(resp, dtype=torch.float32)
    for i in range(resp.shape[0]):
        hits = [j for j, t in enumerate(resp[i].tolist()) if t in ends]
        if hits:
            mask[i, hits[0] + 1:] = 0
            resp[i, hits[0] + 1:] = pad
    return {"query": q, "query_mask": qm, "response": resp, "response_mask": mask}


def _keeps_logits(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def forward_stats(model, value_head, batch: dict, temperature: float, dev: torch.device,
                  entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log pi(y_t | prompt, y_<t) [B, R], values V_t [B, R] or None, entropy [B, R] or None) of the
    batch's response tokens; V_t is the value head on the last hidden state at the position that
    predicts y_t. Position ids count real tokens only (the prompts are left-padded)."""
    q, r = batch["query"], batch["response"]
    ids = torch.cat([q, r], 1).to(dev)
    att = torch.cat([batch["query_mask"], batch["response_mask"].long()], 1).to(dev)
    pos = (att.cumsum(1) - 1).clamp(min=0)
    R = r.shape[1]
    kw = {"logits_to_keep": R + 1} if _keeps_logits(model) else {}
    out = model(input_ids=ids, attention_mask=att, position_ids=pos, output_hidden_states=value_head is not None,
                use_cache=False, **kw)
    logits = out.logits[:, -(R + 1):-1].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, r.to(dev).unsqueeze(-1)).squeeze(-1)
    values = None
    if value_head is not None:
        h = out.hidden_states[-1][:, -(R + 1):-1]
        values = value_head(h.to(value_head.weight.dtype)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None
    return logp, values, ent


# =============================================================================================
# Held-out evaluation

def ppo_eval(policy, tok, reward_model, reward_tok, tasks: list[Task], max_new_tokens: int, should_stop=None,
             n_show: int = 5) -> dict | None:
    """Greedy answers to held-out prompts, scored by the reward model (mean_score) and by the tasks'
    verifiers (mean_reward)."""
    if not tasks:
        return None
    got = greedy_answers(policy, tok, [[{"role": "user", "content": t.prompt}] for t in tasks], max_new_tokens,
                         should_stop=should_stop)
    scores = reward_scores(reward_model, reward_tok, [(t.prompt, g) for t, g in zip(tasks, got)],
                           should_stop=should_stop)
    rewards = [score(g, t.answer, t.verifier) for g, t in zip(got, tasks)]
    lengths = [len(tok(g, add_special_tokens=False)["input_ids"]) for g in got]
    n = len(tasks)
    return {"n": n, "mean_score": sum(scores) / n, "mean_reward": sum(rewards) / n, "mean_length": sum(lengths) / n,
            "max_new_tokens": max_new_tokens,
            "examples": [{"prompt": t.prompt, "answer": t.answer, "completion": g, "score": s, "reward": r}
                         for t, g, s, r in list(zip(tasks, got, scores, rewards))[:n_show]]}


# =============================================================================================
# The run

def train_ppo(model: str, dataset: str | TaskData = "builtin", settings: PPOSettings | dict | None = None,
              progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
              log: Callable[[str], None] | None = None) -> TrainResult:
    """PPO of `model` against settings.reward_model (see the module docstring); registers the
    policy. Per-step metrics: loss, policy_loss, value_loss, reward_mean / reward_std (the reward
    model's scores of the step's rollouts), kl (k1, summed over a response, mean over the batch),
    kl_k3, beta, non_score_reward (-beta kl), clip_fraction, value_clip_fraction, approx_kl, entropy,
    value_mean, return_mean, advantage_std (before whitening), completion_length, grad_norm, lr,
    tokens_seen, tokens_per_s, elapsed_s, eta_s, and `samples`: a few rollouts token by token."""
    s = validate_settings("ppo", settings)
    data = task_dataset(dataset, None, s.builtin_train_size, s.eval_examples, s.seed, s.eval_fraction)
    test = limit(data.test, s.eval_examples)
    name = s.output_name or default_output_name(model, "ppo", s.method)
    with TrainingRun(name, error_cls=PreferenceError, cancelled_cls=TrainingCancelled, overwrite=s.overwrite,
                     staging_kind="preference", progress=positional(progress), should_stop=should_stop, log=log,
                     max_steps=s.max_steps) as run:
        return _PPORun(model, s, data, test, run).train()


class _PPORun:
    def __init__(self, model_name: str, s: PPOSettings, data: TaskData, test: list[Task], run: TrainingRun):
        self.model_name, self.s, self.data, self.test, self.run = model_name, s, data, test, run
        self.history: list[dict] = []
        self.samples_by_step: list[dict] = []
        self.train_time = 0.0

    def train(self) -> TrainResult:
        from transformers import set_seed

        s, run = self.s, self.run
        run.phase("loading model")
        set_seed(s.seed)
        policy, tok, dev, added = load_for_training(self.model_name, s.device, PreferenceError, run.say)
        check_reward_model(self.model_name, s.reward_model, policy_tokenizer=tok)
        rm, rtok = load_reward_model(s.reward_model, str(dev))
        rm.requires_grad_(False)
        n_params = sum(p.numel() for p in policy.parameters())
        run.say(f"data: {self.data.describe()}; reward model '{s.reward_model}'")
        run.check_stop()

        run.phase("evaluating before")
        before = self._eval(policy, tok, rm, rtok)
        if s.method == "lora":
            policy = apply_lora(policy, s.lora_rank, s.lora_alpha, s.seed)
            ref = None  # the adapter switched off
        else:
            ref = copy.deepcopy(policy).requires_grad_(False).eval()
        policy.eval()  # no dropout: the first PPO epoch's ratio is exactly 1
        hidden = policy.config.get_text_config().hidden_size if hasattr(policy.config, "get_text_config") \
            else policy.config.hidden_size
        value_head = torch.nn.Linear(hidden, 1).to(dev)
        torch.nn.init.zeros_(value_head.weight), torch.nn.init.zeros_(value_head.bias)
        params = [p for p in policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW([{"params": params, "lr": s.learning_rate},
                                 {"params": value_head.parameters(), "lr": s.value_learning_rate}], weight_decay=0.0)
        trainable = sum(p.numel() for p in params)
        run.say(f"training ppo {s.method} ({trainable:,} of {n_params:,} parameters trainable) for {s.max_steps} "
                f"steps of {s.prompts_per_step} x {s.num_generations} rollouts, lr {s.learning_rate:g}, on {dev}")

        kl_ctl = KLController(s.beta, s.kl_target, s.kl_horizon)
        rng = random.Random(s.seed)
        order: list[Task] = []
        tokens_seen, t0 = 0, time.time()
        for step in range(1, s.max_steps + 1):
            run.check_stop()
            t_step = time.time()
            if len(order) < s.prompts_per_step:
                more = list(self.data.train)
                rng.shuffle(more)
                order += more
            tasks, order = order[:s.prompts_per_step], order[s.prompts_per_step:]
            row = self._step(step, tasks, policy, ref, value_head, tok, rm, rtok, opt, kl_ctl, dev)
            self.train_time += time.time() - t_step
            tokens_seen += row.pop("_tokens")
            elapsed = time.time() - t0
            row.update(tokens_seen=tokens_seen, tokens_per_s=tokens_seen / self.train_time,
                       step_s=round(time.time() - t_step, 3), elapsed_s=round(elapsed, 2),
                       eta_s=round(elapsed / step * (s.max_steps - step), 1))
            self.history.append({k: v for k, v in row.items() if k != "samples"})
            self.samples_by_step.append({"step": step, "samples": row["samples"]})
            run.progress({"phase": "training", "max_steps": s.max_steps, **row})
            if not all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf")
                       for k, v in row.items() if k in ("loss", "value_loss", "policy_loss")):
                raise PreferenceError(f"The loss became NaN/inf at step {step}; training stopped. Lower the learning "
                                      "rate.")
        run.check_stop()

        if hasattr(policy, "peft_config"):
            policy = policy.merge_and_unload()
        policy.eval()
        run.phase("evaluating after", s.max_steps)
        after = self._eval(policy, tok, rm, rtok)
        run.check_stop()

        run.phase("saving", s.max_steps)
        summary = self._summary()
        info = {
            "kind": "ppo", "parent": self.model_name, "parameters": n_params, "training": settings_json(s),
            "dataset": self.data.describe(), "metrics": summary, "before": before, "after": after,
            "history": self.history, "samples": _thin(self.samples_by_step), "reward_model": s.reward_model,
            "created": time.time(), "chat_template_added": added,
            "description": f"PPO ({s.method}, beta {s.beta:g}{', adaptive' if s.kl_target else ''}) of "
                           f"{self.model_name} against reward model {s.reward_model}",
        }
        run.save(policy, tok, info)
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in value_head.state_dict().items()},
                  str(run.staging / "value_head.safetensors"))
        path = run.register()
        return TrainResult(kind="ppo", name=run.name, path=path, metrics=summary, before=before, after=after,
                           history=self.history, info=info)

    def _eval(self, policy, tok, rm, rtok) -> dict | None:
        if not self.test:
            return None
        ev = ppo_eval(policy, tok, rm, rtok, self.test, self.s.max_completion_length, should_stop=self.run.should_stop)
        self.run.say(f"held-out: reward-model score {ev['mean_score']:.3f}, verifiable reward {ev['mean_reward']:.3f} "
                     f"over {ev['n']} prompts (mean length {ev['mean_length']:.1f})")
        return ev

    def _step(self, step, tasks, policy, ref, value_head, tok, rm, rtok, opt, kl_ctl, dev) -> dict:
        s = self.s
        prompts = [t.prompt for t in tasks for _ in range(s.num_generations)]
        batch = rollout(policy, tok, [_prompt_ids(tok, p) for p in prompts], s.max_completion_length,
                        s.temperature, dev)
        mask = batch["response_mask"].to(dev)
        texts = [tok.decode(r[m.bool()].tolist(), skip_special_tokens=True)
                 for r, m in zip(batch["response"], batch["response_mask"])]
        with torch.no_grad():
            old_lp, old_v, ent = forward_stats(policy, value_head, batch, s.temperature, dev, entropy=True)
            if ref is None:
                with policy.disable_adapter():
                    ref_lp, _, _ = forward_stats(policy, None, batch, s.temperature, dev)
            else:
                ref_lp, _, _ = forward_stats(ref, None, batch, s.temperature, dev)
            scores = torch.tensor(reward_scores(rm, rtok, list(zip(prompts, texts))), device=dev)
            kl = kl_estimate(old_lp, ref_lp, "k1") * mask
            kl3 = kl_estimate(old_lp, ref_lp, "k3") * mask
            beta = kl_ctl.beta
            rewards = token_rewards(scores, kl, mask, beta)
            adv, ret = gae(rewards, old_v, mask, s.gamma, s.lam)
            adv_raw = adv
            if s.whiten_advantages:
                adv = masked_whiten(adv, mask)
        pol_losses, val_losses, losses, norms, stats = [], [], [], [], []
        for _ in range(s.ppo_epochs):
            self.run.check_stop()
            lp, v, _ = forward_stats(policy, value_head, batch, s.temperature, dev)
            pg, pst = clipped_policy_loss(lp, old_lp, adv, mask, s.epsilon)
            vf, vst = clipped_value_loss(v, old_v, ret, mask, s.value_clip)
            loss = pg + s.vf_coef * vf
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
            opt.step()
            pol_losses.append(pg.item()), val_losses.append(vf.item()), losses.append(loss.item())
            norms.append(float(norm)), stats.append({**pst, **vst})
        seq_kl = kl.sum(1)
        kl_ctl.update(float(seq_kl.mean()), len(prompts))
        lengths = mask.sum(1)
        mean = lambda key: sum(st[key] for st in stats) / len(stats)  # noqa: E731
        row = {"step": step, "total": s.max_steps, "loss": sum(losses) / len(losses),
               "policy_loss": sum(pol_losses) / len(pol_losses), "value_loss": sum(val_losses) / len(val_losses),
               "reward_mean": float(scores.mean()), "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
               "kl": float(seq_kl.mean()), "kl_k3": float(kl3.sum(1).mean()), "beta": beta,
               "beta_next": kl_ctl.beta, "non_score_reward": float((-beta * seq_kl).mean()),
               "clip_fraction": mean("clip_fraction"), "value_clip_fraction": mean("value_clip_fraction"),
               "approx_kl": mean("approx_kl"), "entropy": float(masked_mean(ent, mask)),
               "value_mean": float(masked_mean(old_v, mask)), "return_mean": float(masked_mean(ret, mask)),
               "advantage_std": float(masked_mean((adv_raw - masked_mean(adv_raw, mask)) ** 2, mask).sqrt()),
               "completion_length": float(lengths.float().mean()), "grad_norm": sum(norms) / len(norms),
               "lr": s.learning_rate, "_tokens": int(batch["query_mask"].sum() + mask.sum()),
               "samples": _samples(tok, prompts, texts, batch, scores, kl, rewards, old_v, adv, ret, s.show_samples)}
        return row

    def _summary(self) -> dict:
        h = self.history
        keys = ("loss", "reward_mean", "kl", "clip_fraction", "value_loss", "completion_length")
        return {"steps": h[-1]["step"] if h else 0, "train_seconds": round(self.train_time, 2),
                "seconds_per_step": round(self.train_time / len(h), 3) if h else None,
                "tokens_seen": int(h[-1]["tokens_seen"]) if h else 0,
                "tokens_per_s": h[-1]["tokens_per_s"] if h else None,
                **{f"first_{k}": h[0][k] for k in keys if h}, **{f"final_{k}": h[-1][k] for k in keys if h}}


def _samples(tok, prompts, texts, batch, scores, kl, rewards, values, adv, ret, n: int) -> list[dict]:
    """The first n rollouts of a step, token by token: what the page shows of where the reward and
    the advantage landed."""
    from model_core.core.tokenization import describe_tokens

    out = []
    for i in range(min(n, len(prompts))):
        m = int(batch["response_mask"][i].sum())
        ids = batch["response"][i, :m].tolist()
        row = {"prompt": prompts[i], "completion": texts[i], "score": round(float(scores[i]), 4),
               "tokens": [d["display"] for d in describe_tokens(tok, ids)]}
        for key, t in (("kl", kl), ("rewards", rewards), ("values", values), ("advantages", adv), ("returns", ret)):
            row[key] = [round(float(x), 4) for x in t[i, :m].tolist()]
        out.append(row)
    return out


def _thin(rows: list[dict], keep: int = 20) -> list[dict]:
    if len(rows) > keep:
        idx = {round(i * (len(rows) - 1) / (keep - 1)) for i in range(keep)}
        rows = [r for i, r in enumerate(rows) if i in idx]
    return rows
