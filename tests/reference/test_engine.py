"""The inference engine (model_core.serving.engine): continuous batching over a slot cache, sampling and
records per row on the device.

References:
- transformers' logits processors (RepetitionPenalty, Temperature, TopK, TopP, MinP) applied to
  one row at a time: every row of a batched step, each with its own settings, must give exactly
  their distribution;
- transformers' `model.generate(do_sample=False)` run alone on each prompt: greedy tokens of
  generations that ran together in the engine must equal it token for token;
- lmscope's own path without the engine (LMSCOPE_ENGINE=0, one request's plain forwards): the
  same seed must draw the same tokens, alone or in a batch.
The engine's step counters prove the requests really ran together (else the test is vacuous).
"""

import os
import threading
import time

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from conftest import DEFAULT
from model_core import load_model
from model_core.core.cpu_threads import REQUEST_NICE
from model_core.core.sampling import SamplingSettings
from model_core.serving.batch_sampling import ALL_STAGES, RowSettings, sample_rows, stages_in_use
from model_core.serving.engine import EngineRequest, engine_for
from model_core.serving.generate import generate, iter_generate, sample_step

PROMPTS = ["The capital of France is", "Once upon a time, there was a little",
           "def add(a, b):\n    return", "Water boils at"]

ROW_SETTINGS = [
    SamplingSettings(temperature=0.0),
    SamplingSettings(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    SamplingSettings(temperature=1.5, top_p=0.8),
    SamplingSettings(temperature=1.0, top_k=5),
    SamplingSettings(temperature=0.9, min_p=0.2, repetition_penalty=0.8),
    SamplingSettings(temperature=0.0, repetition_penalty=1.5),
]


def _hf(s: SamplingSettings) -> LogitsProcessorList:
    procs = [RepetitionPenaltyLogitsProcessor(s.repetition_penalty)] if s.repetition_penalty != 1.0 else []
    if not s.greedy:
        procs.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k > 0:
            procs.append(TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            procs.append(TopPLogitsWarper(s.top_p))
        if s.min_p > 0:
            procs.append(MinPLogitsWarper(s.min_p))
    return LogitsProcessorList(procs)


def _hf_greedy(lm, prompt, n):
    ids = lm.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=n, pad_token_id=lm.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def test_every_row_of_a_batched_step_equals_transformers_processors_on_that_row():
    g = torch.Generator().manual_seed(0)
    B, V = len(ROW_SETTINGS), 3000
    logits = torch.randn(B, V, generator=g) * 4
    context = [torch.randint(0, V, (20,), generator=g) for _ in range(B)]
    seen = torch.zeros(B, V, dtype=torch.bool)
    st = RowSettings.empty(B, "cpu")
    for i, (s, ctx) in enumerate(zip(ROW_SETTINGS, context)):
        seen[i, ctx] = True
        st.set_row(i, s, seed=100 + i)
        st.step[i] = 7
    chosen, packed, final = sample_rows(logits, st, seen, k=10)
    for i, (s, ctx) in enumerate(zip(ROW_SETTINGS, context)):
        ref = _hf(s)(ctx[None], logits[i: i + 1].clone())[0]
        if s.greedy:  # generate(do_sample=False) keeps the argmax alone
            ref = torch.full_like(ref, float("-inf")).scatter(0, ref.argmax()[None], ref.max()[None])
        assert torch.equal(final[i], ref), s
        # the single-request path (generate.sample_step) records exactly the same numbers
        one_chosen, one_packed, _ = sample_step(logits[i], s, ctx, (100 + i, 7), k=10)
        assert int(chosen[i]) == int(one_chosen[0])
        torch.testing.assert_close(packed[i], one_packed, atol=1e-6, rtol=1e-6)
        assert final[i][chosen[i]] > float("-inf")  # drawn from the filtered distribution


@pytest.mark.parametrize("rows", [[0, 5], [0], [2, 4], [3]])
def test_skipping_the_stages_no_row_uses_changes_nothing(rows):
    """The eager engine skips stages every row has off; the result must be the full pipeline's."""
    g = torch.Generator().manual_seed(1)
    settings = [ROW_SETTINGS[i] for i in rows]
    logits = torch.randn(len(rows), 3000, generator=g) * 4
    seen = torch.rand(len(rows), 3000, generator=g) < 0.01
    st = RowSettings.empty(len(rows), "cpu")
    for i, s in enumerate(settings):
        st.set_row(i, s, seed=i)
    full = sample_rows(logits, st, seen, k=10)
    some = sample_rows(logits, st, seen, k=10, stages=stages_in_use(settings))
    assert stages_in_use(settings) != ALL_STAGES
    for a, b in zip(full, some):
        assert torch.equal(a, b)


def test_seeded_draws_follow_the_distribution():
    """Gumbel-max over the counter-based uniforms samples from softmax(logits): the frequencies
    over 4,000 seeds match the probabilities (the draw is not biased by the hash)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).repeat(4000, 1)
    st = RowSettings.empty(4000, "cpu")
    st.greedy[:] = False
    st.seed.copy_(torch.arange(4000) * 7919 + 3)
    chosen, _, _ = sample_rows(logits, st, torch.zeros(4000, 5, dtype=torch.bool), k=3)
    freq = torch.bincount(chosen, minlength=5).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.025, rtol=0)


@pytest.mark.parametrize("name", [DEFAULT, "random-llama-tiny", "random-gpt2-tiny", "random-gemma3-tiny"])
def test_generations_that_ran_together_equal_transformers_generate_alone(name):
    """random-gemma3-tiny: three sliding-window layers of 6 positions and one global, prompts of 14-36
    tokens and 10 more: past the window, where transformers' own cache drops old positions."""
    lm = load_model(name)
    eng = engine_for(lm)
    n_new = 10
    steps_before = dict(eng.stats.batch_sizes)
    out = [None] * len(PROMPTS)
    with eng.hold():  # all four are admitted at the same step
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(
            i, generate(lm, PROMPTS[i], max_new_tokens=n_new, ignore_eos=True))) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        _wait(lambda: eng.waiting() == len(PROMPTS), "the requests to queue")
    for t in threads:
        t.join(120)
    together = eng.stats.batch_sizes.get(len(PROMPTS), 0) - steps_before.get(len(PROMPTS), 0)
    assert together >= n_new - 1, eng.stats.batch_sizes  # every decode step ran all four rows
    for prompt, g in zip(PROMPTS, out):
        assert g.token_ids == _hf_greedy(lm, prompt, n_new), prompt


def test_seeded_sampling_is_the_same_alone_batched_and_without_the_engine(monkeypatch):
    lm = load_model(DEFAULT)
    s = SamplingSettings(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1)
    eng = engine_for(lm)

    def one(i):
        return generate(lm, PROMPTS[i], max_new_tokens=8, settings=s, seed=i, ignore_eos=True)

    out = [None] * 3
    with eng.hold():
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(i))) for i in range(3)]
        for t in threads:
            t.start()
        _wait(lambda: eng.waiting() == 3, "the requests to queue")
    for t in threads:
        t.join(120)
    monkeypatch.setenv("LMSCOPE_ENGINE", "0")
    for i, g in enumerate(out):
        solo = one(i)  # lmscope's plain path: one request, its own DynamicCache
        assert g.token_ids == solo.token_ids  # the same seeded draws
        for a, c in zip(g.steps, solo.steps):
            assert a.top_ids == c.top_ids and a.removed.keys() == c.removed.keys()
            torch.testing.assert_close(torch.tensor(a.top_probs), torch.tensor(c.top_probs), atol=1e-4, rtol=1e-3)


def test_cancel_and_disconnect_free_the_slot():
    lm = load_model("random-llama-tiny")
    eng = engine_for(lm)
    it = iter_generate(lm, "abc", max_new_tokens=200, ignore_eos=True)
    next(it), next(it)
    assert eng.stats_dict()["slots_in_use"] == 1
    it.close()  # the client went away
    _wait(lambda: eng.stats_dict()["slots_in_use"] == 0, "the slot to be freed")
    stop = threading.Event()
    it = iter_generate(lm, "abc", max_new_tokens=200, ignore_eos=True, should_stop=stop)
    next(it)
    stop.set()  # the Stop button
    rest = list(it)
    assert rest == [] or rest[-1][1].finish_reason == "cancelled"
    _wait(lambda: eng.stats_dict()["slots_in_use"] == 0, "the slot to be freed")


def test_a_failing_request_does_not_fail_its_batch_mates():
    lm = load_model("random-llama-tiny")
    eng = engine_for(lm)
    s = SamplingSettings(temperature=0.0)
    good = [EngineRequest(ids=lm.tokenizer(p)["input_ids"], n_steps=6, settings=s, seed=0, eos=set()) for p in PROMPTS[:2]]
    bad = EngineRequest(ids=[10 ** 9], n_steps=6, settings=s, seed=0, eos=set())  # no such token
    with eng.hold():
        for r in (good[0], bad, good[1]):
            eng.submit(r)
    for r in good:
        recs = _drain(r)
        assert r.error is None and len(recs) == 6
        assert [int(x.packed[0]) for x in recs] == _hf_greedy(lm, PROMPTS[good.index(r)], 6)
    assert _drain(bad) == [] and bad.error is not None


def test_a_record_that_fails_to_convert_fails_only_its_request():
    """EngineRequest.convert runs on the engine thread (generate turns records into steps there): one
    that raises ends its own request with that error; the batch-mate sharing the launch goes on."""
    lm = load_model("random-llama-tiny")
    eng = engine_for(lm)
    s = SamplingSettings(temperature=0.0)

    def breaks_at_third(rec):
        if rec.index == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer that cannot decode this")
        return rec

    good = EngineRequest(ids=lm.tokenizer(PROMPTS[0])["input_ids"], n_steps=6, settings=s, seed=0, eos=set())
    bad = EngineRequest(ids=lm.tokenizer(PROMPTS[1])["input_ids"], n_steps=6, settings=s, seed=0, eos=set(),
                        convert=breaks_at_third)
    with eng.hold():
        eng.submit(good), eng.submit(bad)
    assert [int(x.packed[0]) for x in _drain(good)] == _hf_greedy(lm, PROMPTS[0], 6) and good.error is None
    assert len(_drain(bad)) == 2 and isinstance(bad.error, UnicodeDecodeError)
    _wait(lambda: eng.stats_dict()["slots_in_use"] == 0, "the failed request's slot to be freed")


def _drain(req, timeout=120):
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = req.out.get(timeout=timeout)
        if rec is None:
            return out
        out.append(rec)
    raise AssertionError("the request never finished")


def _wait(cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_several_steps_per_launch_equal_transformers_generate_alone():
    """A launch of several decode steps (as a CUDA graph runs them; eager here): rows whose lengths
    end mid-launch stop there, a row that arrives later joins between launches, and each step's kept
    logits are that step's (greedy: their argmax is the token drawn)."""
    from model_core.serving.engine import Engine

    lm = load_model(DEFAULT)
    eng = Engine(lm, slots=4, max_len=64, use_graphs=False, compile=False, steps_per_launch=3)
    eng.lookahead = 1  # as on a GPU: a launch's records are handed out after the next launch
    try:
        lengths = [4, 7, 9]  # 1 from the prefill, then launches of 3
        reqs = [EngineRequest(ids=lm.tokenizer(p)["input_ids"], n_steps=n, settings=SamplingSettings(temperature=0.0),
                              seed=0, eos=set(), keep_logits=True) for p, n in zip(PROMPTS, lengths)]
        with eng.hold():
            for r in reqs:
                eng.submit(r)
        first = reqs[2].out.get(timeout=120)  # running: the late one joins between launches
        late = eng.submit(EngineRequest(ids=lm.tokenizer(PROMPTS[3])["input_ids"], n_steps=8,
                                        settings=SamplingSettings(temperature=0.0), seed=0, eos=set()))
        recs = [_drain(r) for r in reqs]
        recs[2].insert(0, first)
        recs.append(_drain(late))
        for prompt, n, got in zip(PROMPTS, lengths + [8], recs):
            assert [int(x.packed[0]) for x in got] == _hf_greedy(lm, prompt, n), prompt
            assert [x.index for x in got] == list(range(n))
            p = len(lm.tokenizer(prompt)["input_ids"])  # each record: the cache once its token is fed back
            assert [x.tokens_cached for x in got] == list(range(p, p + n)), prompt
        for got in recs[:3]:
            assert [int(x.logits.argmax()) for x in got] == [int(x.packed[0]) for x in got]
        assert eng.stats.steps % 3 == 0 and eng.stats.tokens == sum(lengths) + 8 - 4  # prefills' tokens aside
    finally:
        eng.close()


def test_prefills_padded_to_their_bucket_equal_transformers_generate_alone():
    """What a captured prefill computes (model_core.serving.cuda_prefill_graphs: rows right-padded to the bucket's
    length and row count, each row's last hidden state through the adapter's unembedding), run
    eagerly on the CPU: each generation equals transformers' generate alone, with buckets filled in
    part (3 rows in a bucket of 4, prompts of 6-11 tokens in one of 32) and exactly (one row)."""
    from model_core.serving.cuda_prefill_graphs import PrefillGraphs
    from model_core.serving.engine import Engine

    lm = load_model(DEFAULT)
    eng = Engine(lm, slots=4, max_len=64, use_graphs=False, compile=False)
    try:
        assert eng.ready.wait(120)
        graphs = PrefillGraphs(lm, [1, 2, 4], eng.max_len)
        graphs.capture()
        eng._prefill_graphs = graphs
        reqs = [EngineRequest(ids=lm.tokenizer(p)["input_ids"], n_steps=5, settings=SamplingSettings(temperature=0.0),
                              seed=0, eos=set()) for p in PROMPTS[:3]]
        with eng.hold():
            for r in reqs:
                eng.submit(r)
        got = [[int(x.packed[0]) for x in _drain(r)] for r in reqs]
        alone = eng.submit(EngineRequest(ids=lm.tokenizer(PROMPTS[3])["input_ids"], n_steps=5,
                                         settings=SamplingSettings(temperature=0.0), seed=0, eos=set()))
        got.append([int(x.packed[0]) for x in _drain(alone)])
        assert eng.stats.captured_prefills == 2
        assert got == [_hf_greedy(lm, p, 5) for p in PROMPTS[:4]]
    finally:
        eng.close()


def test_prefill_graphs_leave_an_unloaded_model_to_be_freed():
    """The engine holds its model weakly (an unloaded model is freed and its engine closed by a
    finalizer); its captured prefills must not hold it either."""
    import copy
    import gc
    import weakref

    from model_core.serving.cuda_prefill_graphs import PrefillGraphs

    lm = copy.copy(load_model("random-llama-tiny"))  # a model object of this test's own, not the registry's
    graphs = PrefillGraphs(lm, [1, 2], 64)
    graphs.capture()
    gone = weakref.ref(lm)
    del lm
    gc.collect()
    assert gone() is None and graphs.graphs


def test_recorded_cpu_steps_replay_the_eager_step(monkeypatch):
    """model_core.serving.torchscript_replay: the decode step recorded once per bucket (TorchScript, on scratch
    buffers) and replayed on the live ones, and each prompt's prefill padded to its length bucket
    and replayed. References: transformers' `generate(do_sample=False)` alone per prompt (greedy
    rows), lmscope's plain path without the engine (the same seed draws the same tokens); the replay
    counters prove the recordings ran, not the eager calls."""
    from model_core.serving.cuda_prefill_graphs import CPU_LENGTHS
    from model_core.serving.engine import GREEDY_ONLY, Engine

    lm = load_model(DEFAULT)
    eng = Engine(lm, slots=4, max_len=256, record_steps=True)
    eng.ready.wait()
    try:
        L = eng._length_buckets[0]
        prefills = {("prefill", 1, next(t for t in CPU_LENGTHS if t >= len(lm.tokenizer(p).input_ids)))
                    for p in PROMPTS}
        eng._recorded.want([("step", 4, L, GREEDY_ONLY), ("step", 4, L, ALL_STAGES), *sorted(prefills)])
        assert eng._recorded.wait_recorded(300), eng._recorded.stats()
        assert eng._recorded.stats()["buckets"] == 2 + len(prefills), eng._recorded.stats()  # none fell back to eager
        # the recording thread yields to the engine's, which serves eagerly meanwhile (model_core.core.cpu_threads)
        assert os.getpriority(os.PRIO_PROCESS, eng._recorded._thread.native_id) >= REQUEST_NICE
        monkeypatch.setitem(lm.meta, "engine", eng)
        s = SamplingSettings(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1)
        n_new, out = 8, [None] * len(PROMPTS)

        def one(i):  # rows 0-1 greedy, rows 2-3 seeded sampling: one replayed bucket runs all four
            if i < 2:
                return generate(lm, PROMPTS[i], max_new_tokens=n_new, ignore_eos=True)
            return generate(lm, PROMPTS[i], max_new_tokens=n_new, settings=s, seed=i, ignore_eos=True)

        before = dict(eng._recorded.replays)
        with eng.hold():
            threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(i))) for i in range(len(PROMPTS))]
            for t in threads:
                t.start()
            _wait(lambda: eng.waiting() == len(PROMPTS), "the requests to queue")
        for t in threads:
            t.join(120)
        replayed = {k: eng._recorded.replays.get(k, 0) - before.get(k, 0) for k in ("step", "prefill")}
        assert replayed["step"] >= n_new - 1 and replayed["prefill"] == len(PROMPTS), eng._recorded.stats()
        for i in range(2):
            assert out[i].token_ids == _hf_greedy(lm, PROMPTS[i], n_new), PROMPTS[i]
        monkeypatch.setenv("LMSCOPE_ENGINE", "0")
        for i in range(2, len(PROMPTS)):
            assert out[i].token_ids == one(i).token_ids, PROMPTS[i]
    finally:
        eng.close()
