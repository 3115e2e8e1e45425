"""The request's own forwards: the generation path of a request the shared engine does not take
(hook edits such as steering or ablations, a recorder, a model the engine cannot run), one
`DynamicCache` per request. Same records and same seeded draws as the engine's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch

from model_core.core.cache_api import new_cache
from model_core.serving.generation_records import RawStep
from model_core.serving.generation_request import GenerationRun
from model_core.serving.kv_cache_accounting import cache_size, kv_cache_report
from model_core.serving.model_forward import forward_last
from model_core.serving.step_sampling import sample_step


def local_steps(lm, run: GenerationRun) -> Iterator[RawStep]:
    """The request's own forwards with a DynamicCache: the prompt, then per step the newest token's
    forward, sample_step on the device and one copy of its record to the host. On CUDA the next
    forward is launched before that copy (the host reads while the device works)."""
    gen, settings = run.gen, run.gen.settings
    n_prompt, dev = len(gen.prompt_ids), lm.device
    ids = torch.empty(n_prompt + run.n_steps, dtype=torch.long, device=dev)
    ids[:n_prompt] = torch.tensor(gen.prompt_ids, dtype=torch.long)
    use_rp = settings.repetition_penalty != 1.0
    use_pf = settings.penalises_generated
    overlap = dev.type == "cuda"
    cache = new_cache(lm)
    report = partial(kv_cache_report, lm, cache)
    edited = edit_scope(lm, run.req.edits)
    # Inference mode (and the edits' recorder, a ContextVar) are per thread and a generator may be
    # resumed on another thread (Gradio streams through a thread pool), so both are entered per
    # step and never held across a yield.
    t0 = time.perf_counter()
    with torch.inference_mode(), edited():
        logits = forward_last(lm, ids[None, :n_prompt], cache)
    prefill = time.perf_counter() - t0
    for i in range(run.n_steps):
        t0 = time.perf_counter()
        n = n_prompt + i  # tokens before this step's
        with torch.inference_mode(), edited():
            if i and not overlap:  # the previous token, fed only once the consumer asked for more
                logits = forward_last(lm, ids[None, n - 1: n], cache)
            chosen, packed, final = sample_step(logits, settings, ids[:n] if use_rp else None, (gen.seed, i), run.k,
                                                ids[n_prompt:n] if use_pf else None)  # generated so far
            ids[n: n + 1] = chosen
            kv_point = cache_size(cache)
            step_logits = logits
            if overlap and i < run.n_steps - 1:
                logits = forward_last(lm, ids[None, n: n + 1], cache)
            raw = RawStep(index=i, packed=packed.cpu(),  # the one device->host copy of the step
                          seconds=0.0, kv_point=kv_point, kv_report=report, prefill_seconds=prefill if i == 0 else None,
                          logits=step_logits.detach().cpu() if run.req.keep_logits else None,
                          probs=torch.softmax(final, -1).cpu() if run.req.keep_probs else None)
        raw.seconds = time.perf_counter() - t0
        yield raw


def edit_scope(lm, edits: dict | None) -> Callable[[], contextlib.AbstractContextManager]:
    """A context factory that makes `edits` active in the forwards run inside it (none: a no-op)."""
    if not edits:
        return contextlib.nullcontext
    from model_core.core.hooks import Recorder, instrument, recording

    instrument(lm.adapter)
    return lambda: recording(Recorder(capture=False, edits=dict(edits)))
