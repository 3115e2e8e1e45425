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

This module is the loop both backends share and the engine's path; the parts live beside it:
  generation_records   Step, Generation, RawStep, the packed record's layout, their JSON
  generation_request   GenerateRequest, the settings' checks, the checked run (start_run)
  step_sampling        sample_step: one step's sampling and record on the device
  request_forwards     the request's own forwards (hook edits without a per-row form, or no engine)
  text_so_far          the continuation's text as it grows, cut at a stop string
  step_attention       each step's attention over its context
  kv_cache_accounting  formula vs measured KV-cache bytes, decode time with and without the cache
  model_forward        one cached forward, the EOS ids
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import replace
from functools import partial

import torch

from model_core.core.errors import SettingsError
from model_core.core.row_edits import engine_runnable
from model_core.serving.generation_records import (
    FILTER_STAGES,
    TOP_K_RECORDED,
    Generation,
    RawStep,
    Step,
    generation_to_json,
    recorded_stages,
    step_to_json,
)
from model_core.serving.generation_request import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    GenerateRequest,
    GenerationRun,
    ShouldStop,
    check_max_new_tokens,
    check_seed,
    check_stop,
    max_new_tokens_cap,
    start_run,
)
from model_core.serving.kv_cache_accounting import (
    cache_tensors,
    kv_cache_formula,
    kv_cache_growth,
    kv_cache_report,
    slot_kv_report,
    time_cache_vs_no_cache,
)
from model_core.serving.model_forward import eos_ids
from model_core.serving.request_forwards import local_steps
from model_core.serving.step_attention import attach_attention, attention_rows, step_attention
from model_core.serving.step_sampling import sample_step
from model_core.serving.text_so_far import TextSoFar, cut_at_stop

__all__ = [
    "FILTER_STAGES", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "TOP_K_RECORDED",
    "GenerateRequest", "Generation", "ShouldStop", "Step", "TextSoFar",
    "attention_rows", "cache_tensors", "check_max_new_tokens", "check_seed", "check_stop", "eos_ids",
    "generate", "generation_to_json", "iter_generate", "kv_cache_formula", "kv_cache_growth",
    "kv_cache_report", "max_new_tokens_cap", "recorded_stages", "sample_many", "sample_step",
    "step_attention", "step_to_json", "time_cache_vs_no_cache",
]


# ---------------------------------------------------------------------------------------------
# Generation: a request, two backends (the engine, or the request's own forwards) and one loop

def _request(prompt: str | None, request: GenerateRequest | None, options: dict) -> GenerateRequest:
    """The request from iter_generate's / generate's arguments: `request` (or the defaults) with the
    prompt and any GenerateRequest field given as a keyword put in (TypeError for an unknown one)."""
    if prompt is not None:
        options["prompt"] = prompt
    return replace(request or GenerateRequest(), **options)


def iter_generate(lm, prompt: str | None = None, *, request: GenerateRequest | None = None,
                  **options) -> Iterator[tuple[Step, Generation]]:
    """Stream a generation: yields (step, generation) right after each token is produced;
    `generation` is the same object every time, filled in as it goes (text, steps, and at the
    end finish_reason and the KV-cache report). Closing the iterator (a client that went away)
    stops generation at once and frees everything.

    The settings are GenerateRequest's fields, as keywords (max_new_tokens=8, settings=...,
    seed=..., stop=[...], ...) or as `request=` (keywords then change that request's fields)."""
    yield from _steps(lm, start_run(lm, _request(prompt, request, options)))


def generate(lm, prompt: str | None = None, *, on_step: Callable[[Step, Generation], None] | None = None,
             request: GenerateRequest | None = None, **options) -> Generation:
    """Generate up to max_new_tokens tokens and return the Generation with every step recorded.
    Arguments as in iter_generate; on_step(step, gen) is called after each step."""
    run = start_run(lm, _request(prompt, request, options))
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


def _steps(lm, run: GenerationRun) -> Iterator[tuple[Step, Generation]]:
    """The loop both backends share: each raw step becomes a Step, the first reason to end is
    taken, and the generation is finished exactly once (_finish), before the last yield or, when
    the consumer stopped or went away, on the way out."""
    gen, backend, raw = run.gen, None, None
    try:
        if run.stopped():
            return
        eng = None if run.req.edits and not engine_runnable(run.req.edits, lm.device) \
            else _engine_for_request(lm, len(gen.prompt_ids), run.n_steps, run.k)
        backend = local_steps(lm, run) if eng is None else _engine_steps(eng, lm, run)
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


def _convert(run: GenerationRun, raw: RawStep) -> tuple[Step, str | None]:
    """One raw step as a Step with the text so far, and the stop string it completed (or None). Reads
    the run's settings and grows run.text, nothing else of the run: for the engine's requests it runs
    on the engine thread, in order, while the request's own thread reads the Generation."""
    gen, record = run.gen, raw.packed
    if torch.is_tensor(record):
        record = record.tolist()
    chosen = int(record[0])
    text, hit = cut_at_stop(run.text.add(chosen), gen.stop)
    step = Step(index=raw.index, position=len(gen.prompt_ids) + raw.index, chosen_id=chosen, seconds=raw.seconds,
                text_so_far=text, logits=raw.logits, probs=raw.probs, record=record, k=run.k, stages=run.stages)
    return step, hit


def _record(run: GenerationRun, raw: RawStep, step: Step, hit: str | None) -> str | None:
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


def _finish(lm, run: GenerationRun, backend, raw: RawStep | None, reason: str, attach: bool) -> None:
    """End the generation: release the backend (the engine frees the slot), say why, and record the
    KV-cache report, the wall time and, when asked, each step's attention."""
    if backend is not None:
        backend.close()
    gen = run.gen
    gen.finish_reason = reason
    if gen.token_ids:  # the final text from one whole decode of the tokens taken (the steps' was incremental)
        gen.text = cut_at_stop(lm.tokenizer.decode(gen.token_ids, skip_special_tokens=True), gen.stop)[0]
    gen.kv_cache = raw.kv_report() if raw is not None else None
    gen.seconds = time.perf_counter() - run.started
    if attach and gen.steps:
        attach_attention(lm, gen)


def _engine_for_request(lm, n_prompt: int, n_steps: int, k: int):
    """The model's engine if this request can run there (see model_core.serving.engine), else None."""
    from model_core.serving import engine

    if k != engine.RECORDED or not engine.can_use_engine(lm):
        return None
    eng = engine.engine_for(lm)
    if eng.start_error is not None or n_prompt + n_steps > eng.max_len:
        return None
    return eng


def _engine_steps(eng, lm, run: GenerationRun) -> Iterator[RawStep]:
    """The model's engine: submit, then one step per record from its queue (closing this cancels).
    Each record becomes a Step on the engine thread (`EngineRequest.convert`): turned into text on
    32 request threads, the records kept the engine thread waiting for the GIL (docs/PERFORMANCE.md)."""
    from model_core.serving.engine import EngineRequest

    gen = run.gen
    per_token = eng.layer_bytes_per_token
    bytes_per_token = sum(per_token)
    er = EngineRequest(ids=list(gen.prompt_ids), n_steps=run.n_steps, settings=gen.settings, seed=gen.seed,
                       eos=run.eos, keep_logits=run.req.keep_logits, keep_probs=run.req.keep_probs,
                       edits=dict(run.req.edits) if run.req.edits else None)

    def convert(rec) -> RawStep:  # on the engine thread
        n = rec.tokens_cached  # the prompt and every token fed back so far
        first = (er.first_token_at or time.perf_counter()) - er.submitted if rec.index == 0 else None
        raw = RawStep(index=rec.index, packed=rec.packed, seconds=rec.seconds, kv_point=(n, n * bytes_per_token),
                      kv_report=partial(slot_kv_report, lm, n, per_token), prefill_seconds=first,
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
            yield raw if isinstance(raw, RawStep) else convert(raw)  # not converted by the engine
    finally:
        er.cancel()
        er.convert = None  # the closure refers to er: no cycle left for the collector
