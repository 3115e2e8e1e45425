"""Concurrent traces batched into shared forwards (model_core.interp.trace_batching). Generation is batched by
the engine (tests/reference/test_engine.py).

References: transformers' own forward (hidden states and logits) of each prompt alone, and
lmscope's solo trace of it. The batcher's counters prove the requests really were batched (the
test would be vacuous otherwise).
"""

import threading

import pytest
import torch

from conftest import DEFAULT
from model_core import load_model, trace
from model_core.interp.trace_batching import batcher_for
from model_core.serving.generate import generate
from tests.helpers.tolerance import assert_close_to_scale

PROMPTS = ["The capital of France is", "Once upon a time, there was a little",
           "def add(a, b):\n    return", "Water boils at"]


def _concurrent(lm, fn, n):
    out, errors = [None] * n, []
    start = threading.Barrier(n)

    def run(i):
        try:
            start.wait()
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def _queued_together(b, kind, fns):
    """Run fns in threads while the batcher is held busy, so that all of them queue up; then let
    it go: they must run as one batch (deterministic, unlike hoping threads overlap)."""
    import time

    out = [None] * len(fns)
    with b._cv:
        assert not b._busy
        b._busy = True
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fns[i]())) for i in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(r.kind == kind for r in b._pending) < len(fns) and time.monotonic() < deadline:
        time.sleep(0.01)
    with b._cv:
        b._busy = False
        b._cv.notify_all()
    for t in threads:
        t.join(60)
    assert all(o is not None for o in out)
    return out


def test_sliding_window_models_generate_on_the_engine_and_still_correct():
    from test_engine import _hf_greedy  # transformers' own greedy generate, one prompt alone

    from model_core.serving.engine import can_use_engine

    lm = load_model("random-gemma3-tiny")
    assert can_use_engine(lm)  # sliding windows: the engine masks them (model_core.serving.slot_cache)
    gens = _concurrent(lm, lambda i: generate(lm, PROMPTS[i], max_new_tokens=6, ignore_eos=True), 2)
    for prompt, g in zip(PROMPTS, gens):
        assert g.token_ids == _hf_greedy(lm, prompt, 6)


@pytest.mark.parametrize("name", [DEFAULT, "random-gemma3-tiny", "random-gpt2-tiny"])
def test_batched_traces_equal_transformers_and_solo_traces(name):
    lm = load_model(name)
    b = batcher_for(lm)
    prompts = [p * (1 + i % 2) for i, p in enumerate(PROMPTS)]  # different lengths: padding
    together = _queued_together(b, "trace", [lambda p=p: trace(lm, p) for p in prompts])
    assert b.stats.sizes.get(("trace", len(prompts)), 0) >= 1, b.stats.sizes  # one batch of all of them
    for prompt, tr in zip(prompts, together):
        ids = tr.token_ids
        with torch.inference_mode():
            ref = lm.model(torch.tensor([ids]), output_hidden_states=True)
        torch.testing.assert_close(tr.logits().float(), ref.logits[0].float(), atol=2e-4, rtol=1e-4)
        for l in range(lm.shape.n_layers - 1):
            assert_close_to_scale(tr.resid_post(l), ref.hidden_states[l + 1][0], rel=2e-5)
        solo = trace(lm, prompt)
        assert solo.token_ids == ids
        torch.testing.assert_close(tr.next_logits, solo.next_logits, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(tr.token_logprobs, solo.token_logprobs, atol=2e-4, rtol=1e-4, equal_nan=True)
        torch.testing.assert_close(tr.attention_pattern(1), solo.attention_pattern(1), atol=1e-5, rtol=1e-4)
        assert tr.resid_pre[0].shape == (len(ids), lm.shape.d_model)


def test_a_failed_batch_runs_each_request_alone(monkeypatch):
    """A batch that fails as a whole (out of memory, say) must not fail its requests: each one
    runs alone and gets its own result, equal to transformers' forward."""
    lm = load_model("random-llama-tiny")
    b = batcher_for(lm)

    def boom(batch):
        raise RuntimeError("simulated out of memory in the batched forward")

    monkeypatch.setattr(b, "_trace_batch", boom)
    out = _queued_together(b, "trace", [lambda p=p: trace(lm, p) for p in PROMPTS])
    for tr in out:
        with torch.inference_mode():
            ref = lm.model(torch.tensor([tr.token_ids])).logits[0]
        torch.testing.assert_close(tr.logits().float(), ref.float(), atol=1e-5, rtol=1e-5)
