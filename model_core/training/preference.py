"""After SFT: a Bradley-Terry reward model, DPO and GRPO, on TRL's trainers, PPO against a reward model
(model_core.training.ppo, its own loop: TRL ships no PPO trainer), and what they changed.

Plain functions with plain parameters, for the job system, the CLI, the bench and the tests:

    train_reward(model, dataset, settings, progress, should_stop, log) -> TrainResult
    train_dpo(model, dataset, settings, progress, should_stop, log)    -> TrainResult
    train_grpo(model, dataset, settings, progress, should_stop, log)   -> TrainResult
    train_ppo(model, dataset, settings, progress, should_stop, log)    -> TrainResult (settings.reward_model)

  model       a registry / fine-tuned / local model name (what sft.load_trainable takes)
  dataset     "builtin", "builtin:<set>[,<set>]", a JSONL path, or PreferenceData / TaskData
              (model_core.training.preference_data)
  settings    RewardSettings / DPOSettings / GRPOSettings (a dict with the same keys works too)
  progress    progress(step, total, metrics: dict): a row per optimizer step (metrics below) and
              phase rows {"phase": "..."} at step 0 and at the end (the rows of every training
              run, model_core.training.run, handed over as (step, max_steps, row): run.positional)
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

The modules behind it, all re-exported here: preference_settings (settings, errors, loss types),
preference_eval (held-out evaluation and log-probabilities), preference_trl (the harness every
kind runs in; the run's lifecycle itself is model_core.training.run's). The per-step rows come from
trainer_callbacks.PreferenceCallback.

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
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from model_core.training import data_parallel, sft
from model_core.training.ppo import check_reward_model, ppo_eval, train_ppo
from model_core.training.preference_data import (
    VERIFIERS,
    PreferenceData,
    TaskData,
    preference_dataset,
    task_dataset,
    verifiable_reward,
)
from model_core.training.preference_eval import (
    encode_completion,
    init_reward_model,
    load_reward_model,
    pair_logps,
    preference_eval,
    reward_eval,
    reward_scores,
    sequence_logps,
    task_eval,
    token_logps,
    token_logratios,
)
from model_core.training.preference_settings import (
    DPO_LOSS_TYPES,
    GRPO_LOSS_TYPES,
    KINDS,
    SETTINGS_CLASSES,
    DPOSettings,
    GRPOSettings,
    PPOSettings,
    PreferenceError,
    RewardSettings,
    TrainingCancelled,
    TrainSettings,
    default_lr,
    default_output_name,
    settings_json,
    validate_settings,
)
from model_core.training.preference_trl import (
    ProgressFn,
    TrainResult,
    common_args,
    hf_dataset,
    limit,
    lora_config,
    run_trl,
)

# Callers (tasks/, app/, bench/, tests/) import all of these from model_core.training.preference.
__all__ = [
    "DPO_LOSS_TYPES", "GRPO_LOSS_TYPES", "KINDS", "SETTINGS_CLASSES", "DPOSettings", "GRPOSettings",
    "PPOSettings", "PreferenceError", "ProgressFn", "RewardSettings", "TrainResult", "TrainSettings", "TrainingCancelled",
    "default_lr", "default_output_name", "encode_completion", "init_reward_model", "load_reward_model",
    "pair_logps", "preference_eval", "reward_eval", "reward_scores", "sequence_logps", "settings_json",
    "task_eval", "token_logps", "token_logratios", "train_dpo", "train_grpo", "train_on_gpus", "train_reward",
    "validate_settings", "train_ppo", "ppo_eval", "check_reward_model",
]


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
    test = limit(data.test, s.eval_examples)
    state: dict = {}

    def evaluate(when, m, tok, _ref):
        if when == "before":  # the reward model does not exist yet: build it here, score with its fresh head
            state["rm"] = init_reward_model(m, tok, s.seed)
            m = state["rm"]
        return reward_eval(m, tok, test, should_stop=should_stop) if test else None

    def build(m, tok, dev, scratch, cb):
        from trl import RewardConfig, RewardTrainer

        rm = state.pop("rm", None) or init_reward_model(m, tok, s.seed)
        del m
        args = data_parallel.one_gpu_each(RewardConfig(
            max_length=s.max_length, center_rewards_coefficient=s.center_rewards,
            **common_args(s, scratch("trainer"), dev)))
        trainer = RewardTrainer(model=rm, args=args,
                                train_dataset=hf_dataset([p.conversational() for p in data.train]),
                                processing_class=tok, callbacks=[cb],
                                peft_config=lora_config(s, "SEQ_CLS") if s.method == "lora" else None)
        return trainer, None

    return run_trl("reward", model, s, data, progress, should_stop, log, build, evaluate)


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
    test = limit(data.test, s.eval_examples)
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

    def build(m, tok, dev, scratch, cb):
        from trl import DPOConfig, DPOTrainer

        lora = s.method == "lora"
        if s.reference:
            ref = state.get("ref") or named_reference(tok)
        else:  # LoRA: TRL switches the adapter off for the reference; full: a frozen copy of the start
            ref = None if lora else copy.deepcopy(m).requires_grad_(False).eval()
        args = data_parallel.one_gpu_each(DPOConfig(beta=s.beta, loss_type=s.loss_type, max_length=s.max_length,
                                                    **common_args(s, scratch("trainer"), dev)))
        trainer = DPOTrainer(model=m, ref_model=ref, args=args,
                             train_dataset=hf_dataset([p.conversational() for p in data.train]),
                             processing_class=tok,
                             callbacks=[cb], peft_config=lora_config(s, "CAUSAL_LM") if lora else None)
        return trainer, None

    return run_trl("dpo", model, s, data, progress, should_stop, log, build, evaluate,
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
    test = limit(data.test, s.eval_examples)

    def evaluate(when, m, tok, _ref):
        return task_eval(m, tok, test, s.max_completion_length, should_stop=should_stop) if test else None

    def build(m, tok, dev, scratch, cb):
        from trl import GRPOConfig, GRPOTrainer

        lora = s.method == "lora"
        src = str(getattr(m.config, "_name_or_path", "") or "")
        if s.beta > 0 and not lora and not (src and Path(src).is_dir()):
            # TRL builds the full-fine-tuning reference with from_pretrained(config._name_or_path); a model
            # built in memory (random-* configs) has no folder, so give it one.
            ref_dir = scratch("reference")
            m.save_pretrained(ref_dir, safe_serialization=True)
            m.config._name_or_path = str(ref_dir)
        args = data_parallel.one_gpu_each(GRPOConfig(
            num_generations=s.num_generations, max_completion_length=s.max_completion_length,
            temperature=s.temperature, top_p=1.0, top_k=0, beta=s.beta, loss_type=s.loss_type,
            scale_rewards="none" if s.loss_type == "dr_grpo" else "group", epsilon=s.epsilon,
            epsilon_high=s.epsilon_high, num_iterations=s.num_iterations, mask_truncated_completions=False,
            log_completions=False, **common_args(s, scratch("trainer"), dev)))
        trainer = GRPOTrainer(model=m, reward_funcs=[verifiable_reward], args=args,
                              train_dataset=hf_dataset([t.conversational() for t in data.train]),
                              processing_class=tok, callbacks=[cb],
                              peft_config=lora_config(s, "CAUSAL_LM") if lora else None)
        return trainer, None

    return run_trl("grpo", model, s, data, progress, should_stop, log, build, evaluate,
                   extra_info=lambda: {"loss_label": GRPO_LOSS_TYPES[s.loss_type],
                                       "verifiers": {v: VERIFIERS[v].description
                                                     for v in data.describe()["verifiers"]}})


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
