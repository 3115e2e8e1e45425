"""Supervised fine-tuning (SFT): chat data -> masked labels -> Trainer (full or LoRA) -> a registered model.

Pure torch + transformers + peft (no celery, no gradio). The Celery job (tasks/sft_job.py), the
bench (bench/sft.py) and the tests all call `run_sft`, and import everything below from this
module: the settings live in sft_settings, the data and the loss mask in sft_data, held-out
accuracy and the samples in sft_eval, the run's lifecycle (name, staging, progress, cancel,
lmscope.json, registration) in model_core.training.run, the Trainer callback in trainer_callbacks.

Data: JSONL, one example per line, either {"messages": [{"role", "content"}, ...]} (at least one
assistant turn) or {"prompt": str, "completion": str} (= one user turn and one assistant turn).
Malformed lines raise DatasetError naming their line numbers.

Loss mask: labels are -100 on every token that is not assistant content. The assistant spans come
from the chat template itself, prefix by prefix: for the i-th message (an assistant turn),
render messages[:i] with the generation prompt (text A) and messages[:i+1] (text B); the
characters B[len(A):] are what the assistant "said", and we keep them up to and including the
end-of-turn token (the tokenizer's eos, `<|im_end|>` for SmolLM2) and drop the template glue
after it (SmolLM2: the "\n" after `<|im_end|>`). Tokens of the full rendering are assistant
tokens when their first character lies in such a span (offset mapping of the fast tokenizer).
So the model learns to answer and to end its turn, and nothing else. This works for any
template whose renderings are prefix-stable (SmolLM2's, ChatML, Llama 3, Gemma); one that is
not (e.g. a template that rewrites earlier turns) is refused with a clear error.

Training: transformers' Trainer (optimizer, schedule, grad clipping, eval loop, seeds, bf16 on
GPU) with a callback for progress / cancel / NaN (trainer_callbacks.SFTCallback). On a GPU each decoder layer is compiled and the
loss is Liger's fused linear + cross-entropy when liger-kernel is installed (train_speed); with
several GPUs, run_sft_on_gpus runs one process per GPU (data_parallel). LoRA via peft, merged into
the base weights before saving, so every checkpoint loads as a plain model. Not TRL's SFTTrainer:
measured on the built-in demo (real default model, CPU, 8 steps), it trained in 32.0-34.2 s against
the Trainer's 23.1-24.1 s with the same losses (it computes entropy and token accuracy through its own
chunked LM head every step), and it refuses Liger's loss.

Output: a safetensors checkpoint with tokenizer + chat template, written to a staging directory
under <data dir>/sft-staging and renamed to <data dir>/models/<name> only after success (a
cancelled or failed run never shows up as a model), with lmscope.json = {parent, parameters,
training, dataset, accuracy_before, accuracy_after, metrics, samples, checkpoints}.

During training (run_sft's docstring has the details): greedy samples of a few held-out prompts at
step 0, every `sample_every` steps and at the end; with `keep_checkpoints`, the model at evenly
spaced steps, registered beside the final one as '<name>-step<S>' (lmscope.json adds checkpoint_of
and step) only when the whole run succeeds.
"""


from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from model_core.core.checkpoints import checkpoint_name
from model_core.core.errors import SettingsError
from model_core.training import data_parallel, train_speed
from model_core.training.run import TrainingRun, train_checked
from model_core.training.sft_data import (
    BUILTIN_TASK,
    Collator,
    EncodedData,
    ListDataset,
    PackingCollator,
    PadOnly,
    assistant_char_spans,
    builtin_dataset,
    encode_conversation,
    encode_dataset,
    ensure_chat_template,
    held_out_split,
    heldout_from_convs,
    load_jsonl,
    parse_example,
    prepare_data,
    prepare_run_data,
    quiet_datasets,
    read_dataset_text,
    unused_token_id,
    write_builtin_jsonl,
)
from model_core.training.sft_eval import (
    MAX_SAMPLE_STEPS,
    SAMPLE_MAX_NEW_TOKENS,
    evaluate_accuracy,
    greedy_answers,
    normalise_answer,
    sample_generations,
    sample_max_new_tokens,
    sample_steps,
    thin_samples,
)
from model_core.training.sft_settings import (
    BUILTIN,
    H100_BF16_PEAK,
    IGNORE,
    MAX_KEEP_CHECKPOINTS,
    MAX_SAMPLE_PROMPTS,
    SIMPLE_CHAT_TEMPLATE,
    DatasetError,
    SFTCancelled,
    SFTError,
    SFTSettings,
    default_output_name,
    loader_workers,
    mfu,
    setting_number,
    validate_settings,
)

# Callers (tasks/, app/, bench/, tests/) import all of these from model_core.training.sft.
__all__ = [
    "BUILTIN", "BUILTIN_TASK", "H100_BF16_PEAK", "IGNORE", "MAX_KEEP_CHECKPOINTS", "MAX_SAMPLE_PROMPTS",
    "MAX_SAMPLE_STEPS", "SAMPLE_MAX_NEW_TOKENS", "SIMPLE_CHAT_TEMPLATE", "Collator", "PackingCollator", "DatasetError", "EncodedData",
    "SFTCancelled", "SFTError", "SFTResult", "SFTSettings", "SettingsError", "apply_lora", "assistant_char_spans",
    "builtin_dataset", "checkpoint_name", "checkpoint_steps", "compare_models", "count_params",
    "default_output_name", "encode_conversation", "encode_dataset", "ensure_chat_template", "evaluate_accuracy",
    "greedy_answers", "held_out_split", "heldout_from_convs", "load_for_training", "load_jsonl", "load_trainable",
    "mask_view", "mfu", "normalise_answer", "parse_example", "plain_state_dict", "prepare_data",
    "quiet_datasets", "read_dataset_text", "run_sft", "run_sft_on_gpus", "sample_generations",
    "sample_max_new_tokens", "sample_steps", "save_plain", "setting_number", "tensorboard_callback",
    "thin_samples", "train_checked", "validate_settings", "write_builtin_jsonl",
]


# =============================================================================================
# Intermediate checkpoints

def checkpoint_steps(max_steps: int, keep: int) -> list[int]:
    """At most `keep` evenly spaced steps strictly inside the run (the last step is the final model)."""
    if keep <= 0:
        return []
    return sorted({round(max_steps * i / (keep + 1)) for i in range(1, keep + 1)} & set(range(1, max_steps)))


def plain_state_dict(model):
    """(the transformers model to save with, a CPU copy of the weights a plain model of that class
    has). A peft LoRA model is merged in the copy (W + peft's own ΔW, as merge_and_unload computes
    it); the training model is never modified. Tied weights stay one tensor."""
    base = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    merged: dict[str, torch.Tensor] = {}
    if base is not model:
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.lora.layer import LoraLayer

        for mname, mod in base.named_modules():
            if not isinstance(mod, LoraLayer):
                continue
            active = [a for a in mod.active_adapters if a in mod.lora_A]
            if not isinstance(mod, LoraLinear) or any(a in mod.lora_variant or mod.lora_bias.get(a) for a in active):
                import copy  # something apply_lora never makes (DoRA, biases, embeddings): merge a whole copy

                m = copy.deepcopy(model).merge_and_unload()
                return m, {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()}
            w = mod.get_base_layer().weight.detach()
            for a in active:
                w = w + mod.get_delta_weight(a)
            merged[f"{mname}.base_layer.weight"] = w
    out, by_ptr = {}, {}
    with torch.no_grad():
        for k, v in base.state_dict().items():
            parts = k.split(".")
            if any(p.startswith("lora_") for p in parts):
                continue
            src = merged.get(k, v)
            key = ".".join(p for p in parts if p != "base_layer")
            ptr = (v.data_ptr(), tuple(v.shape), k in merged)
            if ptr not in by_ptr:
                by_ptr[ptr] = src.detach().to("cpu", copy=True)
            out[key] = by_ptr[ptr]
    return base, out


def save_plain(model, tokenizer, directory: Path) -> None:
    """Write `model` (LoRA merged, see plain_state_dict) as a Hugging Face folder with its tokenizer."""
    base, sd = plain_state_dict(model)
    directory.mkdir(parents=True, exist_ok=True)
    base.save_pretrained(directory, state_dict=sd, safe_serialization=True)
    tokenizer.save_pretrained(directory)


# =============================================================================================
# Model setup

def load_trainable(name: str, device: str | None = None):
    """A fresh, trainable (fp32 master weights) copy of a registry/fine-tuned/local model, its tokenizer
    and its device. Not the cached inference copy the explorer uses."""
    from model_core.core.registry import load_uncached, resolve_device

    dev, _ = resolve_device(device)
    lm = load_uncached(name, dev, torch.float32, "sdpa", True, False)
    lm.model.requires_grad_(True)
    lm.model.train()
    tok = lm.tokenizer
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return lm.model, tok, dev


def load_for_training(name: str, device: str | None, error_cls: type, say: Callable[[str], None]):
    """load_trainable with what every trainer here does next: a model too big for the GPU is one
    sentence of `error_cls`, and a tokenizer without a chat template gets SIMPLE_CHAT_TEMPLATE
    (said in the log). -> (model, tokenizer, device, whether the template was added)."""
    try:
        model, tok, dev = load_trainable(name, device)
    except torch.cuda.OutOfMemoryError:
        raise error_cls(f"Model '{name}' does not fit in GPU memory.") from None
    added = ensure_chat_template(tok)
    if added:
        say("the tokenizer has no chat template; using lmscope's simple 'role: content<eos>' template")
    return model, tok, dev, added


def apply_lora(model, rank: int, alpha: float | None, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0, target_modules="all-linear",
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def count_params(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


# =============================================================================================
# The run

@dataclass
class SFTResult:
    name: str
    path: Path
    info: dict
    history: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)  # [{name, step, path}] registered beside the final model
    samples: list[dict] = field(default_factory=list)  # [{step, index, prompt, completion, expected, correct}]


ProgressFn = Callable[[dict], None]


def run_sft(settings: SFTSettings | dict, progress: ProgressFn | None = None,
            should_stop: Callable[[], bool] | None = None, log: Callable[[str], None] | None = None,
            tensorboard_dir: str | os.PathLike | None = None) -> SFTResult:
    """Fine-tune and register. progress(dict) gets {phase, step, max_steps, epoch, loss, eval_loss,
    tokens_per_s, lr, eta_s, elapsed_s, tokens_seen}; should_stop() is polled between steps (cancel ->
    SFTCancelled, nothing registered); NaN/inf loss -> SFTError. Returns the registered model.
    tensorboard_dir: also write TensorBoard event files there (see tensorboard_callback). The name
    checks, staging folder, phase rows, cancel, lmscope.json and registration are run.TrainingRun's.

    Samples (sample_every, sample_prompts): at step 0, every sample_every steps and the last step,
    greedy completions of held-out prompts (sample_generations) go to progress as {phase: "samples",
    step, max_steps, samples: [{step, index, prompt, completion, expected, correct}]}; all of them are
    in the result and in lmscope.json (thinned to MAX_SAMPLE_STEPS points).
    Checkpoints (keep_checkpoints = N): the model at N evenly spaced steps (checkpoint_steps) is
    saved beside the final model's staging folder (LoRA merged in a copy) and, only when the run
    succeeds, registered as '<name>-step<S>' with lmscope.json {parent, checkpoint_of, step, ...};
    a cancelled or failed run removes them with its staging folder."""
    s = validate_settings(settings)
    name = s.output_name or default_output_name(s.model, method=s.method)
    with TrainingRun(name, error_cls=SFTError, cancelled_cls=SFTCancelled, overwrite=s.overwrite,
                     progress=progress, should_stop=should_stop, log=log) as run:
        return _fine_tune(s, run, tensorboard_dir)


def _fine_tune(s: SFTSettings, run: TrainingRun, tensorboard_dir) -> SFTResult | None:
    """run_sft inside its TrainingRun. None in a data-parallel process other than the main one."""
    from transformers import set_seed

    from model_core.training.trainer_callbacks import SFTCallback, quiet

    say, stop, name = run.say, run.should_stop, run.name
    run.phase("loading model")
    set_seed(s.seed)
    model, tok, dev, added_template = load_for_training(s.model, s.device, SFTError, say)
    train, ev, test, sample_items, desc = prepare_run_data(s, tok)
    say(f"data: {train.total} train examples ({train.truncated} truncated, {train.dropped} dropped at "
        f"max_length {s.max_length}), {ev.total if ev else 0} eval, {len(test)} held-out prompts; "
        f"{train.trained_tokens} of {train.tokens} train tokens count in the loss")
    run.check_stop()
    n_params = sum(p.numel() for p in model.parameters())
    main = data_parallel.is_main_process()  # with several GPUs, the one process that evaluates and saves
    per_process = data_parallel.per_process_batch(s.batch_size)
    acc_before = None
    if test and main:
        run.phase("accuracy before")
        acc_before = evaluate_accuracy(model, tok, test, should_stop=stop)
        say(f"held-out accuracy before: {acc_before['correct']}/{acc_before['n']}")
    if s.method == "lora":
        model = apply_lora(model, s.lora_rank, s.lora_alpha, s.seed)
    total, trainable = count_params(model)
    steps_per_epoch = math.ceil(len(train.examples) / s.batch_size)
    max_steps = run.max_steps = s.max_steps or max(1, math.ceil(steps_per_epoch * s.epochs))
    eval_every = s.eval_every or max(1, max_steps // 5)
    say(f"training {s.method} ({trainable:,} of {total:,} parameters trainable) for {max_steps} steps, "
        f"batch {s.batch_size}, lr {s.lr():g}, on {dev}")

    s_steps, n_new, sampling = _sampling_plan(s, tok, sample_items, max_steps, say)
    c_steps = checkpoint_steps(max_steps, s.keep_checkpoints)
    if s.keep_checkpoints and len(c_steps) < s.keep_checkpoints:
        say(f"{max_steps} steps leave room for {len(c_steps)} intermediate checkpoint(s), not {s.keep_checkpoints}")
    run.reserve_checkpoints(c_steps)
    if c_steps:
        say(f"keeping checkpoints at steps {', '.join(map(str, c_steps))} (registered when the run succeeds)")
    samples: list[dict] = []
    timing = {"sample_seconds": 0.0, "checkpoint_seconds": 0.0}
    kept: dict[int, dict] = {}  # step -> {train_seconds, created} of a checkpoint saved by run.checkpoint_dir
    train_model = model

    def at_step(step: int) -> None:
        if step in s_steps:
            t0 = time.time()
            rows = sample_generations(train_model, tok, sample_items, step, n_new, should_stop=stop)
            samples.extend(rows)
            timing["sample_seconds"] += time.time() - t0
            run.phase("samples", step, samples=rows)
        if step in c_steps:
            t0 = time.time()
            kept[step] = {"train_seconds": cb.train_time, "created": time.time()}
            save_plain(train_model, tok, run.checkpoint_dir(step))
            timing["checkpoint_seconds"] += time.time() - t0
            say(f"checkpoint at step {step} kept (registered as '{checkpoint_name(name, step)}' when the run "
                "succeeds)")

    cb = SFTCallback(run.progress, stop, max_steps, run.t_start, at_step if (s_steps or c_steps) and main else None)
    trainer = _trainer(s, model, tok, dev, train, ev, run.scratch("trainer"), cb, max_steps, eval_every,
                       per_process, say)
    tb = tensorboard_callback(tensorboard_dir, s, say) if tensorboard_dir is not None else None
    if tb is not None:
        trainer.add_callback(tb)
    quiet(trainer)
    try:
        run.train(trainer, cb)
    finally:
        if tb is not None and tb.tb_writer is not None:  # a run that raised never reached on_train_end
            tb.tb_writer.close()
    model = trainer.model
    del trainer
    if not main:
        return None
    if s.method == "lora":
        model = model.merge_and_unload()
    model.eval()
    acc_after = None
    if test:
        run.phase("accuracy after", max_steps)
        acc_after = evaluate_accuracy(model, tok, test, should_stop=stop)
        say(f"held-out accuracy after: {acc_after['correct']}/{acc_after['n']}")
    run.check_stop()
    run.phase("saving", max_steps)
    ckpt_list = run.checkpoint_list()
    info = {
        "parent": s.model, "parameters": n_params, "training": s.to_json(), "dataset": desc,
        "data": {"train": train.stats(), "eval": ev.stats() if ev else None},
        "accuracy_before": acc_before, "accuracy_after": acc_after,
        "metrics": {**cb.summary(n_params), **{k: round(v, 2) for k, v in timing.items()}},
        "history": cb.history, "samples": thin_samples(samples), "sampling": sampling,
        "checkpoints": ckpt_list, "chat_template_added": added_template, "created": time.time(),
    }
    run.save(model, tok, info)
    for st, c in kept.items():
        run.save_checkpoint_record(st, {
            **info, "checkpoint_of": name, "step": st, "max_steps": max_steps, "accuracy_after": None,
            "metrics": cb.summary(n_params, upto=st, train_time=c["train_seconds"]),
            "history": [r for r in cb.history if r["step"] <= st],
            "samples": [r for r in samples if r["step"] == st], "checkpoints": [], "created": c["created"]})
    path = run.register()
    return SFTResult(name=name, path=path, info=info, history=cb.history, samples=samples,
                     checkpoints=[{**c, "path": run.root / c["name"]} for c in ckpt_list])


def _sampling_plan(s: SFTSettings, tok, items: list, max_steps: int, say) -> tuple[set[int], int, dict]:
    """(steps to sample at, new tokens per sample, the record's 'sampling'), said in the log."""
    s_steps = set(sample_steps(max_steps, s.sample_every, len(items)))
    n_new = sample_max_new_tokens(tok, items) if s_steps else SAMPLE_MAX_NEW_TOKENS
    sampling = {"steps": sorted(s_steps), "prompts": len(items) if s_steps else 0, "max_new_tokens": n_new}
    if s.sample_every != 0 and s.sample_prompts and not items:
        say("no held-out prompts to sample during training (the eval split is empty)")
    elif s_steps:
        say(f"sampling {len(items)} held-out prompt(s) greedily at steps {', '.join(map(str, sorted(s_steps)))}")
    return s_steps, n_new, sampling


def _trainer(s: SFTSettings, model, tok, dev, train: EncodedData, ev: EncodedData | None, output_dir: Path,
             cb, max_steps: int, eval_every: int, per_process: int, say):
    """transformers' Trainer for one run: linear schedule, clipping at 1.0, an eval every `eval_every`
    steps when there is an eval split, bf16 and the fused AdamW on a GPU, train_speed's options."""
    from transformers import Trainer, TrainingArguments

    use_cuda = dev.type == "cuda"
    speed, speed_notes = train_speed.speed_options(model, dev, s.torch_compile)
    for note in speed_notes:
        say(note)
    workers = loader_workers(s, use_cuda)
    if workers and multiprocessing.current_process().daemon:  # run_sft_on_gpus avoids this; a direct caller may not
        say("the batches are built in the training process: a daemonic process may not start loader processes")
        workers = 0
    elif workers:
        say(f"{workers} loader processes build the batches")
    args = data_parallel.one_gpu_each(TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=per_process,
        per_device_eval_batch_size=per_process, learning_rate=s.lr(), lr_scheduler_type="linear",
        warmup_steps=s.warmup_steps, weight_decay=0.0, max_grad_norm=1.0, seed=s.seed, data_seed=s.seed,
        logging_steps=1, logging_nan_inf_filter=False, save_strategy="no", report_to="none",
        eval_strategy="steps" if ev else "no", eval_steps=eval_every if ev else None,
        disable_tqdm=True, dataloader_num_workers=workers, dataloader_persistent_workers=workers > 0,
        remove_unused_columns=False,
        use_cpu=not use_cuda, bf16=use_cuda and torch.cuda.is_bf16_supported(),
        include_num_input_tokens_seen="non_padding", optim="adamw_torch_fused" if use_cuda else "adamw_torch",
        **speed,
    ))
    extra = {}
    if s.packing:  # padding-free rows; their padding id is one no example uses, so the token count is exact
        pad = unused_token_id(train.examples + (ev.examples if ev else []), model.get_input_embeddings().num_embeddings)
        collator, extra["processing_class"] = PackingCollator(pad, s.max_length), PadOnly(pad)
    else:
        collator = Collator(tok.pad_token_id)
    return Trainer(model=model, args=args, train_dataset=ListDataset(train.examples),
                   eval_dataset=ListDataset(ev.examples) if ev else None, data_collator=collator, callbacks=[cb],
                   **extra)


def run_sft_on_gpus(settings: SFTSettings | dict, progress: ProgressFn | None = None,
                    should_stop: Callable[[], bool] | None = None, log: Callable[[str], None] | None = None,
                    tensorboard_dir: str | os.PathLike | None = None, processes: int | None = None) -> SFTResult:
    """run_sft on every GPU of the machine, one process each, or in this process with fewer than two
    GPUs (data_parallel.train). The step's batch_size is the whole step's either way. A run that wants
    loader processes (loader_workers) from a daemonic process, such as a pool process of the Celery
    worker, trains in a process of its own, which may start them."""
    from model_core.core.registry import resolve_device

    s = validate_settings(settings)
    own = multiprocessing.current_process().daemon and loader_workers(s, resolve_device(s.device)[0].type == "cuda") > 0
    return data_parallel.train("model_core.training.sft:run_sft", asdict(s),
                               kwargs={"tensorboard_dir": str(tensorboard_dir) if tensorboard_dir else None},
                               processes=processes, own_process=own, progress=progress, should_stop=should_stop,
                               log=log, error_cls=SFTError)


def tensorboard_callback(log_dir: str | os.PathLike, s: SFTSettings, say: Callable[[str], None] | None = None):
    """transformers' TensorBoardCallback writing event files into log_dir through tensorboardX (a
    small writer; the tensorboard package is only needed to view them): train/loss, train/grad_norm,
    train/learning_rate, eval/loss ... per step, and the run's settings as text (without server
    paths, where TrainingArguments would name the staging folder). None when tensorboardX is missing."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        (say or (lambda m: None))("TensorBoard logs skipped: the tensorboardX package is not installed")
        return None
    from model_core.training.trainer_callbacks import SettingsTensorBoard

    settings = s.to_json()
    if settings.get("dataset") not in (None, BUILTIN):
        settings["dataset"] = Path(settings["dataset"]).name
    return SettingsTensorBoard(SummaryWriter(log_dir=str(log_dir)), settings)


# =============================================================================================
# Base vs fine-tuned: one prompt through both models

def compare_models(base, tuned, prompt: str | None = None, token_ids=None, chat: bool = False, k: int = 10,
                   max_tokens: int = 256) -> dict:
    """One prompt through two LoadedModels with the same vocabulary (a fine-tuned model and its parent).

    Returns plain lists (JSON-able) for the views:
      tokens            the prompt's tokens [{id, text, display}] (tokenized by the base model)
      next              {"base": [(token, p)], "tuned": [(token, p)]} top-k next-token candidates
      kl                per position KL(tuned || base) of the next-token distributions (nats), [T]
      lens_kl           [L][T]: KL(tuned || base) of the logit lens at each layer's residual output
      lens_top          {"base": [L] top-1 lens token at the last position, "tuned": [L]} (model_core.interp.lens)
      attn_diff         [L][H]: mean over query positions of the total-variation distance between the
                        two models' attention rows (0 = same pattern, 1 = disjoint)
    """
    from model_core.interp.lens import logit_lens
    from model_core.interp.trace import encode_prompt, trace

    if base.shape.vocab_size != tuned.shape.vocab_size or base.shape.n_layers != tuned.shape.n_layers \
            or base.shape.n_heads != tuned.shape.n_heads:
        raise SettingsError("These two models have different shapes (vocabulary, layers or heads); compare a "
                            "fine-tuned model with its parent.")
    if token_ids is None:
        # a template-less base (random test models) borrows the template SFT gave its fine-tuned child
        enc = tuned if chat and not base.has_chat_template and tuned.has_chat_template else base
        token_ids = encode_prompt(enc, prompt or "", chat=chat, max_tokens=max_tokens)
    tb = trace(base, token_ids=token_ids)
    tt = trace(tuned, token_ids=token_ids)
    T = len(token_ids)

    def kl(lp_t, lp_b):  # KL(tuned || base) over the last dim
        return (lp_t.exp() * (lp_t - lp_b)).sum(-1)

    with torch.inference_mode():
        lb = torch.log_softmax(tb.logits().float(), -1)
        lt = torch.log_softmax(tt.logits().float(), -1)
        pos_kl = kl(lt, lb).clamp_min(0)
        lens_kl = []
        for layer in range(base.shape.n_layers):
            a = torch.log_softmax(base.adapter.logits_from_resid(tb.resid_post(layer)).float(), -1)
            b = torch.log_softmax(tuned.adapter.logits_from_resid(tt.resid_post(layer)).float(), -1)
            lens_kl.append(kl(b, a).clamp_min(0).cpu().tolist())
        attn = []
        for layer in range(base.shape.n_layers):
            pa, pb = tb.attention_pattern(layer).float(), tt.attention_pattern(layer).float()
            attn.append((0.5 * (pa - pb).abs().sum(-1)).mean(-1).cpu().tolist())  # [H]

    def top(lp):
        p, i = lp[-1].exp().topk(min(k, lp.shape[-1]))
        return [(base.tokenizer.decode([int(t)]), float(q)) for q, t in zip(p, i)]

    lens = {}
    for key, tr, lm in (("base", tb, base), ("tuned", tt, tuned)):
        r = logit_lens(tr, positions=[T - 1], k=1)
        lens[key] = [lm.tokenizer.decode([int(r.top_ids[l, 0, 0])]) for l in range(len(r.layers))]
        lens[key + "_p"] = [float(r.top_probs[l, 0, 0]) for l in range(len(r.layers))]
    return {"tokens": tb.tokens, "next": {"base": top(lb), "tuned": top(lt)}, "kl": pos_kl.cpu().tolist(),
            "lens_kl": lens_kl, "lens_top": lens, "attn_diff": attn, "n_layers": base.shape.n_layers,
            "n_heads": base.shape.n_heads}


def mask_view(tokenizer, messages: list[dict]) -> list[dict]:
    """[{display, id, trained}] for one conversation: what the loss sees, token by token."""
    import copy

    from model_core.core.tokenization import describe_tokens

    if not getattr(tokenizer, "chat_template", None):
        tokenizer = copy.deepcopy(tokenizer)  # never mutate the explorer's cached tokenizer
        ensure_chat_template(tokenizer)
    ex = encode_conversation(tokenizer, messages)
    rows = describe_tokens(tokenizer, ex["input_ids"])
    for r, m in zip(rows, ex["assistant_mask"]):
        r["trained"] = bool(m)
    return rows
