"""The engine's compiled decode step (LMSCOPE_COMPILE; on by default with CUDA graphs) on the CPU:
the same code path as on a GPU (compiled in a background thread on scratch buffers, rows and length
as dynamic sizes, the grouped-query decode attention), without the graph capture.

References:
- torch's scaled_dot_product_attention over key/value heads repeated to the query heads (what
  transformers' SDPA attention computes for a one-token query under torch.compile);
- transformers' own SDPA forward of the same decode step;
- transformers' `model.generate(do_sample=False)` run alone on each prompt;
- the uncompiled engine (same seeds, same draws; records to float rounding).
"""

import torch
import torch._dynamo

from model_core import load_model
from model_core.core.cache_api import cache_kwarg, new_cache
from model_core.core.sampling import SamplingSettings
from model_core.serving import decode_attention
from model_core.serving.batch_sampling import sample_rows
from model_core.serving.engine import Engine, EngineRequest, engine_for
from model_core.serving.slot_cache import SlotCache

PROMPTS = ["The capital of France is", "Once upon a time, there was a little"]


def test_grouped_decode_attention_equals_sdpa_over_repeated_heads():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, slots, max_len, L = 3, 6, 2, 16, 4, 40, 17
    q = torch.randn(B, H, 1, D, generator=g)
    keys = torch.randn(slots, Hkv, max_len, D, generator=g)  # a slot cache's layer: a length prefix is attended
    values = torch.randn(slots, Hkv, max_len, D, generator=g)
    K, V = keys[:B, :, :L], values[:B, :, :L]
    pos = torch.tensor([5, 16, 0])
    allowed = torch.arange(L)[None, :] <= pos[:, None]
    mask = torch.zeros(B, 1, 1, L).masked_fill(~allowed[:, None, None, :], torch.finfo(torch.float32).min)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, K.repeat_interleave(H // Hkv, 1), V.repeat_interleave(H // Hkv, 1), attn_mask=mask).transpose(1, 2)
    out = decode_attention.grouped_decode_attention(q, K, V, mask, D ** -0.5)
    assert out.shape == (B, 1, H, D)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the row at position 0 attends to its first key alone: its output is that value, per head group
    torch.testing.assert_close(out[2, 0].view(Hkv, H // Hkv, D), V[2, :, :1].expand(Hkv, H // Hkv, D))


def test_a_decode_step_with_slot_decode_equals_transformers_sdpa(monkeypatch):
    lm = load_model("random-llama-tiny")  # 4 query heads over 2 key-value heads
    decode_attention.install()
    calls = []
    original = decode_attention.grouped_decode_attention
    monkeypatch.setattr(decode_attention, "grouped_decode_attention", lambda *a: calls.append(1) or original(*a))
    prompts = [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33]]
    probe = new_cache(lm)
    with torch.inference_mode():
        lm.model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True, **{cache_kwarg(lm.model): probe})
        cache = SlotCache([(l.keys.shape[1], l.keys.shape[3]) for l in probe.layers], 4, 32, lm.dtype, lm.device)
        for slot, ids in enumerate(prompts):
            pre = new_cache(lm)
            lm.model(input_ids=torch.tensor([ids]), use_cache=True, **{cache_kwarg(lm.model): pre})
            cache.load_rows(torch.tensor([slot]), pre, len(ids))
        tok = torch.tensor([[40], [41], [42]])
        pos = torch.tensor([len(p) for p in prompts])
        out = {}
        for slot_decode in (False, True):
            mask = cache.window(3, 16, pos)
            kw = {decode_attention.SLOT_DECODE: True} if slot_decode else {}
            out[slot_decode] = lm.model(input_ids=tok, position_ids=pos[:, None], attention_mask=mask, use_cache=True,
                                        **{cache_kwarg(lm.model): cache}, **kw).logits[:, -1]
    assert len(calls) == lm.shape.n_layers  # the keyword reached every layer's attention, and only once asked
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # and each row equals transformers' own forward of its whole sequence
        for i, ids in enumerate(prompts):
            alone = lm.model(input_ids=torch.tensor([ids + [40 + i]])).logits[0, -1]
            torch.testing.assert_close(out[True][i], alone, atol=1e-5, rtol=1e-5)


def _run(eng, lm, settings, seeds, n=8):
    reqs = [EngineRequest(ids=lm.tokenizer(p)["input_ids"], n_steps=n, settings=settings, seed=s, eos=set())
            for p, s in zip(PROMPTS, seeds)]
    with eng.hold():  # admitted together: batched steps
        for r in reqs:
            eng.submit(r)
    out = []
    for r in reqs:
        recs = []
        while (rec := r.out.get(timeout=300)) is not None:
            recs.append(rec)
        assert r.error is None, r.error
        out.append(recs)
    return out


def _hf_greedy(lm, prompt, n):
    ids = lm.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_the_compiled_engine_equals_transformers_and_the_uncompiled_engine():
    lm = load_model("random-llama-tiny")
    plain = engine_for(lm)  # the uncompiled engine (CPU default)
    eng = Engine(lm, slots=2, max_len=64, use_graphs=False, compile=True)
    try:
        assert eng.wait_compiled(900), eng.compile_state
        before = eng.stats.compiled_steps
        with torch._dynamo.config.patch(error_on_recompile=True):  # serving never compiles
            greedy = _run(eng, lm, SamplingSettings(temperature=0.0), [0, 0])
            s = SamplingSettings(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
            sampled = _run(eng, lm, s, [7, 8])
        assert eng.stats.compiled_steps - before >= 2 * 7  # both runs' decode steps were the compiled ones
        # and neither stage set's sampling fell back to the uncompiled function (an inductor failure)
        assert all(f is not sample_rows for f in eng._fast_sample.values()), eng._fast_sample
        for prompt, recs in zip(PROMPTS, greedy):
            assert [int(r.packed[0]) for r in recs] == _hf_greedy(lm, prompt, 8), prompt
        for compiled, uncompiled in zip(sampled, _run(plain, lm, s, [7, 8])):
            assert [int(r.packed[0]) for r in compiled] == [int(r.packed[0]) for r in uncompiled]
            torch.testing.assert_close(torch.tensor([r.packed for r in compiled]),
                                       torch.tensor([r.packed for r in uncompiled]), atol=1e-4, rtol=1e-4)
    finally:
        eng.close()


def test_a_compile_that_fails_leaves_the_uncompiled_step_serving(monkeypatch, caplog):
    lm = load_model("random-llama-tiny")

    def broken(*a, **k):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(torch, "compile", broken)
    eng = Engine(lm, slots=2, max_len=64, use_graphs=False, compile=True)
    try:
        assert not eng.wait_compiled(60)
        assert eng.compile_state.startswith("failed: RuntimeError: no compiler here")
        out = _run(eng, lm, SamplingSettings(temperature=0.0), [0, 0], n=4)
        assert [[int(r.packed[0]) for r in recs] for recs in out] == [_hf_greedy(lm, p, 4) for p in PROMPTS]
        assert eng.stats.compiled_steps == 0
        assert "uncompiled step goes on serving" in caplog.text  # logged as a warning
    finally:
        eng.close()

