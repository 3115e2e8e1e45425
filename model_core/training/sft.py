"""Supervised fine-tuning (SFT): chat data -> masked labels -> Trainer (full or LoRA) -> a registered model.

Pure torch + transformers + peft (no celery, no gradio). The Celery job (tasks/sft_job.py), the
bench (bench/sft.py) and the tests all call `run_sft`.

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
GPU) with a callback for progress / cancel / NaN. On a GPU each decoder layer is compiled and the
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

import json
import math
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from model_core.core import paths
from model_core.core.checkpoints import builtin_names, staging_dir, sweep_staging, valid_output_name
from model_core.core.errors import LmscopeError, SettingsError
from model_core.training import data_parallel, train_speed

BUILTIN = "builtin"
IGNORE = -100

# Given to tokenizers without a chat template (the byte tokenizer of the random-* test models), so
# that chat data and the compare view work on them too. One line per turn, ended by eos.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, datasheet


class SFTError(LmscopeError):
    """A run that cannot start or did not finish; str() is one sentence for the user."""


class DatasetError(SFTError):
    pass


class SFTCancelled(Exception):
    """The should_stop callback asked the run to stop; nothing was registered."""


def mfu(n_params: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation of training: 6 N FLOPs per token (forward 2N + backward 4N)."""
    return 6.0 * float(n_params) * float(tokens_per_s) / float(peak_flops)


# =============================================================================================
# Settings

MAX_SAMPLE_PROMPTS = 20
MAX_KEEP_CHECKPOINTS = 20  # each one is a full copy of the model on disk


@dataclass
class SFTSettings:
    model: str = "smollm2-135m-instruct"
    dataset: str = BUILTIN  # "builtin" or a JSONL path
    output_name: str | None = None  # default "<model>-sft-<time>"
    method: str = "full"  # "full" | "lora"
    lora_rank: int = 8
    lora_alpha: float | None = None  # default 2 x rank
    learning_rate: float | None = None  # default 1e-4 full, 1e-3 LoRA
    max_steps: int | None = None  # wins over epochs when set
    epochs: float = 1.0
    batch_size: int = 8
    max_length: int = 256
    eval_fraction: float = 0.1  # of the dataset, for eval loss (and held-out accuracy on uploads)
    eval_every: int | None = None  # steps; default: 5 evaluations per run
    warmup_steps: int = 0
    seed: int = 0
    builtin_train_size: int = 64  # 1 epoch at batch 8 = 8 steps: ~100 s on an idle 2-core CPU, 0/40 -> 40/40
    accuracy_examples: int = 40  # held-out prompts generated before/after (0 = skip)
    device: str | None = None
    torch_compile: bool | None = None  # None: on for a GPU (each decoder layer compiled), off for the CPU
    overwrite: bool = False
    sample_every: int | None = None  # steps between sample generations; default ~4 points per run; 0 = off
    sample_prompts: int = 3  # held-out prompts generated greedily at step 0, every sample_every steps, and at the end
    keep_checkpoints: int = 0  # also register the model at this many evenly spaced steps, as <name>-step<S>

    def lr(self) -> float:
        return self.learning_rate or (1e-3 if self.method == "lora" else 1e-4)

    def to_json(self) -> dict:
        d = asdict(self)
        d["learning_rate"] = self.lr()
        d["lora_alpha"] = self.lora_alpha or 2 * self.lora_rank
        if self.method != "lora":
            d.pop("lora_rank"), d.pop("lora_alpha")
        return d


def setting_number(d: dict, key: str, cast, lo=None, hi=None, allow_none=False):
    """d[key] as a number (cast int or float) within [lo, hi], for the training settings (fine-tuning
    and pretraining); one sentence naming the setting otherwise. None or "": None with allow_none."""
    v = d.get(key)
    if v is None or v == "":
        if allow_none:
            return None
        raise SettingsError(f"Setting '{key}' is required.")
    try:
        if isinstance(v, bool):
            raise ValueError
        f = float(v)
        x = int(f) if cast is int else cast(v)
        if cast is int and f != x:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise SettingsError(f"Setting '{key}' must be a number, got {v!r}.") from None
    if isinstance(x, float) and not math.isfinite(x):
        raise SettingsError(f"Setting '{key}' must be finite.")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise SettingsError(f"Setting '{key}' must be between {lo:,} and {hi:,}, got {x:,}.")
    return x


def validate_settings(raw: dict | SFTSettings) -> SFTSettings:
    """Check and normalise user settings; SettingsError (one sentence) for anything wrong."""
    d = asdict(raw) if isinstance(raw, SFTSettings) else dict(raw or {})
    known = set(SFTSettings.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise SettingsError(f"Unknown SFT setting(s): {', '.join(unknown)}.")
    base = SFTSettings()
    for k in known:
        if d.get(k) is None and k not in ("output_name", "learning_rate", "max_steps", "lora_alpha",
                                          "eval_every", "device", "sample_every"):
            d[k] = getattr(base, k)
    method = str(d["method"]).lower()
    if method not in ("full", "lora"):
        raise SettingsError(f"Method must be 'full' or 'lora', got {d['method']!r}.")
    s = SFTSettings(
        model=str(d["model"]).strip(), dataset=str(d["dataset"]).strip() or BUILTIN,
        output_name=(str(d["output_name"]).strip() or None) if d.get("output_name") else None,
        method=method,
        lora_rank=setting_number(d, "lora_rank", int, 1, 1024),
        lora_alpha=setting_number(d, "lora_alpha", float, 1e-6, 1e6, allow_none=True),
        learning_rate=setting_number(d, "learning_rate", float, 1e-8, 1.0, allow_none=True),
        max_steps=setting_number(d, "max_steps", int, 1, 10**7, allow_none=True),
        epochs=setting_number(d, "epochs", float, 0.01, 1000),
        batch_size=setting_number(d, "batch_size", int, 1, 4096),
        max_length=setting_number(d, "max_length", int, 8, 1 << 17),
        eval_fraction=setting_number(d, "eval_fraction", float, 0.0, 0.5),
        eval_every=setting_number(d, "eval_every", int, 1, 10**7, allow_none=True),
        warmup_steps=setting_number(d, "warmup_steps", int, 0, 10**6),
        seed=setting_number(d, "seed", int, 0, 2**31 - 1),
        builtin_train_size=setting_number(d, "builtin_train_size", int, 8, 100_000),
        accuracy_examples=setting_number(d, "accuracy_examples", int, 0, 10_000),
        device=(str(d["device"]) if d.get("device") else None),
        torch_compile=(None if d.get("torch_compile") is None else bool(d.get("torch_compile"))),
        overwrite=bool(d.get("overwrite")),
        sample_every=setting_number(d, "sample_every", int, 0, 10**7, allow_none=True),
        sample_prompts=setting_number(d, "sample_prompts", int, 0, MAX_SAMPLE_PROMPTS),
        keep_checkpoints=setting_number(d, "keep_checkpoints", int, 0, MAX_KEEP_CHECKPOINTS),
    )
    if not s.model:
        raise SettingsError("No model given to fine-tune.")
    if s.output_name is not None and not valid_output_name(s.output_name):
        raise SettingsError("The output name may use letters, digits, '.', '_' and '-' (max 100), "
                            "and must start with a letter or digit.")
    if s.keep_checkpoints and s.output_name is not None and len(checkpoint_name(s.output_name, 10**7)) > 100:
        raise SettingsError("The output name is too long to also name checkpoints '<name>-step<S>' (max 100 "
                            "characters in all); shorten it or keep no checkpoints.")
    return s


def checkpoint_name(name: str, step: int) -> str:
    """The registered name of a run's intermediate checkpoint: '<final name>-step<S>'."""
    return f"{name}-step{int(step)}"


def default_output_name(model: str, suffix: str | None = None, method: str = "full") -> str:
    """'<model>-sft-full-<suffix>' or '<model>-sft-lora-<suffix>': a run's name says how it was trained."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model).name).strip("-.") or "model"
    kind = "lora" if method == "lora" else "full"
    return f"{base[:60]}-sft-{kind}-{suffix or time.strftime('%Y%m%d-%H%M%S')}"


# =============================================================================================
# Data: JSONL parsing

def _check_messages(msgs, where: str) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects.")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: message {j + 1} must be an object with string 'role' and 'content'.")
        role = m["role"].strip().lower()
        if role not in ("system", "user", "assistant"):
            raise DatasetError(f"{where}: message {j + 1} has role {m['role']!r}; use system, user or assistant.")
        out.append({"role": role, "content": m["content"]})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise DatasetError(f"{where}: no assistant turn (nothing to learn from).")
    return out


def parse_example(obj, where: str = "example") -> list[dict]:
    """One JSON object -> a list of messages (prompt/completion becomes user + assistant)."""
    if not isinstance(obj, dict):
        kind = {type(None): "null", list: "a list", str: "a string", bool: "true/false", int: "a number",
                float: "a number"}.get(type(obj), "something else")
        raise DatasetError(f"{where}: expected a JSON object like {{\"messages\": [...]}}, got {kind}.")
    if "messages" in obj:
        return _check_messages(obj["messages"], where)
    if "prompt" in obj or "completion" in obj:
        p, c = obj.get("prompt"), obj.get("completion")
        if not isinstance(p, str) or not isinstance(c, str):
            raise DatasetError(f"{where}: 'prompt' and 'completion' must both be strings.")
        if not c.strip():
            raise DatasetError(f"{where}: no assistant turn (the completion is empty).")
        return [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
    raise DatasetError(f"{where}: needs 'messages', or 'prompt' and 'completion'.")


def read_dataset_text(p: Path, error_cls: type = DatasetError) -> str:
    """A dataset file's text; a missing or non-UTF-8 file is one sentence of `error_cls`."""
    if not p.is_file():
        raise error_cls(f"Dataset file '{p.name}' does not exist.")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error_cls(f"Dataset file '{p.name}' is not UTF-8 text (byte {e.start}).") from None


def _scan_jsonl(p: Path) -> tuple[list[list[dict]], list[tuple[int, str]], int]:
    """(good conversations in file order, [(line number, reason)] for every bad line, number of
    non-blank lines). Raises DatasetError only for a missing or non-UTF-8 file."""
    text = read_dataset_text(p)
    convs, bad, n = [], [], 0
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        n += 1
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append((i, f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        try:
            convs.append(parse_example(obj, f"line {i}"))
        except DatasetError as e:
            bad.append((i, str(e).removeprefix(f"line {i}: ")))
    return convs, bad, n


def _bad_lines_text(bad: list[tuple[int, str]], max_errors: int) -> str:
    shown = "; ".join(f"line {i}: {why.rstrip('.')}" for i, why in bad[:max_errors])
    more = f" (and {len(bad) - max_errors} more)" if len(bad) > max_errors else ""
    return shown + more


def load_jsonl(path: str | os.PathLike, max_errors: int = 5, skip_bad: bool = False):
    """Parse a chat JSONL file. Blank lines are skipped. All bad lines are found.

    skip_bad=False (default): -> [conversation, ...]; any bad line raises DatasetError naming up to
    `max_errors` of them with their line numbers (and the column, for broken JSON).
    skip_bad=True: -> (conversations from the good lines, report) where report is
    {file, lines_kept, lines_skipped, skipped: [{line, reason}] (the first `max_errors`), message};
    it still raises DatasetError when no good line is left (naming the bad ones) or there are no
    examples at all. The report's `message` is one sentence for a panel."""
    p = Path(path)
    convs, bad, n = _scan_jsonl(p)
    if bad and not (skip_bad and convs):
        lead = (f"No usable examples in '{p.name}': all {len(bad)} line(s) are malformed: " if skip_bad and not convs
                else f"{len(bad)} malformed line(s) in '{p.name}': ")
        raise DatasetError(lead + _bad_lines_text(bad, max_errors) + ".")
    if not convs:
        raise DatasetError(f"Dataset file '{p.name}' has no examples.")
    if not skip_bad:
        return convs
    if bad:
        message = (f"Kept {len(convs)} of {n} lines of '{p.name}'; skipped {len(bad)} malformed: "
                   + _bad_lines_text(bad, max_errors) + ".")
    else:
        message = f"All {n} lines of '{p.name}' are good."
    return convs, {"file": p.name, "lines_kept": len(convs), "lines_skipped": len(bad),
                   "skipped": [{"line": i, "reason": why} for i, why in bad[:max_errors]], "message": message}


# =============================================================================================
# The built-in demo task: rewrite an ISO date as DD/MM/YYYY.
#
# Checkable (exact match), generated offline from a seed, and a pure format rule that a model must
# copy digits for: SmolLM2-135M-Instruct usually answers in another format, swaps day and month,
# or adds words; a few minutes of SFT on this CPU teach it the rule (see the README for numbers).

BUILTIN_TASK = "date-reformat"
_TEST_SEED_OFFSET = 10_007


def _date_example(rng: random.Random) -> tuple[str, str]:
    y, m = rng.randint(1950, 2049), rng.randint(1, 12)
    d = rng.randint(1, 28 if m == 2 else (30 if m in (4, 6, 9, 11) else 31))
    q = f"Rewrite the date {y:04d}-{m:02d}-{d:02d} in the format DD/MM/YYYY. Answer with the date only."
    return q, f"{d:02d}/{m:02d}/{y:04d}"


def builtin_dataset(n_train: int = 512, n_test: int = 50, seed: int = 0):
    """(train conversations, held-out [(messages without the answer, answer)]); disjoint questions."""
    rng = random.Random(seed)
    test_rng = random.Random(seed + _TEST_SEED_OFFSET)
    test, seen = [], set()
    while len(test) < n_test:
        q, a = _date_example(test_rng)
        if q not in seen:
            seen.add(q)
            test.append(([{"role": "user", "content": q}], a))
    train = []
    while len(train) < n_train:
        q, a = _date_example(rng)
        if q in seen:
            continue
        seen.add(q)
        train.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return train, test


def write_builtin_jsonl(path: str | os.PathLike, n: int = 512, seed: int = 0) -> Path:
    train, _ = builtin_dataset(n, 0, seed)
    p = Path(path)
    p.write_text("".join(json.dumps({"messages": c}) + "\n" for c in train), encoding="utf-8")
    return p


# =============================================================================================
# Tokenisation with the loss mask

def ensure_chat_template(tokenizer) -> bool:
    """Give a template-less tokenizer SIMPLE_CHAT_TEMPLATE. True if one was added."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return True


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(full rendered text, [(start, end)) character spans of the assistant turns incl. end-of-turn)."""
    full = _render(tokenizer, messages, False)
    eos = tokenizer.eos_token or ""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        a = _render(tokenizer, messages[:i], True)
        b = _render(tokenizer, messages[: i + 1], False)
        if not (b.startswith(a) and full.startswith(b)):
            raise SFTError("This model's chat template is not prefix-stable (rendering a conversation changes "
                           "its earlier turns), so the assistant tokens cannot be located; use prompt/completion "
                           "data with a simpler template.")
        start, end = len(a), len(b)
        if eos:
            k = b.rfind(eos, start)
            if k >= 0:
                end = k + len(eos)  # keep the end-of-turn token, drop the glue after it
        if end > start:
            spans.append((start, end))
    return full, spans


def encode_conversation(tokenizer, messages: list[dict]) -> dict:
    """{input_ids, labels, assistant_mask} for one conversation (no truncation)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SFTError("The tokenizer has no chat template; call ensure_chat_template first.")
    full, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(x) for x in enc["input_ids"]]
    mask = []
    for s, _e in enc["offset_mapping"]:  # a token belongs to the turn its first character is in
        mask.append(any(a <= s < b for a, b in spans))
    labels = [t if m else IGNORE for t, m in zip(ids, mask)]
    return {"input_ids": ids, "labels": labels, "assistant_mask": mask}


@dataclass
class EncodedData:
    examples: list[dict]
    total: int
    truncated: int
    dropped: int
    tokens: int
    trained_tokens: int

    def stats(self) -> dict:
        return {"examples": len(self.examples), "total": self.total, "truncated": self.truncated,
                "dropped": self.dropped, "tokens": self.tokens, "trained_tokens": self.trained_tokens}


def encode_dataset(tokenizer, convs: list[list[dict]], max_length: int) -> EncodedData:
    """Encode and cut to max_length tokens (right truncation). An example whose assistant tokens all
    fall beyond max_length is dropped (it would teach nothing); the counts are reported."""
    out, truncated, dropped, tok, trained = [], 0, 0, 0, 0
    for msgs in convs:
        ex = encode_conversation(tokenizer, msgs)
        if len(ex["input_ids"]) > max_length:
            ex = {k: v[:max_length] for k, v in ex.items()}
            if not any(ex["assistant_mask"][1:]):
                dropped += 1
                continue
            truncated += 1
        # The first token is never predicted (labels are shifted inside the model).
        if not any(l != IGNORE for l in ex["labels"][1:]):
            dropped += 1
            continue
        tok += len(ex["input_ids"])
        trained += sum(1 for l in ex["labels"][1:] if l != IGNORE)
        out.append(ex)
    if not out:
        raise DatasetError(f"All {len(convs)} examples are longer than max_length={max_length} before their "
                           "assistant turn; raise max_length.")
    return EncodedData(out, len(convs), truncated, dropped, tok, trained)


def quiet_datasets() -> None:
    """No progress bars from datasets' map/filter (TRL's trainers prepare data with them) in job logs."""
    try:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    except ImportError:  # pragma: no cover - datasets comes with trl
        pass


class Collator:
    """Right-pad a batch; labels padded with -100."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict:
        T = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), T), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(batch), T), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            labels[i, :n] = torch.tensor(b["labels"])
            att[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": att}


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return {"input_ids": r["input_ids"], "labels": r["labels"]}


# =============================================================================================
# Held-out accuracy by greedy generation

def normalise_answer(s: str) -> str:
    return " ".join(s.strip().split()).rstrip(".").strip()


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int = 24,
                   batch_size: int = 16, should_stop: Callable[[], bool] | None = None) -> list[str]:
    """Greedy completions (assistant turn only, special tokens dropped) of chat prompts."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    outs = []
    try:
        for i in range(0, len(prompts), batch_size):
            if should_stop and should_stop():
                raise SFTCancelled()
            enc = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                   for p in prompts[i:i + batch_size]]
            ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in enc]
            T = max(map(len, ids))
            x = torch.full((len(ids), T), pad, dtype=torch.long)
            att = torch.zeros_like(x)
            for j, s in enumerate(ids):  # left padding
                x[j, T - len(s):] = torch.tensor(s)
                att[j, T - len(s):] = 1
            gen = model.generate(input_ids=x.to(device), attention_mask=att.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=pad)
            for row in gen[:, T:]:
                outs.append(tokenizer.decode(row.tolist(), skip_special_tokens=True))
    finally:
        model.train(was_training)
    return outs


def evaluate_accuracy(model, tokenizer, items: list[tuple[list[dict], str]], max_new_tokens: int | None = None,
                      should_stop=None, n_show: int = 5) -> dict | None:
    """Exact match (whitespace- and final-period-insensitive) of greedy answers to references."""
    if not items:
        return None
    if max_new_tokens is None:
        longest = max(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for _, a in items)
        max_new_tokens = min(128, longest + 4)
    got = greedy_answers(model, tokenizer, [p for p, _ in items], max_new_tokens, should_stop=should_stop)
    ok = [normalise_answer(g) == normalise_answer(a) for g, (_, a) in zip(got, items)]
    return {"accuracy": sum(ok) / len(ok), "correct": sum(ok), "n": len(ok),
            "examples": [{"prompt": p[-1]["content"], "expected": a, "got": g, "correct": c}
                         for (p, a), g, c in list(zip(items, got, ok))[:n_show]]}


def heldout_from_convs(convs: list[list[dict]]) -> list[tuple[list[dict], str]]:
    """Held-out items from eval conversations: everything before the last assistant turn -> its text."""
    items = []
    for c in convs:
        last = max(i for i, m in enumerate(c) if m["role"] == "assistant")
        items.append((c[:last], c[last]["content"]))
    return items


# =============================================================================================
# Sample generations during training

SAMPLE_MAX_NEW_TOKENS = 24
MAX_SAMPLE_STEPS = 50  # sample points kept in a run record (thinned evenly beyond this; first and last kept)
_SAMPLE_PROMPT_CHARS = 300


def sample_steps(max_steps: int, sample_every: int | None, n_prompts: int) -> list[int]:
    """Steps at which the run generates its samples: 0 (before training), every `sample_every` steps
    (default: ceil(max_steps / 4), about 4 points) and the last step. [] when off (0, or no prompts)."""
    if sample_every == 0 or n_prompts <= 0:
        return []
    every = sample_every or max(1, math.ceil(max_steps / 4))
    return sorted({0, max_steps, *range(every, max_steps + 1, every)})


def sample_max_new_tokens(tokenizer, items: list[tuple[list[dict], str | None]]) -> int:
    """24 tokens, more (up to 64) when a known answer needs them."""
    longest = max((len(tokenizer(a, add_special_tokens=False)["input_ids"]) for _, a in items if a), default=0)
    return max(SAMPLE_MAX_NEW_TOKENS, min(64, longest + 4))


def sample_generations(model, tokenizer, items: list[tuple[list[dict], str | None]], step: int,
                       max_new_tokens: int = SAMPLE_MAX_NEW_TOKENS, should_stop=None) -> list[dict]:
    """Greedy completions of held-out prompts by the model as it is now: [{step, index, prompt,
    completion, expected, correct}] with correct = exact match (as held-out accuracy) when the answer
    is known, else None. Prompts of the same token length share a generate call and others run
    alone, so no row is ever padded. Eval mode and no_grad for the generation, the training mode and
    RNG state restored."""
    dev = next(model.parameters()).device
    groups: dict[int, list[int]] = {}
    for i, (msgs, _) in enumerate(items):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        groups.setdefault(len(tokenizer(text, add_special_tokens=False)["input_ids"]), []).append(i)
    got: list[str] = [""] * len(items)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for idx in groups.values():
            outs = greedy_answers(model, tokenizer, [items[i][0] for i in idx], max_new_tokens,
                                  batch_size=len(idx), should_stop=should_stop)
            for i, o in zip(idx, outs):
                got[i] = o
    rows = []
    for i, ((msgs, expected), completion) in enumerate(zip(items, got)):
        prompt = msgs[-1]["content"] if msgs else ""
        if len(prompt) > _SAMPLE_PROMPT_CHARS:
            prompt = prompt[: _SAMPLE_PROMPT_CHARS - 1] + "…"
        rows.append({"step": int(step), "index": i, "prompt": prompt, "completion": completion,
                     "expected": expected,
                     "correct": None if expected is None else normalise_answer(completion) == normalise_answer(expected)})
    return rows


def thin_samples(samples: list[dict], max_points: int = MAX_SAMPLE_STEPS) -> list[dict]:
    """Sample rows of at most `max_points` distinct steps, evenly spread (the first and last kept)."""
    steps = sorted({r["step"] for r in samples})
    if len(steps) <= max_points:
        return list(samples)
    keep = {steps[round(i * (len(steps) - 1) / (max_points - 1))] for i in range(max_points)}
    return [r for r in samples if r["step"] in keep]


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


def held_out_split(rows: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded shuffle, at least one held-out row once there are 4 and a
    fraction is asked for, never all of them."""
    idx = list(range(len(rows)))
    random.Random(seed).shuffle(idx)
    n_eval = int(round(len(rows) * eval_fraction))
    if eval_fraction > 0 and len(rows) >= 4:
        n_eval = max(1, n_eval)
    n_eval = min(n_eval, len(rows) - 1)
    return [rows[i] for i in idx[n_eval:]], [rows[i] for i in idx[:n_eval]]


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


def prepare_data(s: SFTSettings, tokenizer):
    """-> (train EncodedData, eval EncodedData | None, held-out accuracy items, dataset description)."""
    train, ev, test, _samples, desc = _prepare_run_data(s, tokenizer)
    return train, ev, test, desc


def _prepare_run_data(s: SFTSettings, tokenizer):
    """prepare_data plus the prompts sampled during training: the first `sample_prompts` held-out items
    (built-in task: its held-out questions, with answers; uploads: the eval split's conversations up
    to their last assistant turn, whose text is the expected answer). Never trained on."""
    n_samples = s.sample_prompts if s.sample_every != 0 else 0
    if s.dataset == BUILTIN:
        convs, held = builtin_dataset(s.builtin_train_size, max(s.accuracy_examples, n_samples), s.seed)
        desc = {"source": BUILTIN, "task": BUILTIN_TASK, "size": len(convs)}
    else:
        convs = load_jsonl(s.dataset)
        held = None
        desc = {"source": "upload", "file": Path(s.dataset).name, "size": len(convs)}
    train_c, eval_c = held_out_split(convs, s.eval_fraction, s.seed)
    if held is None:
        held = heldout_from_convs(eval_c)
    train = encode_dataset(tokenizer, train_c, s.max_length)
    ev = encode_dataset(tokenizer, eval_c, s.max_length) if eval_c else None
    return train, ev, held[: s.accuracy_examples], held[:n_samples], desc


def run_sft(settings: SFTSettings | dict, progress: ProgressFn | None = None,
            should_stop: Callable[[], bool] | None = None, log: Callable[[str], None] | None = None,
            tensorboard_dir: str | os.PathLike | None = None) -> SFTResult:
    """Fine-tune and register. progress(dict) gets {phase, step, max_steps, epoch, loss, eval_loss,
    tokens_per_s, lr, eta_s, elapsed_s, tokens_seen}; should_stop() is polled between steps (cancel ->
    SFTCancelled, nothing registered); NaN/inf loss -> SFTError. Returns the registered model.
    tensorboard_dir: also write TensorBoard event files there (see tensorboard_callback).

    Samples (sample_every, sample_prompts): at step 0, every sample_every steps and the last step,
    greedy completions of held-out prompts (sample_generations) go to progress as {phase: "samples",
    step, max_steps, samples: [{step, index, prompt, completion, expected, correct}]}; all of them are
    in the result and in lmscope.json (thinned to MAX_SAMPLE_STEPS points).
    Checkpoints (keep_checkpoints = N): the model at N evenly spaced steps (checkpoint_steps) is
    saved beside the final model's staging folder (LoRA merged in a copy) and, only when the run
    succeeds, registered as '<name>-step<S>' with lmscope.json {parent, checkpoint_of, step, ...};
    a cancelled or failed run removes them with its staging folder."""
    from transformers import Trainer, TrainingArguments, set_seed
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    s = validate_settings(settings)
    say = log or (lambda m: None)
    emit = progress or (lambda d: None)
    stop = should_stop or (lambda: False)
    name = s.output_name or default_output_name(s.model, method=s.method)
    final = paths.finetuned_dir() / name
    if final.exists() and not s.overwrite:
        raise SFTError(f"A model named '{name}' already exists; choose another output name.")
    if name in builtin_names():
        raise SFTError(f"'{name}' is a built-in model name; choose another output name.")
    sweep_staging()
    staging = staging_dir(name)
    t_start = time.time()
    tb = None
    ckpts: dict[int, dict] = {}  # step -> {dir (staging), train_seconds, created}
    try:
        emit({"phase": "loading model", "step": 0})
        set_seed(s.seed)
        try:
            model, tok, dev = load_trainable(s.model, s.device)
        except torch.cuda.OutOfMemoryError:
            raise SFTError(f"Model '{s.model}' does not fit in GPU memory.") from None
        added_template = ensure_chat_template(tok)
        if added_template:
            say("the tokenizer has no chat template; using lmscope's simple 'role: content<eos>' template")
        train, ev, test, sample_items, desc = _prepare_run_data(s, tok)
        say(f"data: {train.total} train examples ({train.truncated} truncated, {train.dropped} dropped at "
            f"max_length {s.max_length}), {ev.total if ev else 0} eval, {len(test)} held-out prompts; "
            f"{train.trained_tokens} of {train.tokens} train tokens count in the loss")
        if stop():
            raise SFTCancelled()
        n_params = sum(p.numel() for p in model.parameters())
        main = data_parallel.is_main_process()  # with several GPUs, the one process that evaluates and saves
        per_process = data_parallel.per_process_batch(s.batch_size)
        acc_before = None
        if test and main:
            emit({"phase": "accuracy before", "step": 0})
            acc_before = evaluate_accuracy(model, tok, test, should_stop=stop)
            say(f"held-out accuracy before: {acc_before['correct']}/{acc_before['n']}")
        if s.method == "lora":
            model = apply_lora(model, s.lora_rank, s.lora_alpha, s.seed)
        total, trainable = count_params(model)
        steps_per_epoch = math.ceil(len(train.examples) / s.batch_size)
        max_steps = s.max_steps or max(1, math.ceil(steps_per_epoch * s.epochs))
        eval_every = s.eval_every or max(1, max_steps // 5)
        say(f"training {s.method} ({trainable:,} of {total:,} parameters trainable) for {max_steps} steps, "
            f"batch {s.batch_size}, lr {s.lr():g}, on {dev}")

        s_steps = set(sample_steps(max_steps, s.sample_every, len(sample_items)))
        n_new = sample_max_new_tokens(tok, sample_items) if s_steps else SAMPLE_MAX_NEW_TOKENS
        sampling = {"steps": sorted(s_steps), "prompts": len(sample_items) if s_steps else 0,
                    "max_new_tokens": n_new}
        if s.sample_every != 0 and s.sample_prompts and not sample_items:
            say("no held-out prompts to sample during training (the eval split is empty)")
        elif s_steps:
            say(f"sampling {len(sample_items)} held-out prompt(s) greedily at steps "
                f"{', '.join(map(str, sorted(s_steps)))}")
        c_steps = checkpoint_steps(max_steps, s.keep_checkpoints)
        if s.keep_checkpoints and len(c_steps) < s.keep_checkpoints:
            say(f"{max_steps} steps leave room for {len(c_steps)} intermediate checkpoint(s), not {s.keep_checkpoints}")
        if c_steps and len(checkpoint_name(name, c_steps[-1])) > 100:
            raise SFTError(f"The name '{name}' is too long to also name its checkpoints '<name>-step<S>' (max 100 "
                           "characters); shorten it or keep no checkpoints.")
        for st in c_steps:
            cname = checkpoint_name(name, st)
            if (paths.finetuned_dir() / cname).exists() and not s.overwrite:
                raise SFTError(f"A model named '{cname}' already exists (this run's checkpoint at step {st} would "
                               "take that name); choose another output name.")
            if cname in builtin_names():
                raise SFTError(f"'{cname}' is a built-in model name; choose another output name.")
        if c_steps:
            say(f"keeping checkpoints at steps {', '.join(map(str, c_steps))} (registered when the run succeeds)")
        samples: list[dict] = []
        timing = {"sample_seconds": 0.0, "checkpoint_seconds": 0.0}
        train_model = model

        def at_step(step: int) -> None:
            if step in s_steps:
                t0 = time.time()
                rows = sample_generations(train_model, tok, sample_items, step, n_new, should_stop=stop)
                samples.extend(rows)
                timing["sample_seconds"] += time.time() - t0
                emit({"phase": "samples", "step": step, "max_steps": max_steps, "samples": rows})
            if step in c_steps:
                t0 = time.time()
                d = staging_dir(checkpoint_name(name, step))
                ckpts[step] = {"dir": d, "train_seconds": cb.train_time, "created": time.time()}
                save_plain(train_model, tok, d)
                timing["checkpoint_seconds"] += time.time() - t0
                say(f"checkpoint at step {step} kept (registered as '{checkpoint_name(name, step)}' when the run "
                    "succeeds)")

        cb = _Callback(emit, stop, max_steps, t_start, at_step if (s_steps or c_steps) and main else None)
        use_cuda = dev.type == "cuda"
        speed, speed_notes = train_speed.speed_options(model, dev, s.torch_compile)
        for note in speed_notes:
            say(note)
        args = data_parallel.one_gpu_each(TrainingArguments(
            output_dir=str(staging / "trainer"), max_steps=max_steps, per_device_train_batch_size=per_process,
            per_device_eval_batch_size=per_process, learning_rate=s.lr(), lr_scheduler_type="linear",
            warmup_steps=s.warmup_steps, weight_decay=0.0, max_grad_norm=1.0, seed=s.seed, data_seed=s.seed,
            logging_steps=1, logging_nan_inf_filter=False, save_strategy="no", report_to="none",
            eval_strategy="steps" if ev else "no", eval_steps=eval_every if ev else None,
            disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
            use_cpu=not use_cuda, bf16=use_cuda and torch.cuda.is_bf16_supported(),
            include_num_input_tokens_seen="non_padding", optim="adamw_torch_fused" if use_cuda else "adamw_torch",
            **speed,
        ))
        trainer = Trainer(model=model, args=args, train_dataset=_ListDataset(train.examples),
                          eval_dataset=_ListDataset(ev.examples) if ev else None,
                          data_collator=Collator(tok.pad_token_id), callbacks=[cb])
        if tensorboard_dir is not None and (tb := tensorboard_callback(tensorboard_dir, s, say)) is not None:
            trainer.add_callback(tb)
        for c in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(c)
        train_checked(trainer, cb, stop, SFTError, SFTCancelled)
        model = trainer.model
        del trainer
        if not main:
            return None
        if s.method == "lora":
            model = model.merge_and_unload()
        model.eval()
        acc_after = None
        if test:
            emit({"phase": "accuracy after", "step": max_steps})
            acc_after = evaluate_accuracy(model, tok, test, should_stop=stop)
            say(f"held-out accuracy after: {acc_after['correct']}/{acc_after['n']}")
        if stop():
            raise SFTCancelled()
        emit({"phase": "saving", "step": max_steps})
        ckpt_list = [{"name": checkpoint_name(name, st), "step": st} for st in sorted(ckpts)]
        info = {
            "parent": s.model, "parameters": n_params, "training": s.to_json(), "dataset": desc,
            "data": {"train": train.stats(), "eval": ev.stats() if ev else None},
            "accuracy_before": acc_before, "accuracy_after": acc_after,
            "metrics": {**cb.summary(n_params), **{k: round(v, 2) for k, v in timing.items()}},
            "history": cb.history, "samples": thin_samples(samples), "sampling": sampling,
            "checkpoints": ckpt_list, "chat_template_added": added_template, "created": time.time(),
        }
        staging.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging / "trainer", ignore_errors=True)
        model.to("cpu").save_pretrained(staging, safe_serialization=True)
        tok.save_pretrained(staging)
        (staging / "lmscope.json").write_text(json.dumps(info, indent=1))
        for st, c in ckpts.items():
            c_info = {**info, "checkpoint_of": name, "step": st, "max_steps": max_steps, "accuracy_after": None,
                      "metrics": cb.summary(n_params, upto=st, train_time=c["train_seconds"]),
                      "history": [r for r in cb.history if r["step"] <= st],
                      "samples": [r for r in samples if r["step"] == st], "checkpoints": [],
                      "created": c["created"]}
            (c["dir"] / "lmscope.json").write_text(json.dumps(c_info, indent=1))
        if stop():
            raise SFTCancelled()
        root = paths.finetuned_dir()
        if s.overwrite:
            _remove_checkpoints_of(name)
            for c in ckpt_list:
                shutil.rmtree(root / c["name"], ignore_errors=True)
        for c in ckpt_list:
            if (root / c["name"]).exists():
                raise SFTError(f"A model named '{c['name']}' appeared while this run trained; choose another "
                               "output name.")
        if final.exists() and s.overwrite:
            shutil.rmtree(final)
        registered: list[Path] = []
        try:  # checkpoints first, the final model last: a run's models all appear, or none do
            for st in sorted(ckpts):
                target = root / checkpoint_name(name, st)
                os.rename(ckpts[st]["dir"], target)
                registered.append(target)
            os.rename(staging, final)  # atomic on one filesystem: the model appears complete or not at all
        except BaseException:
            for target in registered:
                shutil.rmtree(target, ignore_errors=True)
            raise
        for c in ckpt_list:
            say(f"registered checkpoint '{c['name']}' (step {c['step']})")
        say(f"registered model '{name}' at {final}")
        emit({"phase": "done", "step": max_steps})
        return SFTResult(name=name, path=final, info=info, history=cb.history, samples=samples,
                         checkpoints=[{**c, "path": root / c["name"]} for c in ckpt_list])
    finally:
        if tb is not None and tb.tb_writer is not None:  # a run that raised never reached on_train_end
            tb.tb_writer.close()
        shutil.rmtree(staging, ignore_errors=True)
        for c in ckpts.values():
            shutil.rmtree(c["dir"], ignore_errors=True)


def run_sft_on_gpus(settings: SFTSettings | dict, progress: ProgressFn | None = None,
                    should_stop: Callable[[], bool] | None = None, log: Callable[[str], None] | None = None,
                    tensorboard_dir: str | os.PathLike | None = None, processes: int | None = None) -> SFTResult:
    """run_sft on every GPU of the machine, one process each, or in this process with fewer than two
    GPUs (data_parallel.train). The step's batch_size is the whole step's either way."""
    return data_parallel.train("model_core.training.sft:run_sft", asdict(validate_settings(settings)),
                               kwargs={"tensorboard_dir": str(tensorboard_dir) if tensorboard_dir else None},
                               processes=processes, progress=progress, should_stop=should_stop, log=log,
                               error_cls=SFTError)


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
    from transformers.integrations import TensorBoardCallback

    settings = s.to_json()
    if settings.get("dataset") not in (None, BUILTIN):
        settings["dataset"] = Path(settings["dataset"]).name

    class _TensorBoard(TensorBoardCallback):
        def on_train_begin(self, args, state, control, **kw):
            if self.tb_writer is not None:
                text = json.dumps(settings, indent=1).replace("\n", "\n    ")  # indented: a code block
                self.tb_writer.add_text("lmscope/settings", "    " + text)

    return _TensorBoard(tb_writer=SummaryWriter(log_dir=str(log_dir)))


def _remove_checkpoints_of(name: str) -> None:
    """Remove registered checkpoints of an earlier run named `name` (an overwrite replaces the run)."""
    for d in paths.finetuned_dir().iterdir():
        try:
            info = json.loads((d / "lmscope.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("checkpoint_of") == name:
            shutil.rmtree(d, ignore_errors=True)


class _Callback:
    """Trainer callback: progress rows, cancel between steps, stop on a non-finite loss. `at_step(step)`
    (optional) runs at step 0 (train begin) and after every optimizer step that was not cancelled,
    outside the measured training time (samples, checkpoints)."""

    def __new__(cls, *a, **k):
        from transformers import TrainerCallback

        class Impl(TrainerCallback):
            def __init__(self, emit, stop, max_steps, t_start, at_step=None):
                self.emit, self.stop, self.max_steps, self.t_start = emit, stop, max_steps, t_start
                self.at_step = at_step
                self.history: list[dict] = []
                self.nan_step = None
                self.cancelled = False
                self.train_time = 0.0
                self.t_last = None
                self.t_train0 = None
                self.last_eval = None

            def on_train_begin(self, args, state, control, **kw):
                if self.at_step is not None:
                    self.at_step(0)
                self.t_last = self.t_train0 = time.time()

            def on_step_end(self, args, state, control, **kw):
                now = time.time()
                self.train_time += now - self.t_last
                self.t_last = now
                if data_parallel.agreed(self.stop()):  # every process stops after the same step
                    self.cancelled = True
                    control.should_training_stop = True
                    control.should_evaluate = False
                    control.should_log = False
                    return
                if self.at_step is not None:
                    self.at_step(state.global_step)
                    self.t_last = time.time()

            def _row(self, state, **extra):
                step = state.global_step
                elapsed = time.time() - self.t_train0
                eta = elapsed / step * (self.max_steps - step) if step else None
                toks = state.num_input_tokens_seen or 0
                return {"phase": "training", "step": step, "max_steps": self.max_steps,
                        "epoch": round(state.epoch or 0.0, 4), "tokens_seen": int(toks),
                        "tokens_per_s": toks / self.train_time if self.train_time > 0 else None,
                        "elapsed_s": round(time.time() - self.t_start, 2),
                        "eta_s": round(eta, 1) if eta is not None else None, **extra}

            def on_log(self, args, state, control, logs=None, **kw):
                logs = logs or {}
                if "loss" in logs:
                    loss = float(logs["loss"])
                    row = self._row(state, loss=loss, lr=logs.get("learning_rate"), eval_loss=None,
                                    grad_norm=logs.get("grad_norm"))
                    self.history.append(row)
                    self.emit(row)
                    if not math.isfinite(loss):
                        self.nan_step = state.global_step
                        control.should_training_stop = True
                        control.should_evaluate = False
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

            def summary(self, n_params, upto: int | None = None, train_time: float | None = None):
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

        return Impl(*a, **k)


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
