"""Presence and frequency penalties, OpenAI's definitions as vLLM applies them:
logit[t] -= presence * (count[t] > 0) + frequency * count[t], count over the tokens GENERATED so far in
the request (the prompt does not count, unlike transformers' repetition penalty), after the repetition
penalty and before temperature. transformers has no processor for them, so every reference here is
that formula written out by hand over transformers' own logits (AutoModelForCausalLM's forward).
"""

import collections
import json
import threading
import time

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from conftest import DEFAULT
from model_core.core.errors import SettingsError
from model_core.core.registry import REGISTRY, convert_gguf
from model_core.core.sampling import SamplingSettings, apply_sampling
from model_core.serving.batch_sampling import ALL_STAGES, RowSettings, sample_rows, stages_in_use
from model_core.serving.engine import engine_for
from model_core.serving.generate import generate, sample_step
from tests.helpers.penalty_reference import by_hand, hand_greedy

# a prompt the default model continues by repeating itself under plain greedy decoding
REPEATING = "I like cats. I like cats. I like cats. I like"


@pytest.fixture(scope="module")
def hf_model():
    """The default model as transformers itself loads it (not lmscope's loaded copy)."""
    return AutoModelForCausalLM.from_pretrained(convert_gguf(REGISTRY[DEFAULT]), dtype=torch.float32).eval()


def _wait(cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("presence,frequency", [(0.7, 0.0), (0.0, 0.45), (0.7, 0.45), (-1.0, -0.3), (2.0, 2.0)])
def test_the_stage_is_the_formula_over_the_generated_tokens_only(default_lm, hf_model, presence, frequency):
    prompt = default_lm.tokenizer("The cat sat on the mat because the cat")["input_ids"]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1].float()
    g = torch.Generator().manual_seed(0)
    likely = torch.topk(logits, 12).indices  # where moving a logit changes what is drawn
    generated = likely[torch.randint(0, 12, (30,), generator=g)].tolist()  # repeats: 30 draws of 12
    counts = collections.Counter(generated)
    assert max(counts.values()) > 2 and len(counts) > 1
    prompt_only = [t for t in set(prompt) if t not in counts]
    assert prompt_only  # tokens the repetition penalty sees and these penalties must not

    for rep in (1.0, 1.3):
        s = SamplingSettings(temperature=0.7, repetition_penalty=rep, presence_penalty=presence,
                             frequency_penalty=frequency)
        res = apply_sampling(logits, s, context_ids=prompt + generated, generated_ids=generated)
        names = [st.name for st in res.stages]
        assert names[:4] == ["raw", "repetition_penalty", "presence_frequency_penalty", "temperature"]
        entering = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([prompt + generated]), logits[None].clone())[0]
        stage = res.stages[2]
        want = by_hand(entering, generated, presence, frequency)
        torch.testing.assert_close(stage.logits, want, atol=1e-5, rtol=0)
        assert torch.equal(stage.logits[prompt_only], entering[prompt_only])  # the prompt does not count
        assert stage.n_removed == 0 and stage.kept_mass == 1.0  # it moves logits, removes none
        torch.testing.assert_close(res.stages[3].logits, want / 0.7, atol=1e-5, rtol=0)  # then temperature

    # the single-request generation path: its greedy pick is the formula's argmax
    s = SamplingSettings(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency)
    chosen, _, final = sample_step(logits, s, None, (0, 0), generated_ids=torch.tensor(generated))
    assert int(chosen[0]) == int(torch.argmax(by_hand(logits, generated, presence, frequency)))
    # off: no stage, nothing changed
    off = apply_sampling(logits, SamplingSettings(temperature=0.7), context_ids=prompt, generated_ids=generated)
    assert "presence_frequency_penalty" not in [st.name for st in off.stages]


ROWS = [  # (settings, seed): different penalties per row, greedy and sampled
    (SamplingSettings(temperature=0.0, presence_penalty=1.5), 1),
    (SamplingSettings(temperature=0.0, frequency_penalty=0.8, repetition_penalty=1.2), 2),
    (SamplingSettings(temperature=0.8, top_k=40, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5), 3),
    (SamplingSettings(temperature=1.2, min_p=0.05, presence_penalty=-0.7, frequency_penalty=0.3), 4),
    (SamplingSettings(temperature=0.0), 5),  # no penalty, batched with rows that have them
]


def _reference(s: SamplingSettings, logits, context, generated):
    """transformers' processors, with the formula by hand between the repetition penalty and temperature."""
    x = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(context[None], logits[None].clone())[0]
    x = by_hand(x, generated, s.presence_penalty, s.frequency_penalty)
    if s.greedy:
        return torch.full_like(x, float("-inf")).scatter(0, x.argmax()[None], x.max()[None])
    procs = [TemperatureLogitsWarper(s.temperature)]
    procs += [TopKLogitsWarper(s.top_k)] if s.top_k else []
    procs += [TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []
    procs += [MinPLogitsWarper(s.min_p)] if s.min_p else []
    return LogitsProcessorList(procs)(context[None], x[None])[0]


def test_a_batched_step_with_per_row_penalties_equals_the_single_row_path():
    g = torch.Generator().manual_seed(0)
    B, V = len(ROWS), 3000
    logits = torch.randn(B, V, generator=g) * 4
    prompts = [torch.randint(0, V, (15,), generator=g) for _ in range(B)]
    # generated ids with repeats, among each row's likeliest tokens (where the penalties decide the pick)
    gens = [torch.topk(logits[i], 8).indices[torch.randint(0, 8, (20,), generator=g)] for i in range(B)]
    st = RowSettings.empty(B, "cpu", V)
    seen = torch.zeros(B, V, dtype=torch.bool)
    for i, ((s, seed), p, gen) in enumerate(zip(ROWS, prompts, gens)):
        st.set_row(i, s, seed)
        st.step[i] = 20
        seen[i, torch.cat([p, gen])] = True
        st.counts[i].scatter_add_(0, gen, torch.ones(len(gen)))  # what the decode step keeps per token
    used = stages_in_use(s for s, _ in ROWS)
    assert "presence_frequency" in used and "presence_frequency" in ALL_STAGES
    chosen, packed, final = sample_rows(logits, st, seen, k=10, stages=used)
    full = sample_rows(logits, st, seen, k=10)
    assert all(torch.equal(a, b) for a, b in zip(full, (chosen, packed, final)))
    for i, ((s, seed), p, gen) in enumerate(zip(ROWS, prompts, gens)):
        ctx = torch.cat([p, gen])
        torch.testing.assert_close(final[i], _reference(s, logits[i], ctx, gen), atol=1e-5, rtol=0)
        one_chosen, one_packed, one_final = sample_step(logits[i], s, ctx, (seed, 20), k=10, generated_ids=gen)
        assert int(chosen[i]) == int(one_chosen[0]), s
        assert torch.equal(final[i], one_final), s  # one expression on both paths: the same rounding
        torch.testing.assert_close(packed[i], one_packed, atol=1e-6, rtol=1e-6)
    # the penalties decide a pick here (else this test could not tell them from nothing)
    st0 = RowSettings.empty(B, "cpu")
    for i, (s, seed) in enumerate(ROWS):
        st0.set_row(i, SamplingSettings(**{**s.to_dict(), "presence_penalty": 0.0, "frequency_penalty": 0.0}), seed)
        st0.step[i] = 20
    plain = sample_rows(logits, st0, seen, k=10)[0]
    assert not torch.equal(plain[:4], chosen[:4])


def test_the_engine_batched_equals_each_request_alone_and_the_formula(default_lm, hf_model, monkeypatch):
    """Requests with different penalties decoded together by the engine (each row's counts kept on the
    device, a token a step) give what each gives on its own forwards; the greedy ones equal the
    hand-written loop over transformers' logits."""
    lm, n = default_lm, 12
    prompts = [REPEATING, "The capital of France is Paris. The capital of", "1, 2, 3, 4, 5,",
               "Once upon a time, there was a little", "Water boils at"]
    eng = engine_for(lm)
    before = dict(eng.stats.batch_sizes)

    def one(i):
        s, seed = ROWS[i]
        return generate(lm, prompts[i], max_new_tokens=n, settings=s, seed=seed, ignore_eos=True)

    out = [None] * len(ROWS)
    with eng.hold():  # all admitted at the same step
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(i))) for i in range(len(ROWS))]
        for t in threads:
            t.start()
        _wait(lambda: eng.waiting() == len(ROWS), "the requests to queue")
    for t in threads:
        t.join(180)
    assert eng.stats.batch_sizes.get(len(ROWS), 0) - before.get(len(ROWS), 0) >= n - 1  # they ran together
    # again, in slots those rows left with counts of their own: a new row starts from none
    assert [one(i).token_ids for i in (0, 1)] == [out[0].token_ids, out[1].token_ids]
    monkeypatch.setenv("LMSCOPE_ENGINE", "0")
    for i, ((s, _), g) in enumerate(zip(ROWS, out)):
        solo = one(i)  # the request's own forwards
        assert g.token_ids == solo.token_ids, s
        if s.greedy:
            want = hand_greedy(hf_model, g.prompt_ids, n, s.presence_penalty, s.frequency_penalty)
            if s.repetition_penalty == 1.0:  # (the hand loop has no repetition penalty)
                assert g.token_ids == want, s
    # the penalties changed what the greedy rows produced
    assert out[0].token_ids != hand_greedy(hf_model, out[0].prompt_ids, n, 0.0, 0.0)


def test_cli_greedy_with_a_frequency_penalty_is_the_hand_written_loop(default_lm, hf_model, capsys, monkeypatch):
    """On the engine (the CLI's default) and on the request's own forwards (LMSCOPE_ENGINE=0)."""
    from app.server.cli import main

    n = 24

    def cli(*extra):
        assert main(["generate", REPEATING, "--max-new-tokens", str(n), "--temperature", "0", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["runs"][0]

    plain, pen = cli(), cli("--frequency-penalty", "1.5", "--presence-penalty", "0.25")
    assert pen["settings"]["frequency_penalty"] == 1.5 and pen["settings"]["presence_penalty"] == 0.25
    assert plain["settings"]["frequency_penalty"] == 0.0 and plain["settings"]["presence_penalty"] == 0.0
    prompt = pen["prompt_token_ids"]
    assert len(plain["token_ids"]) == len(pen["token_ids"]) == n  # no EOS in the way
    assert plain["token_ids"] == hand_greedy(hf_model, prompt, n, 0.0, 0.0)
    assert pen["token_ids"] == hand_greedy(hf_model, prompt, n, 0.25, 1.5)
    # nothing generated yet at the first step, so nothing to penalise: the first token is plain greedy's
    # (counting the prompt, which repeats "cats" three times, would change it), and they part later
    assert pen["token_ids"][0] == plain["token_ids"][0]
    assert pen["token_ids"] != plain["token_ids"]
    monkeypatch.setenv("LMSCOPE_ENGINE", "0")
    assert cli("--frequency-penalty", "1.5", "--presence-penalty", "0.25")["token_ids"] == pen["token_ids"]


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 2.5, -2.01, "abc", True])
def test_bad_penalties_are_one_sentence(field, value):
    with pytest.raises(SettingsError) as e:
        if value is True:
            SamplingSettings(**{field: value}).validated()
        else:
            SamplingSettings.from_values(**{field: value})
    msg = str(e.value)
    assert field in msg and msg.endswith(".") and "\n" not in msg and msg.count(". ") == 0
    assert SamplingSettings.from_values(**{field: 2}).validated()  # the ends of [-2, 2] are allowed
    assert SamplingSettings.from_values(**{field: "-2"}).validated()


@pytest.mark.parametrize("flag,value", [("--presence-penalty", "nan"), ("--frequency-penalty", "3"),
                                        ("--frequency-penalty", "-inf")])
def test_cli_refuses_bad_penalties_before_anything_runs(flag, value, capsys):
    from app.server.cli import main

    # a model that does not exist: the penalty's sentence, not the model's, shows nothing was loaded
    assert main(["generate", "hi", "--model", "no-such-model-anywhere", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and flag[2:].replace("-", "_") in err and "model" not in err.lower()
    assert main(["generate", "hi", "--num-beams", "2", "--presence-penalty", "0.5"]) == 2
    assert "apply to sampling" in capsys.readouterr().err


def test_generate_refuses_bad_penalties(default_lm):
    with pytest.raises(SettingsError, match="frequency_penalty"):
        generate(default_lm, "hi", max_new_tokens=2, settings=SamplingSettings(frequency_penalty=float("nan")))
