"""Fine-tuning's settings, errors and names: SFTSettings and its checks (validate_settings, one
sentence per bad value; setting_number is shared with pretraining), the errors a run raises, the
default output name, and the MFU formula the run's metrics and the bench use. Re-exported by
model_core.training.sft, the module callers import."""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from model_core.core.checkpoints import checkpoint_name, valid_output_name
from model_core.core.errors import LmscopeError, SettingsError

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
MAX_LOADER_WORKERS = 16


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
    # a step's examples packed into rows of max_length tokens without padding (PackingCollator). Off by
    # default: on the built-in data (examples of similar length) it measured 0.91x of padded batches on
    # an H200 (a masked attention kernel instead of flash) and 0.88x on the CPU
    packing: bool = False
    # processes that build the batches beside the training loop; None: loader_workers() decides by device
    loader_workers: int | None = None
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
                                          "eval_every", "device", "sample_every", "loader_workers"):
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
        packing=str(d.get("packing")).strip().lower() in ("true", "1", "yes", "on"),
        loader_workers=setting_number(d, "loader_workers", int, 0, MAX_LOADER_WORKERS, allow_none=True),
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


def loader_workers(s: SFTSettings, use_cuda: bool) -> int:
    """How many processes build a run's batches beside its training loop: the setting, else 2 on a
    GPU, where fetching and collating 512 examples otherwise sits between the steps (0.75-0.82 of the
    bench's step without them on an H200, docs/PERFORMANCE.md), and none on a CPU, where they would
    take the cores the step runs on."""
    if s.loader_workers is not None:
        return s.loader_workers
    return 2 if use_cuda else 0


def default_output_name(model: str, suffix: str | None = None, method: str = "full") -> str:
    """'<model>-sft-full-<suffix>' or '<model>-sft-lora-<suffix>': a run's name says how it was trained."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model).name).strip("-.") or "model"
    kind = "lora" if method == "lora" else "full"
    return f"{base[:60]}-sft-{kind}-{suffix or time.strftime('%Y%m%d-%H%M%S')}"

