"""The records of a generation: a `Step` per token (its packed record, unpacked when first read),
the `Generation` they make up, the raw step a backend hands over (`RawStep`), and their JSON.

The packed record is one float32 tensor per step (`step_sampling.sample_step`, or the engine's
`batch_sampling.sample_rows`), copied to the host once; its layout is read back here (`_unpack`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from model_core.core.sampling import SamplingSettings

TOP_K_RECORDED = 10  # candidates kept per step, before and after the filters
FILTER_STAGES = ("top_k", "top_p", "min_p")  # the stages that remove tokens (greedy: "greedy")

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
# The packed record's stage codes and its layout, read back

# which stage removed a candidate, as a number in the record (0: none; sample_step writes these)
STAGE_CODES = {None: 0, "top_k": 1, "top_p": 2, "min_p": 3, "greedy": 4}
_CODE_STAGES = {v: k for k, v in STAGE_CODES.items()}


def recorded_stages(settings: SamplingSettings) -> tuple[tuple[int, str], ...]:
    """(slot in the record's removed-counts, stage name) for each filter these settings apply."""
    if settings.greedy:
        return ((3, "greedy"),)
    on = (settings.top_k > 0, settings.top_p < 1, settings.min_p > 0)
    return tuple((j, name) for j, (name, used) in enumerate(zip(("top_k", "top_p", "min_p"), on)) if used)


def _unpack(packed, k: int, settings: SamplingSettings, stages: tuple | None = None) -> dict:
    """A packed record (tensor or list, `sample_step` / `batch_sampling.sample_rows` layout) -> Step fields.
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


@dataclass
class RawStep:
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


# ---------------------------------------------------------------------------------------------
# JSON

def step_to_json(lm, s: Step) -> dict:
    from model_core.core.tokenization import token_displays, token_text

    tok = lm.tokenizer
    display = token_displays(tok)
    return {
        "index": s.index, "position": s.position,
        "chosen": {"id": s.chosen_id, "token": token_text(tok, s.chosen_id), "display": display(s.chosen_id),
                   "prob": s.chosen_prob, "prob_filtered": s.chosen_prob_filtered, "rank": s.chosen_rank},
        "entropy": s.entropy, "entropy_filtered": s.entropy_filtered, "n_candidates": s.n_candidates,
        "top_before": [{"id": i, "token": display(i), "prob": p, "removed_by": r}
                       for i, p, r in zip(s.top_ids, s.top_probs, s.top_removed_by)],
        "top_after": [{"id": i, "token": display(i), "prob": p}
                      for i, p in zip(s.after_ids, s.after_probs) if p > 0],
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
