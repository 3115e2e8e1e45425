"""Token-by-token generation with the Hugging Face KV cache, recording every step.

One step = one forward pass of the newest token through the model with the KV cache
(`DynamicCache`), then the sampling pipeline of `model_core.core.sampling` (repetition penalty,
temperature, top-k, top-p, min-p: the same stage functions, hence the same arithmetic, as
transformers' logits processors), then a greedy pick or a seeded draw.

Per step we keep: the top candidates before the filters (the model's own softmax) and after
them (the distribution the token was drawn from), which filter removed each of those top
candidates, how many tokens and how much probability mass each filter removed, the chosen
token with its rank and probability, and the entropy before and after. All of it is gathered
on the device and copied to the host once per step (one small tensor), so recording is cheap.

Entry points:
  generate(lm, prompt, ...)          -> Generation (all steps); settings: GenerateRequest's fields
  iter_generate(lm, prompt, ...)     -> yields (Step, Generation) as each token is produced
  generation_to_json(lm, gen)        -> dict for the CLI / API
  step_attention(lm, token_ids, pos) -> the attention of one query over its context, per layer
  kv_cache_report(lm, cache)         -> formula vs measured KV-cache bytes, per layer
  time_cache_vs_no_cache(lm, ids)    -> measured decode time with and without the cache
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field, replace
from functools import cached_property, partial

import torch

from model_core.core import sampling as S
from model_core.core import settings
from model_core.core.adapters import kv_cache_bytes
from model_core.core.cache_api import cache_kwarg, new_cache
from model_core.core.errors import PromptError, SettingsError
from model_core.core.sampling import SamplingSettings
from model_core.serving.batch_sampling import counter_uniform

TOP_K_RECORDED = 10  # candidates kept per step, before and after the filters
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 200
FILTER_STAGES = ("top_k", "top_p", "min_p")  # the stages that remove tokens (greedy: "greedy")

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


# ---------------------------------------------------------------------------------------------
# Records

# The fields of a step's packed record (`_unpack`), read from it the first time one is asked for:
# unpacked eagerly, 32 users' records took 15% of the interpreter on the engine thread
# (docs/PERFORMANCE.md), and most consumers read a few steps' fields, not every step's.
_RECORD_FIELDS = (
    "chosen_prob",  # float: the model's probability for the chosen token (softmax of the raw logits)
    "chosen_prob_filtered",  # float: probability under the distribution it was drawn from
    "chosen_rank",  # int: 1 = the model's top choice (rank among the raw logits)
    "entropy",  # float: nats, of the model's raw distribution
    "entropy_filtered",  # float: nats, of the distribution after the filters
    "top_ids",  # list[int]: top candidates before the filters (raw softmax)
    "top_probs",  # list[float]
    "top_removed_by",  # list[str | None]: which stage removed each of those candidates (None = kept)
    "after_ids",  # list[int]: top candidates after the filters
    "after_probs",  # list[float]
    "removed",  # dict: stage -> {"n_removed": int, "kept_mass": float}
    "n_candidates",  # int: tokens left with nonzero probability after the filters
)


@dataclass(eq=False)
class Step:
    """One generated token and its record. The record's fields (_RECORD_FIELDS: chosen_prob, top_ids,
    removed, ...) read like attributes and are unpacked from `record` when one is first read."""
    index: int  # 0-based step number
    position: int  # position of the chosen token in the full sequence
    chosen_id: int
    seconds: float  # wall time of this step (forward + sampling + recording)
    text_so_far: str = ""  # decoded continuation after this step
    attention: torch.Tensor | None = None  # [layers, context] head-mean, on request
    logits: torch.Tensor | None = None  # [V] raw logits, on request (tests, research)
    probs: torch.Tensor | None = None  # [V] filtered distribution, on request
    record: list[float] = field(default_factory=list, repr=False)  # sample_step's packed layout
    k: int = 0  # candidates recorded before and after the filters
    stages: tuple = field(default=(), repr=False)  # recorded_stages of the settings it was drawn with

    @cached_property
    def _fields(self) -> dict:
        return _unpack(self.record, self.k, None, self.stages)

    def __repr__(self) -> str:
        return (f"Step(index={self.index}, chosen_id={self.chosen_id}, chosen_prob={self.chosen_prob:.4g}, "
                f"chosen_rank={self.chosen_rank}, text_so_far={self.text_so_far!r})")


for _name in _RECORD_FIELDS:
    setattr(Step, _name, property(lambda self, _n=_name: self._fields[_n]))


@dataclass
class Generation:
    model_name: str
    prompt: str | None
    chat: bool
    settings: SamplingSettings
    seed: int
    max_new_tokens: int
    stop: list[str]
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids (EOS included if produced)
    steps: list[Step] = field(default_factory=list)
    text: str = ""  # the continuation (special tokens skipped, cut before a stop string)
    finish_reason: str | None = None  # "length" | "eos" | "stop_string" | "cancelled" | "context_full"
    stop_string: str | None = None
    prefill_seconds: float = 0.0
    seconds: float = 0.0
    kv_cache: dict | None = None  # kv_cache_report at the end
    kv_series: list[tuple[int, int]] = field(default_factory=list)  # (tokens cached, measured bytes) per step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens_per_second(self) -> float:
        decode = sum(s.seconds for s in self.steps)
        return len(self.steps) / decode if decode > 0 else 0.0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids


# ---------------------------------------------------------------------------------------------
# Model plumbing (public transformers APIs only; works on transformers 5.17 and newer)

def _forward(lm, ids: torch.Tensor, cache) -> torch.Tensor:
    """ids [1, t] -> logits of the last position [V] (float32); the cache grows by t."""
    out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(lm.model): cache})
    return out.logits[0, -1].float()


def eos_ids(lm) -> list[int]:
    ids: list[int] = []
    gc = getattr(lm.model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(lm.tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        for i in (src if isinstance(src, (list, tuple)) else [src]):
            if int(i) not in ids:
                ids.append(int(i))
    return ids


# ---------------------------------------------------------------------------------------------
# One step of sampling + recording, all on the device

_STAGE_CODES = {None: 0, "top_k": 1, "top_p": 2, "min_p": 3, "greedy": 4}
_CODE_STAGES = {v: k for k, v in _STAGE_CODES.items()}


def sample_step(logits: torch.Tensor, settings: SamplingSettings, context_ids: torch.Tensor | None,
                draw: tuple[int, int], k: int = TOP_K_RECORDED):
    """logits [V] float32 on the device -> (chosen id tensor [1], packed record tensor, final logits).

    The stages are sampling.py's functions (the arithmetic of transformers' processors), in
    generate()'s order. Everything recorded is packed in one float32 tensor so the caller copies
    once per step. Ids are exact in float32 up to 2^24 (16.7M-token vocabularies)."""
    raw = logits
    cur = S.repetition_penalty(raw, context_ids, settings.repetition_penalty)
    # Per filter: (code, logits before, logits after). What it removed is derived cheaply: the
    # kept mass is exp(logsumexp(after) - logsumexp(before)), the count is the drop in finite
    # logits, and "which of the top candidates" is a gather of 2 x k values.
    filters: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def filt(name, new):
        nonlocal cur
        filters.append((_STAGE_CODES[name], cur, new))
        cur = new

    if settings.greedy:
        keep = torch.zeros_like(cur, dtype=torch.bool)
        keep[torch.argmax(cur)] = True
        filt("greedy", cur.masked_fill(~keep, S.FILTER_VALUE))
    else:
        cur = S.temperature(cur, settings.temperature)
        if settings.top_k > 0:
            filt("top_k", S.top_k(cur, settings.top_k))
        if settings.top_p < 1.0:
            filt("top_p", S.top_p(cur, settings.top_p))
        if settings.min_p > 0:
            filt("min_p", S.min_p(cur, settings.min_p))
    probs = torch.softmax(cur, -1)
    if settings.greedy:
        chosen = torch.argmax(cur).reshape(1)
    else:
        # the engine's draw (row_sampling): Gumbel-max over uniforms hashed from (seed, step, token),
        # so a seed draws the same tokens on either path, alone or batched
        seed, step = (torch.tensor([v], device=cur.device) for v in draw)
        u = counter_uniform(seed, step, cur.shape[-1])[0]
        chosen = torch.argmax(cur - torch.log(-torch.log(u))).reshape(1)

    base = torch.softmax(raw, -1)
    k = min(k, raw.numel())
    top_p_, top_i = torch.topk(base, k)
    aft_p, aft_i = torch.topk(probs, k)
    zero = torch.zeros((), device=raw.device)
    removed_by = torch.zeros(k, device=raw.device)
    for code, before, after in reversed(filters):  # the earliest stage that removed a candidate wins
        gone = torch.isneginf(after[top_i]) & ~torch.isneginf(before[top_i])
        removed_by = torch.where(gone, torch.full_like(removed_by, code), removed_by)
    # Each filter's input is the previous one's output: one count and one logsumexp per link of
    # the chain (plain lists, no memo keyed on object ids, so torch.compile can trace it).
    chain = [filters[0][1], *(f[2] for f in filters)] if filters else [cur]
    finite = [(t > S.FILTER_VALUE).sum().float() for t in chain]
    lses = [torch.logsumexp(t, -1) for t in chain]
    n_removed = {code: finite[j] - finite[j + 1] for j, (code, _, _) in enumerate(filters)}
    kept = {code: torch.exp(lses[j + 1] - lses[j]) for j, (code, _, _) in enumerate(filters)}
    n_removed_l = [n_removed.get(c, zero) for c in (1, 2, 3, 4)]
    kept_l = [kept.get(c, zero + 1) for c in (1, 2, 3, 4)]
    raw_c = raw[chosen]
    rank = (raw > raw_c).sum().float() + 1
    lse_raw = torch.logsumexp(raw, -1)
    lse_cur = lses[-1] if filters else torch.logsumexp(cur, -1)
    head = torch.stack([
        chosen[0].float(), rank, base[chosen][0], probs[chosen][0],
        # entropy H = logsumexp(x) - sum(p * x) (cheaper than summing -p log p over the vocabulary)
        lse_raw - (base * raw).sum(), lse_cur - (probs * cur.nan_to_num(neginf=0.0)).sum(),
        (probs > 0).sum().float(),
        *n_removed_l, *kept_l,
    ])
    packed = torch.cat([head, top_i.float(), top_p_, removed_by, aft_i.float(), aft_p])
    return chosen, packed, cur


def recorded_stages(settings: SamplingSettings) -> tuple[tuple[int, str], ...]:
    """(slot in the record's removed-counts, stage name) for each filter these settings apply."""
    if settings.greedy:
        return ((3, "greedy"),)
    on = (settings.top_k > 0, settings.top_p < 1, settings.min_p > 0)
    return tuple((j, name) for j, (name, used) in enumerate(zip(("top_k", "top_p", "min_p"), on)) if used)


def _unpack(packed, k: int, settings: SamplingSettings, stages: tuple | None = None) -> dict:
    """A packed record (tensor or list, `sample_step` / `row_sampling.sample_rows` layout) -> Step fields.
    Runs when a Step's record field is first read (stages: precomputed, as Steps carry them)."""
    v = packed.tolist() if torch.is_tensor(packed) else packed
    stages = recorded_stages(settings) if stages is None else stages
    a, b, c, d, e = 15, 15 + k, 15 + 2 * k, 15 + 3 * k, 15 + 4 * k  # top ids, top probs, codes, after ids, after probs
    return dict(
        chosen_id=int(v[0]), chosen_rank=int(v[1]), chosen_prob=float(v[2]),
        chosen_prob_filtered=float(v[3]), entropy=float(v[4]), entropy_filtered=float(v[5]),
        n_candidates=int(v[6]),
        removed={name: {"n_removed": int(v[7 + j]), "kept_mass": float(v[11 + j])} for j, name in stages},
        top_ids=list(map(int, v[a:b])), top_probs=v[b:c],
        top_removed_by=[_CODE_STAGES[int(x)] for x in v[c:d]],
        after_ids=list(map(int, v[d:e])), after_probs=v[e:e + k],
    )


# ---------------------------------------------------------------------------------------------
# Generation: a request, two backends (the engine, or the request's own forwards) and one loop

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
    # ablations); such a request runs on its own forwards, never on the shared engine.
    edits: dict | None = None


def _request(prompt: str | None, request: GenerateRequest | None, options: dict) -> GenerateRequest:
    """The request from iter_generate's / generate's arguments: `request` (or the defaults) with the
    prompt and any GenerateRequest field given as a keyword put in (TypeError for an unknown one)."""
    if prompt is not None:
        options["prompt"] = prompt
    return replace(request or GenerateRequest(), **options)


@dataclass
class _Run:
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


def _start(lm, req: GenerateRequest) -> _Run:
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
    return _Run(req=req, gen=gen, n_steps=min(max_new, lm.shape.context_length - len(ids)),
                eos=set() if req.ignore_eos else eos, k=max(1, min(int(req.top_k_recorded), lm.shape.vocab_size)),
                stopped=stopped, text=TextSoFar(lm.tokenizer), stages=recorded_stages(settings))


def iter_generate(lm, prompt: str | None = None, *, request: GenerateRequest | None = None,
                  **options) -> Iterator[tuple[Step, Generation]]:
    """Stream a generation: yields (step, generation) right after each token is produced;
    `generation` is the same object every time, filled in as it goes (text, steps, and at the
    end finish_reason and the KV-cache report). Closing the iterator (a client that went away)
    stops generation at once and frees everything.

    The settings are GenerateRequest's fields, as keywords (max_new_tokens=8, settings=...,
    seed=..., stop=[...], ...) or as `request=` (keywords then change that request's fields)."""
    yield from _steps(lm, _start(lm, _request(prompt, request, options)))


def generate(lm, prompt: str | None = None, *, on_step: Callable[[Step, Generation], None] | None = None,
             request: GenerateRequest | None = None, **options) -> Generation:
    """Generate up to max_new_tokens tokens and return the Generation with every step recorded.
    Arguments as in iter_generate; on_step(step, gen) is called after each step."""
    run = _start(lm, _request(prompt, request, options))
    with closing(_steps(lm, run)) as steps:
        for step, gen in steps:
            if on_step is not None:
                on_step(step, gen)
    return run.gen


def sample_many(lm, prompt: str | None = None, *, seeds=(0, 1, 2, 3, 4), **kwargs) -> list[Generation]:
    """The same prompt and settings drawn with several seeds (to see how settings change diversity)."""
    seeds = list(seeds)
    if not 1 <= len(seeds) <= 16:
        raise SettingsError("Draw between 1 and 16 samples at a time.")
    return [generate(lm, prompt, seed=s, **kwargs) for s in seeds]


@dataclass
class _Raw:
    """One step as a backend produced it: sample_step's packed record and what the cache holds."""
    index: int
    packed: torch.Tensor | list[float]
    seconds: float
    kv_point: tuple[int, int]  # (tokens cached, bytes) when this step's token was drawn
    kv_report: Callable[[], dict]  # kv_cache_report of the cache as it is now
    prefill_seconds: float | None = None  # the first step brings the prompt's forward time
    logits: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    ended: bool = False  # the backend ended the request (the engine, after a cancel)
    converted: tuple | None = None  # (Step, stop string hit): _convert already ran (on the engine thread)


def _steps(lm, run: _Run) -> Iterator[tuple[Step, Generation]]:
    """The loop both backends share: each raw step becomes a Step, the first reason to end is
    taken, and the generation is finished exactly once (_finish), before the last yield or, when
    the consumer stopped or went away, on the way out."""
    gen, backend, raw = run.gen, None, None
    try:
        if run.stopped():
            return
        eng = None if run.req.edits else _engine_for_request(lm, len(gen.prompt_ids), run.n_steps, run.k)
        backend = _local_steps(lm, run) if eng is None else _engine_steps(eng, lm, run)
        for raw in backend:
            step, hit = raw.converted or _convert(run, raw)
            reason = _record(run, raw, step, hit)
            if reason is not None:
                _finish(lm, run, backend, raw, reason, attach=run.req.attention)
            yield step, gen
            if gen.finished or run.stopped():  # checked again after the consumer ran (it may set the flag)
                return
    finally:
        if not gen.finished:
            _finish(lm, run, backend, raw, "cancelled", attach=False)


def _convert(run: _Run, raw: _Raw) -> tuple[Step, str | None]:
    """One raw step as a Step with the text so far, and the stop string it completed (or None). Reads
    the run's settings and grows run.text, nothing else of the run: for the engine's requests it runs
    on the engine thread, in order, while the request's own thread reads the Generation."""
    gen, record = run.gen, raw.packed
    if torch.is_tensor(record):
        record = record.tolist()
    chosen = int(record[0])
    text, hit = _cut_at_stop(run.text.add(chosen), gen.stop)
    step = Step(index=raw.index, position=len(gen.prompt_ids) + raw.index, chosen_id=chosen, seconds=raw.seconds,
                text_so_far=text, logits=raw.logits, probs=raw.probs, record=record, k=run.k, stages=run.stages)
    return step, hit


def _record(run: _Run, raw: _Raw, step: Step, hit: str | None) -> str | None:
    """Add one step to the Generation and say why generation ends here (None: it goes on)."""
    gen = run.gen
    gen.token_ids.append(step.chosen_id)
    gen.text = step.text_so_far
    if raw.prefill_seconds is not None:
        gen.prefill_seconds = raw.prefill_seconds
    gen.steps.append(step)
    gen.kv_series.append(raw.kv_point)
    if step.chosen_id in run.eos:
        return "eos"
    if hit is not None:
        gen.stop_string = hit
        return "stop_string"
    if raw.index == run.n_steps - 1:
        return "length" if run.n_steps == gen.max_new_tokens else "context_full"
    if raw.ended or run.stopped():
        return "cancelled"
    return None


def _finish(lm, run: _Run, backend, raw: _Raw | None, reason: str, attach: bool) -> None:
    """End the generation: release the backend (the engine frees the slot), say why, and record the
    KV-cache report, the wall time and, when asked, each step's attention."""
    if backend is not None:
        backend.close()
    gen = run.gen
    gen.finish_reason = reason
    if gen.token_ids:  # the final text from one whole decode of the tokens taken (the steps' was incremental)
        gen.text = _cut_at_stop(lm.tokenizer.decode(gen.token_ids, skip_special_tokens=True), gen.stop)[0]
    gen.kv_cache = raw.kv_report() if raw is not None else None
    gen.seconds = time.perf_counter() - run.started
    if attach and gen.steps:
        _attach_attention(lm, gen)


def _cut_at_stop(text: str, stop: list[str]) -> tuple[str, str | None]:
    """The text cut before the first stop string that appears in it, and that string (or None)."""
    hit = None
    if stop:
        found = [(text.find(s), s) for s in stop if s in text]
        if found:
            pos, hit = min(found)
            text = text[:pos]
    return text, hit


class TextSoFar:
    """`tok.decode(ids, skip_special_tokens=True)` as `ids` grows by one token per step, without
    decoding the whole continuation at every step (256 tokens cost 32 us a step on a 2-core CPU,
    and 32 users at 300 steps/s each would spend a third of the interpreter's time there).

    The text is a settled part (the whole decode of the first `start` tokens, checked against a
    whole decode when it moves) plus the decode of the tokens since, read through an overlap of
    the tokens just before `start` whose text begins with a visible character: a decoder that
    treats the start of what it decodes specially (a sentencepiece decoder stripping a leading
    space) then sees the same start in both, and bytes of one character are decoded together.
    Where the overlap does not explain the step's text, the step decodes everything; a tokenizer
    whose incremental text ever differed from its whole decode is decoded whole from then on."""

    SETTLE_EVERY = 16  # tokens between checks against a whole decode
    MAX_OVERLAP = 8  # tokens looked back for an overlap that starts with a visible character

    def __init__(self, tok):
        self.tok, self.ids = tok, []
        self.settled, self.start = "", 0  # decode(ids[:start])
        self.lo, self.head = 0, ""  # the overlap ids[lo:start] and its decode
        self.full_only = bool(getattr(tok, "_lmscope_full_decode", False))
        self._decode = _piece_decoder(tok)

    def whole(self) -> str:  # the reference every check is against: decode(ids) through what tok.decode runs
        return self._decode(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self.full_only:
            return self.whole()
        window = self._decode(self.ids[self.lo:])
        if not window.startswith(self.head):
            return self.whole()
        text = self.settled + window[len(self.head):]
        if len(self.ids) - self.start >= self.SETTLE_EVERY and not text.endswith("\ufffd"):
            whole = self.whole()
            if whole != text:  # this tokenizer does not decode piecewise: whole from now on
                self.tok._lmscope_full_decode = self.full_only = True
                return whole
            self._settle(whole)
        return text

    def _settle(self, whole: str) -> None:
        n = len(self.ids)
        for lo in range(n - 1, max(self.start, n - self.MAX_OVERLAP) - 1, -1):
            head = self._decode(self.ids[lo:])
            if head and not head[0].isspace():
                self.settled, self.start, self.lo, self.head = whole, n, lo, head
                return
        # Prose without punctuation: every token of the last few starts with a space. The last token
        # still serves where the whole text ends with its decode (a decoder that strips the leading
        # space strips it in the window too); left unsettled, every later step would decode everything.
        head = self._decode(self.ids[n - 1:])
        if head and whole.endswith(head):
            self.settled, self.start, self.lo, self.head = whole, n, n - 1, head


def _piece_decoder(tok) -> Callable[[list[int]], str]:
    """`tok.decode(ids, skip_special_tokens=True)` for TextSoFar's windows and whole decodes. Where that
    is the `tokenizers` backend's decode and nothing more (transformers' `TokenizersBackend` with its
    stock `decode` and `_decode`, without space clean-up), the backend is called directly:
    transformers' argument conversion cost 3.6 of 6.4 us a call (and 5% of the interpreter's time at
    32 users, in the whole decodes every SETTLE_EVERY tokens)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers without it: the wrapper
        TokenizersBackend = None
    backend = getattr(tok, "_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tok, TokenizersBackend) and backend is not None
            and type(tok)._decode is TokenizersBackend._decode and not tok.clean_up_tokenization_spaces
            and type(tok).decode is PreTrainedTokenizerBase.decode and "decode" not in vars(tok)):
        return partial(backend.decode, skip_special_tokens=True)
    return partial(tok.decode, skip_special_tokens=True)


def _local_steps(lm, run: _Run) -> Iterator[_Raw]:
    """The request's own forwards with a DynamicCache: the prompt, then per step the newest token's
    forward, sample_step on the device and one copy of its record to the host. On CUDA the next
    forward is launched before that copy (the host reads while the device works)."""
    gen, settings = run.gen, run.gen.settings
    n_prompt, dev = len(gen.prompt_ids), lm.device
    ids = torch.empty(n_prompt + run.n_steps, dtype=torch.long, device=dev)
    ids[:n_prompt] = torch.tensor(gen.prompt_ids, dtype=torch.long)
    use_rp = settings.repetition_penalty != 1.0
    overlap = dev.type == "cuda"
    cache = new_cache(lm)
    report = partial(kv_cache_report, lm, cache)
    edited = _edit_scope(lm, run.req.edits)
    # Inference mode (and the edits' recorder, a ContextVar) are per thread and a generator may be
    # resumed on another thread (Gradio streams through a thread pool), so both are entered per
    # step and never held across a yield.
    t0 = time.perf_counter()
    with torch.inference_mode(), edited():
        logits = _forward(lm, ids[None, :n_prompt], cache)
    prefill = time.perf_counter() - t0
    for i in range(run.n_steps):
        t0 = time.perf_counter()
        n = n_prompt + i  # tokens before this step's
        with torch.inference_mode(), edited():
            if i and not overlap:  # the previous token, fed only once the consumer asked for more
                logits = _forward(lm, ids[None, n - 1: n], cache)
            chosen, packed, final = sample_step(logits, settings, ids[:n] if use_rp else None, (gen.seed, i), run.k)
            ids[n: n + 1] = chosen
            kv_point = _cache_size(cache)
            step_logits = logits
            if overlap and i < run.n_steps - 1:
                logits = _forward(lm, ids[None, n: n + 1], cache)
            raw = _Raw(index=i, packed=packed.cpu(),  # the one device->host copy of the step
                       seconds=0.0, kv_point=kv_point, kv_report=report, prefill_seconds=prefill if i == 0 else None,
                       logits=step_logits.detach().cpu() if run.req.keep_logits else None,
                       probs=torch.softmax(final, -1).cpu() if run.req.keep_probs else None)
        raw.seconds = time.perf_counter() - t0
        yield raw


def _edit_scope(lm, edits: dict | None) -> Callable[[], contextlib.AbstractContextManager]:
    """A context factory that makes `edits` active in the forwards run inside it (none: a no-op)."""
    if not edits:
        return contextlib.nullcontext
    from model_core.core.hooks import Recorder, instrument, recording

    instrument(lm.adapter)
    return lambda: recording(Recorder(capture=False, edits=dict(edits)))


def _engine_for_request(lm, n_prompt: int, n_steps: int, k: int):
    """The model's engine if this request can run there (see model_core.serving.engine), else None."""
    from model_core.serving import engine

    if k != engine.RECORDED or not engine.can_use_engine(lm):
        return None
    eng = engine.engine_for(lm)
    if eng.start_error is not None or n_prompt + n_steps > eng.max_len:
        return None
    return eng


def _engine_steps(eng, lm, run: _Run) -> Iterator[_Raw]:
    """The model's engine: submit, then one step per record from its queue (closing this cancels).
    Each record becomes a Step on the engine thread (`EngineRequest.convert`): turned into text on
    32 request threads, the records kept the engine thread waiting for the GIL (docs/PERFORMANCE.md)."""
    from model_core.serving.engine import EngineRequest

    gen = run.gen
    per_token = eng.layer_bytes_per_token
    bytes_per_token = sum(per_token)
    er = EngineRequest(ids=list(gen.prompt_ids), n_steps=run.n_steps, settings=gen.settings, seed=gen.seed,
                       eos=run.eos, keep_logits=run.req.keep_logits, keep_probs=run.req.keep_probs)

    def convert(rec) -> _Raw:  # on the engine thread
        n = rec.tokens_cached  # the prompt and every token fed back so far
        first = (er.first_token_at or time.perf_counter()) - er.submitted if rec.index == 0 else None
        raw = _Raw(index=rec.index, packed=rec.packed, seconds=rec.seconds, kv_point=(n, n * bytes_per_token),
                   kv_report=partial(_kv_report, lm, n, per_token), prefill_seconds=first,
                   logits=rec.logits, probs=rec.probs, ended=rec.last)
        raw.converted = _convert(run, raw)
        return raw

    if not run.text.full_only:  # a tokenizer decoded whole every token would slow every row: here
        er.convert = convert
    eng.submit(er)
    turn, first = getattr(eng, "request_turn", None), True
    try:
        while True:
            try:
                raw = er.out.get_nowait()  # the rest of a launch's records: no waiting between them
            except queue.Empty:
                try:
                    raw = er.out.get(timeout=0.1)
                except queue.Empty:
                    if run.stopped():
                        er.cancel()
                    continue
                if turn is not None and not first:  # a new burst: the engine's interpreter work first
                    turn.wait(0.05)  # (Engine.request_turn); never before the first token (time to it)
            first = False
            if raw is None:  # ended without a record: an error, or a cancel
                if er.error is not None:
                    raise er.error
                return
            yield raw if isinstance(raw, _Raw) else convert(raw)  # not converted by the engine
    finally:
        er.cancel()
        er.convert = None  # the closure refers to er: no cycle left for the collector


# ---------------------------------------------------------------------------------------------
# Attention of the new token over its context

def attention_rows(lm, token_ids, query_positions, layers=None) -> torch.Tensor:
    """Attention of the given query positions over the sequence, per layer and head:
    [len(query_positions), layers, heads, T] (zeros beyond each query's position).

    With a causal mask a query's attention row does not depend on later tokens, so the row of
    position p in one forward over the whole sequence is exactly what the model computed when
    it produced token p+1 step by step. One traced forward pass (model_core.interp.trace) gives every
    layer's input; each layer's q and k are recomputed with the model's own projections."""
    from model_core.interp.trace import trace

    ids = [int(t) for t in token_ids]
    n_layers = lm.shape.n_layers
    layers = list(range(n_layers)) if layers is None else [int(l) for l in layers]
    qp = torch.tensor([int(p) for p in query_positions], dtype=torch.long)
    if qp.numel() == 0 or int(qp.min()) < 0 or int(qp.max()) >= len(ids):
        raise PromptError("Query positions must lie inside the sequence.")
    tr = trace(lm, token_ids=ids, layers=layers, max_tokens=None)
    ad = lm.adapter
    with torch.inference_mode():
        qp_d = qp.to(tr.device)
        rows = [ad.attention(l, tr.resid_pre[l], tr.rope.get(l), qp_d).probs.permute(1, 0, 2)  # [Q, H, T]
                for l in layers]
    return torch.stack(rows, 1).cpu()  # [Q, L, H, T]


def step_attention(lm, token_ids, step_position: int, layers=None) -> torch.Tensor:
    """[layers, heads, step_position]: the attention that produced the token at step_position
    (the query is the token before it) over the context it saw."""
    if step_position < 1:
        raise PromptError("The first token has no context to attend to.")
    return attention_rows(lm, token_ids[:step_position], [step_position - 1], layers)[0]


def _attach_attention(lm, gen: Generation) -> None:
    ids = gen.all_ids
    positions = [s.position - 1 for s in gen.steps]
    rows = attention_rows(lm, ids[: max(positions) + 1], positions)  # [Q, L, H, T]
    for s, r in zip(gen.steps, rows):
        s.attention = r.mean(1)[:, : s.position]  # [L, context]


# ---------------------------------------------------------------------------------------------
# KV cache accounting

def _layer_windows(lm) -> list[int | None]:
    ad = lm.adapter
    return [ad.sliding_window(l) for l in range(lm.shape.n_layers)]


def kv_cache_formula(lm, tokens: int, dtype: torch.dtype | None = None) -> dict:
    """Bytes the cache should hold for `tokens` tokens, per layer and in total. Sliding-window
    layers (Gemma 3) keep only the last window-1 tokens in transformers' DynamicCache."""
    s = lm.shape
    b = torch.empty((), dtype=dtype or lm.dtype).element_size()
    per_layer = []
    for w in _layer_windows(lm):
        t = tokens if w is None else min(tokens, w - 1)
        per_layer.append(kv_cache_bytes(1, s.n_kv_heads, s.d_head, t, b))
    return {"tokens": tokens, "bytes_per_value": b, "per_layer": per_layer, "total": sum(per_layer),
            "bytes_per_token": kv_cache_bytes(s.n_layers, s.n_kv_heads, s.d_head, 1, b),
            "expression": f"2 x {s.n_layers} layers x {s.n_kv_heads} kv_heads x {s.d_head} head_dim x "
                          f"{tokens} tokens x {b} B"}


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(getattr(l, "keys", None), getattr(l, "values", None)) for l in layers]
    return list(zip(cache.key_cache, cache.value_cache))  # older caches


def _cache_size(cache) -> tuple[int, int]:
    total, tokens = 0, 0
    for k, v in cache_tensors(cache):
        if torch.is_tensor(k) and k.numel():
            total += k.numel() * k.element_size() + v.numel() * v.element_size()
            tokens = max(tokens, int(k.shape[-2]))
    return tokens, total


def kv_cache_report(lm, cache) -> dict:
    """Formula next to the measured bytes of the cache's real key/value tensors, per layer."""
    measured, tokens_per_layer = [], []
    for k, v in cache_tensors(cache):
        empty = k is None or not torch.is_tensor(k) or k.numel() == 0
        measured.append(0 if empty else k.numel() * k.element_size() + v.numel() * v.element_size())
        tokens_per_layer.append(0 if empty else int(k.shape[-2]))
    tokens = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else max(tokens_per_layer or [0])
    tokens = max([tokens] + [t for t, w in zip(tokens_per_layer, _layer_windows(lm)) if w is None])
    return _report(lm, tokens, measured, tokens_per_layer)


def _kv_report(lm, tokens: int, layer_bytes_per_token: list[int]) -> dict:
    """kv_cache_report for an engine slot: the bytes `tokens` tokens occupy in the engine's
    preallocated cache tensors (their shapes and dtype, per layer)."""
    return _report(lm, tokens, [tokens * b for b in layer_bytes_per_token], [tokens] * len(layer_bytes_per_token))


def _report(lm, tokens: int, measured: list[int], tokens_per_layer: list[int]) -> dict:
    f = kv_cache_formula(lm, tokens)
    return {"tokens": tokens, "bytes_per_value": f["bytes_per_value"], "bytes_per_token": f["bytes_per_token"],
            "expression": f["expression"], "formula_per_layer": f["per_layer"], "formula_total": f["total"],
            "measured_per_layer": measured, "measured_total": sum(measured), "tokens_per_layer": tokens_per_layer}


def kv_cache_growth(lm, total_tokens: int, points: int = 32) -> dict:
    """Formula bytes as the sequence grows 1..total_tokens (for a plot)."""
    xs = sorted({max(1, round(total_tokens * i / points)) for i in range(1, points + 1)} | {1})
    rows = [kv_cache_formula(lm, t) for t in xs]
    return {"tokens": xs, "total": [r["total"] for r in rows], "per_layer": [r["per_layer"] for r in rows]}


def time_cache_vs_no_cache(lm, token_ids, new_tokens: int = 16, repeats: int = 1) -> dict:
    """Measured greedy decoding of `new_tokens` tokens after the prompt, with the KV cache (one
    new token per forward) and without it (the whole sequence every forward). Same tokens both
    ways (checked)."""
    ids = [int(t) for t in token_ids]
    new_tokens = check_max_new_tokens(new_tokens)
    if len(ids) + new_tokens > lm.shape.context_length:
        raise PromptError("The prompt plus the new tokens would not fit in the model's context.")
    dev = lm.device

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    best_on = best_off = float("inf")
    with torch.inference_mode():
        for _ in range(max(1, repeats)):
            sync()
            t0 = time.perf_counter()
            cache = new_cache(lm)
            x = torch.tensor([ids], device=dev)
            out_on = []
            logits = _forward(lm, x, cache)
            for _ in range(new_tokens):
                nxt = torch.argmax(logits).reshape(1, 1)
                out_on.append(nxt)
                logits = _forward(lm, nxt, cache)
            out_on = [int(t) for t in torch.cat(out_on).flatten().tolist()]
            sync()
            best_on = min(best_on, time.perf_counter() - t0)
            del cache
            t0 = time.perf_counter()
            seq = torch.tensor([ids], device=dev)
            out_off = []
            for _ in range(new_tokens):
                logits = lm.model(input_ids=seq, use_cache=False, logits_to_keep=1).logits[0, -1]
                nxt = torch.argmax(logits).reshape(1, 1)
                out_off.append(nxt)
                seq = torch.cat([seq, nxt], 1)
            out_off = [int(t) for t in torch.cat(out_off).flatten().tolist()]
            sync()
            best_off = min(best_off, time.perf_counter() - t0)
    return {"prompt_tokens": len(ids), "new_tokens": new_tokens, "with_cache_s": best_on, "without_cache_s": best_off,
            "speedup": best_off / best_on if best_on > 0 else float("nan"),
            "with_cache_tok_s": new_tokens / best_on, "without_cache_tok_s": new_tokens / best_off,
            "same_tokens": out_on == out_off}


# ---------------------------------------------------------------------------------------------
# JSON

def _tok(lm, i: int) -> str:
    from model_core.core.tokenization import display_bytes, token_bytes

    return display_bytes(token_bytes(lm.tokenizer, int(i)))


def step_to_json(lm, s: Step) -> dict:
    tok = lm.tokenizer
    return {
        "index": s.index, "position": s.position,
        "chosen": {"id": s.chosen_id, "token": tok.decode([s.chosen_id]), "display": _tok(lm, s.chosen_id),
                   "prob": s.chosen_prob, "prob_filtered": s.chosen_prob_filtered, "rank": s.chosen_rank},
        "entropy": s.entropy, "entropy_filtered": s.entropy_filtered, "n_candidates": s.n_candidates,
        "top_before": [{"id": i, "token": _tok(lm, i), "prob": p, "removed_by": r}
                       for i, p, r in zip(s.top_ids, s.top_probs, s.top_removed_by)],
        "top_after": [{"id": i, "token": _tok(lm, i), "prob": p} for i, p in zip(s.after_ids, s.after_probs) if p > 0],
        "removed": s.removed, "seconds": round(s.seconds, 6),
    }


def generation_to_json(lm, gen: Generation) -> dict:
    return {
        "model": gen.model_name, "prompt": gen.prompt, "chat": gen.chat, "settings": gen.settings.to_dict(),
        "seed": gen.seed, "max_new_tokens": gen.max_new_tokens, "stop": gen.stop,
        "text": gen.text, "token_ids": gen.token_ids, "prompt_token_ids": gen.prompt_ids,
        "finish_reason": gen.finish_reason, "stop_string": gen.stop_string,
        "n_tokens": len(gen.token_ids), "prefill_seconds": round(gen.prefill_seconds, 6),
        "seconds": round(gen.seconds, 6), "tokens_per_second": round(gen.tokens_per_second, 3),
        "kv_cache": gen.kv_cache, "kv_series": [list(x) for x in gen.kv_series], "steps": [step_to_json(lm, s) for s in gen.steps],
    }
