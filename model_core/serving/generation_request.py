"""What a generation is asked for (`GenerateRequest`), the check of each setting (one sentence
for a bad one), and the checked request under way (`GenerationRun`, made by `start_run`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from model_core.core import settings
from model_core.core.errors import PromptError, SettingsError
from model_core.core.sampling import SamplingSettings
from model_core.serving.generation_records import TOP_K_RECORDED, Generation, recorded_stages
from model_core.serving.model_forward import eos_ids
from model_core.serving.text_so_far import TextSoFar

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 200

ShouldStop = Callable[[], bool] | threading.Event | None


def max_new_tokens_cap() -> int:
    """Server-side ceiling on max_new_tokens: LMSCOPE_MAX_NEW_TOKENS (default 256)."""
    return settings.current().max_new_tokens


def check_max_new_tokens(n) -> int:
    cap = max_new_tokens_cap()
    if isinstance(n, bool) or n is None:
        raise SettingsError(f"max_new_tokens must be a whole number between 1 and {cap}, got {n!r}.")
    try:
        f = float(n)
    except (TypeError, ValueError):
        raise SettingsError(f"max_new_tokens must be a whole number between 1 and {cap}, got {n!r}.") from None
    if not math.isfinite(f) or f != int(f):
        raise SettingsError(f"max_new_tokens must be a whole number between 1 and {cap}, got {n!r}.")
    n = int(f)
    if n < 1:
        raise SettingsError(f"max_new_tokens must be at least 1 (got {n}): ask for one or more new tokens.")
    if n > cap:
        raise SettingsError(f"max_new_tokens is capped at {cap} on this server (got {n}); ask for fewer tokens.")
    return n


def check_seed(seed) -> int:
    if seed is None or seed == "":
        return 0
    try:
        f = float(seed)
    except (TypeError, ValueError):
        raise SettingsError(f"seed must be a whole number, got {seed!r}.") from None
    if isinstance(seed, bool) or not math.isfinite(f) or f != int(f) or not (0 <= int(f) < 2**63):
        raise SettingsError(f"seed must be a whole number between 0 and 2^63-1, got {seed!r}.")
    return int(f)


def check_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    out = []
    for s in stop:
        if not isinstance(s, str):
            raise SettingsError(f"Stop strings must be text, got {s!r}.")
        if s == "":
            continue
        if len(s) > MAX_STOP_CHARS:
            raise SettingsError(f"A stop string may be at most {MAX_STOP_CHARS} characters long.")
        out.append(s)
    if len(out) > MAX_STOP_STRINGS:
        raise SettingsError(f"At most {MAX_STOP_STRINGS} stop strings are allowed (got {len(out)}).")
    return out


def _stopper(should_stop: ShouldStop) -> Callable[[], bool]:
    if should_stop is None:
        return lambda: False
    if isinstance(should_stop, threading.Event):
        return should_stop.is_set
    if callable(should_stop):
        return lambda: bool(should_stop())
    raise SettingsError("should_stop must be a threading.Event or a function returning True to stop.")


@dataclass(frozen=True)
class GenerateRequest:
    """What iter_generate / generate are asked for, besides the model: what to continue, how to
    draw, when to stop and what to record. Every field is checked when the generation starts."""
    prompt: str | None = None
    token_ids: Sequence[int] | torch.Tensor | None = None  # instead of a prompt: these ids as they are
    chat: bool = False  # wrap the prompt in the model's chat template
    max_prompt_tokens: int | None = 1024
    truncate: bool = False  # a longer prompt keeps its end instead of being refused
    max_new_tokens: int = 32
    settings: SamplingSettings | None = None  # None: greedy (temperature <= 0 is greedy too)
    seed: int | None = 0  # the seeded draw's seed: same seed, same sample
    stop: Sequence[str] | str | None = None  # strings that end generation once they appear (cut from text)
    eos_token_id: int | Sequence[int] | None = None  # default: the generation config's and tokenizer's EOS
    ignore_eos: bool = False  # never stop early (benchmarks)
    should_stop: ShouldStop = None  # threading.Event or callable, checked before every step
    attention: bool = False  # at the end, each step's attention over its context ([layers, context])
    keep_logits: bool = False  # each Step keeps its raw logits [V]
    keep_probs: bool = False  # and the distribution it was drawn from [V]
    top_k_recorded: int = TOP_K_RECORDED
    # {hook name: fn(name, tensor) -> tensor} active in every forward of this generation (steering,
    # clamps, ablations). Typed ones (model_core.core.row_edits) run per row on the shared engine;
    # any other function runs the request on its own forwards.
    edits: dict | None = None


@dataclass
class GenerationRun:
    """A checked request under way: the Generation it fills and what ends it."""
    req: GenerateRequest
    gen: Generation
    n_steps: int  # max_new_tokens, within the room the context leaves
    eos: set[int]
    k: int  # candidates recorded per step
    stopped: Callable[[], bool]
    text: TextSoFar  # the continuation's text, decoded as it grows
    stages: tuple  # recorded_stages(settings): which removed counts the records carry
    started: float = field(default_factory=time.perf_counter)


def start_run(lm, req: GenerateRequest) -> GenerationRun:
    """Check every setting (one sentence for a bad one), encode the prompt, make the Generation."""
    from model_core.interp.trace import encode_prompt

    max_new = check_max_new_tokens(req.max_new_tokens)
    settings = SamplingSettings(temperature=0.0) if req.settings is None else req.settings
    if not isinstance(settings, SamplingSettings):
        raise SettingsError("settings must be a SamplingSettings.")
    settings = settings.validated()
    seed, stop, stopped = check_seed(req.seed), check_stop(req.stop), _stopper(req.should_stop)
    if req.token_ids is not None:
        t = req.token_ids
        ids = [int(i) for i in (t.tolist() if torch.is_tensor(t) else t)]
        if not ids:
            raise PromptError("The prompt has no tokens.")
        vocab = lm.shape.vocab_size
        if any(i < 0 or i >= vocab for i in ids):
            raise PromptError(f"Token ids must be between 0 and {vocab - 1}.")
    else:
        ids = encode_prompt(lm, req.prompt, chat=req.chat, max_tokens=req.max_prompt_tokens, truncate=req.truncate)
    if len(ids) >= lm.shape.context_length:
        raise PromptError(f"The prompt fills the model's whole context ({lm.shape.context_length} tokens).")
    e = req.eos_token_id
    eos = set(eos_ids(lm)) if e is None else {int(x) for x in (e if isinstance(e, (list, tuple, set)) else [e])}
    gen = Generation(model_name=lm.name, prompt=req.prompt, chat=req.chat, settings=settings, seed=seed,
                     max_new_tokens=max_new, stop=stop, prompt_ids=list(ids))
    return GenerationRun(req=req, gen=gen, n_steps=min(max_new, lm.shape.context_length - len(ids)),
                         eos=set() if req.ignore_eos else eos, k=max(1, min(int(req.top_k_recorded), lm.shape.vocab_size)),
                         stopped=stopped, text=TextSoFar(lm.tokenizer), stages=recorded_stages(settings))
