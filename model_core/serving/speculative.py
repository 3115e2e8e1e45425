"""Speculative decoding, greedy: a draft proposes up to k tokens, the target model checks them all in
one forward pass and keeps the longest prefix it agrees with, plus its own next token (Leviathan et
al. 2023; transformers calls it assisted generation). Every kept token is the target's own argmax
given the text before it, so the text is the target's plain greedy text: the draft only decides how
many tokens one target forward yields.

Drafts:
- prompt lookup: the last n tokens (n = 3, 2, 1) found earlier in the text; the tokens that followed
  them there are the proposal (transformers' `prompt_lookup_num_tokens`). No second model; it pays
  where the output copies its context (code edits, summaries, repetition).
- a draft model on the target's own tokenizer (a smaller decoder, or the target cut after a few
  layers): its greedy continuation, kept in its own KV cache across steps.

`plain_greedy` is the same loop with nothing proposed, so a comparison of the two times the draft's
effect and nothing else (same forwards, same cache, same Python).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from model_core.core.cache_api import cache_kwarg, crop_to, full_prefill_cache
from model_core.core.errors import SettingsError
from model_core.serving.model_forward import eos_ids

log = logging.getLogger(__name__)

MAX_DRAFT_TOKENS = 32
PROMPT_LOOKUP_NGRAM = 3  # the longest n-gram looked up (transformers' default max_matching_ngram_size is 2)


@dataclass
class VerifyStep:
    """One target forward: what the draft proposed at generated position `at`, how many of those
    tokens the target kept, and the target's own token after them (the correction, or a bonus token
    when it kept them all)."""
    at: int
    proposed: list[int]
    accepted: int
    token: int

    def to_json(self) -> dict:
        return {"at": self.at, "proposed": self.proposed, "accepted": self.accepted, "token": self.token}


@dataclass
class SpeculativeGeneration:
    prompt_ids: list[int]
    token_ids: list[int]
    draft: str  # "prompt lookup" or the draft model's name; "none" for plain greedy
    k: int
    finish_reason: str  # "eos" or "length"
    seconds: float
    steps: list[VerifyStep] = field(default_factory=list)

    @property
    def target_forwards(self) -> int:
        return 1 + len(self.steps)  # the prefill, then one per verify step

    @property
    def proposed(self) -> int:
        return sum(len(s.proposed) for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def to_json(self, tokenizer=None) -> dict:
        out = {"draft": self.draft, "k": self.k, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "seconds": self.seconds, "target_forwards": self.target_forwards,
               "tokens_per_forward": len(self.token_ids) / self.target_forwards,
               "proposed": self.proposed, "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
               "steps": [s.to_json() for s in self.steps]}
        if tokenizer is not None:
            out["text"] = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return out


def _all_logits(model, ids: list[int], cache) -> torch.Tensor:
    """ids -> logits at every one of their positions [t, V] (float32); the cache grows by t."""
    x = torch.tensor([ids], device=model.device)  # [1, t]
    return model(input_ids=x, use_cache=True, **{cache_kwarg(model): cache}).logits[0].float()  # [t, V]


class PromptLookup:
    """Proposals from the text itself: the tokens that followed the latest earlier occurrence of the
    text's last n tokens (n from PROMPT_LOOKUP_NGRAM down to 1); none when no n-gram recurs."""
    name = "prompt lookup"

    def propose(self, context: list[int], k: int) -> list[int]:
        for n in range(min(PROMPT_LOOKUP_NGRAM, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # latest first; not the tail itself
                if context[start:start + n] == tail:
                    return context[start + n:start + n + k]
        return []


class DraftModel:
    """A draft model's greedy continuation. Its cache holds the ids it last saw; the part the target
    rejected is cropped off before the next proposal, so each step feeds only what is new."""

    def __init__(self, draft_lm):
        self.lm = draft_lm
        self.name = draft_lm.name
        self.cache = full_prefill_cache(draft_lm)
        self.cached: list[int] = []  # the ids whose keys and values the cache holds

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        keep = 0
        for a, b in zip(self.cached, context):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(context) - 1)  # at least one token goes in, for the next token's logits
        if keep < len(self.cached):
            crop_to(self.cache, keep)
        new = context[keep:]
        out: list[int] = []
        with torch.inference_mode():
            logits = _all_logits(self.lm.model, new, self.cache)[-1]  # [V]
            self.cached = list(context)
            for i in range(k):
                t = int(torch.argmax(logits))
                out.append(t)
                if i + 1 < k:
                    logits = _all_logits(self.lm.model, [t], self.cache)[-1]
                    self.cached.append(t)
        return out


def first_layers(lm, n_layers: int):
    """The target cut after its first `n_layers` decoder layers, its embeddings, final norm and
    unembedding kept (the weights shared, nothing copied): an untrained early-exit draft on the
    target's own tokenizer. For models whose decoder keeps its layers at `model.model.layers`."""
    total = lm.shape.n_layers
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers < total:
        raise SettingsError(f"The draft's layers must be a whole number from 1 to {total - 1}, not {n_layers!r}.")
    inner = getattr(lm.model, "model", None)
    if not isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        raise SettingsError(f"Model '{lm.name}' keeps its layers elsewhere; a cut draft needs model.layers.")
    model, inner = copy.copy(lm.model), copy.copy(inner)
    # a shallow copy shares the submodule dict: give each copy its own before replacing entries
    model._modules, inner._modules = dict(model._modules), dict(inner._modules)
    inner.layers = inner.layers[:n_layers]
    model.model = inner
    model.config = copy.copy(model.config)
    model.config.num_hidden_layers = n_layers
    return SimpleNamespace(model=model, name=f"{lm.name}, first {n_layers} layers", tokenizer=lm.tokenizer,
                           adapter=lm.adapter, shape=SimpleNamespace(n_layers=n_layers))


def check_draft(target_lm, draft_lm) -> None:
    """The draft must speak the target's tokens: the same ids for the same strings."""
    if draft_lm.tokenizer.get_vocab() != target_lm.tokenizer.get_vocab():
        raise SettingsError(f"The draft model '{draft_lm.name}' has another tokenizer than '{target_lm.name}'; "
                            "speculative decoding here needs the same tokens (prompt lookup needs no draft model).")


def check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise SettingsError(f"The number of draft tokens must be a whole number from 1 to {MAX_DRAFT_TOKENS}, "
                            f"not {k!r}.")
    return k


def speculative_greedy(lm, prompt_ids: list[int], max_new_tokens: int, draft=None, k: int = 4
                       ) -> SpeculativeGeneration:
    """Greedy decoding of `lm` with a draft's proposals checked k at a time (draft None: plain
    greedy, one token per forward, through the same code)."""
    if draft is not None:
        check_k(k)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SettingsError(f"max_new_tokens must be a whole number of at least 1, not {max_new_tokens!r}.")
    ends = set(eos_ids(lm))
    model = lm.model
    cache = full_prefill_cache(lm)
    context = [int(t) for t in prompt_ids]
    generated: list[int] = []
    steps: list[VerifyStep] = []
    reason = "length"
    start = time.perf_counter()
    with torch.inference_mode():
        first = int(torch.argmax(_all_logits(model, context, cache)[-1]))
        generated.append(first)
        context.append(first)
        if first in ends:
            reason = "eos"
        while reason != "eos" and len(generated) < max_new_tokens:
            room = max_new_tokens - len(generated) - 1  # all accepted plus the target's own token fit
            proposal = draft.propose(context, min(k, room)) if draft is not None and room > 0 else []
            n_cached = len(context) - 1  # the last token is not in the cache yet
            preds = torch.argmax(_all_logits(model, [context[-1], *proposal], cache), dim=-1).tolist()  # [1+p]
            m = 0
            while m < len(proposal) and proposal[m] == preds[m]:
                m += 1
            crop_to(cache, n_cached + 1 + m)  # the last token and the kept proposals; the rest was wrong
            new = [*proposal[:m], preds[m]]
            steps.append(VerifyStep(at=len(generated), proposed=list(proposal), accepted=m, token=preds[m]))
            for t in new:
                generated.append(t)
                context.append(t)
                if t in ends:
                    reason = "eos"
                    break
    seconds = time.perf_counter() - start
    name = "none" if draft is None else draft.name
    log.debug("speculative greedy with %s: %d tokens in %d target forwards", name, len(generated), 1 + len(steps))
    return SpeculativeGeneration(prompt_ids=list(prompt_ids), token_ids=generated, draft=name,
                                 k=k if draft is not None else 0, finish_reason=reason, seconds=seconds, steps=steps)


def plain_greedy(lm, prompt_ids: list[int], max_new_tokens: int) -> SpeculativeGeneration:
    return speculative_greedy(lm, prompt_ids, max_new_tokens, draft=None)
