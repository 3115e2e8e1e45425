"""model_core.serving.speculative on a tiny random Llama (the mechanics; tests/reference/test_speculative.py
checks the real default model through the CLI): prompt lookup proposes what followed the latest earlier
occurrence of the text's tail; greedy speculative decoding with prompt lookup, with a draft model that is
always wrong, one right some of the time, and with the target as its own draft (always right) returns transformers' `generate`
greedy tokens, and the step records add up; bad settings and another tokenizer are one sentence."""

from __future__ import annotations

import pytest
import torch

from model_core import load_model
from model_core.core.errors import SettingsError
from model_core.serving import speculative as S

TINY = "random-llama-tiny"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny random Llama whose greedy text depends on its context (weights at std 0.2: the default
    0.02 repeats one token whatever came before, which would hide a stale cache), and two drafts on
    its tokenizer: the same model with its unembedding rows rolled by one (it proposes the token next
    to the target's choice: always rejected, so both caches crop after every step) and the same
    model with noise in its weights (right some of the time)."""
    base = load_model(TINY)
    config = type(base.model.config).from_dict(base.model.config.to_dict())
    config.initializer_range = 0.2
    root = tmp_path_factory.mktemp("spec")
    torch.manual_seed(0)
    target = type(base.model)(config).eval()
    for name in ("target", "wrong", "noisy"):
        target.save_pretrained(root / name)
        base.tokenizer.save_pretrained(root / name)
    lm, wrong, noisy = (load_model(str(root / n)) for n in ("target", "wrong", "noisy"))
    head = wrong.model.get_output_embeddings()  # a new tensor: the input embeddings may share the old one
    head.weight = torch.nn.Parameter(torch.roll(head.weight.detach().clone(), 1, 0), requires_grad=False)
    with torch.no_grad():
        for p in noisy.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.01)
    return lm, wrong, noisy


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    pl = S.PromptLookup()
    assert pl.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 4) == [7, 8, 1, 2]  # the latest 3-gram match
    assert pl.propose([5, 6, 7, 6], 3) == [7, 6]  # no 3- or 2-gram recurs; the 1-gram 6 did, at 1
    assert pl.propose([1, 2, 3, 4], 3) == []  # nothing recurs: nothing proposed
    assert pl.propose([4, 4, 4, 4], 2) == [4]  # the tail's own occurrence is not a match; 4,4,4 at 0 is


def _reference(lm, ids, n):
    """transformers' own greedy `generate` (no EOS stop, so the lengths are equal)."""
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("draft_kind", ["lookup", "wrong", "noisy", "self"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_speculative_greedy_is_transformers_greedy(models, draft_kind, k, monkeypatch):
    lm, wrong, noisy = models
    monkeypatch.setattr(S, "eos_ids", lambda _lm: [])  # run to the length: no EOS in the way
    ids = lm.tokenizer("the cat sat on the mat and the cat sat on the")["input_ids"]  # lookup finds "the"
    n = 24
    draft = {"lookup": S.PromptLookup(), "wrong": S.DraftModel(wrong), "noisy": S.DraftModel(noisy),
             "self": S.DraftModel(lm)}[draft_kind]
    got = S.speculative_greedy(lm, ids, n, draft, k=k)
    want = _reference(lm, ids, n)
    assert got.token_ids == want
    assert S.plain_greedy(lm, ids, n).token_ids == want
    # the records: each step adds its accepted proposals and the target's own token; the prefill the first
    assert 1 + sum(s.accepted + 1 for s in got.steps) == n == len(got.token_ids)
    for s in got.steps:
        assert got.token_ids[s.at:s.at + s.accepted] == s.proposed[:s.accepted]
        assert got.token_ids[s.at + s.accepted] == s.token
        assert len(s.proposed) <= k
    if draft_kind == "self":  # the target as its own draft is never wrong
        assert got.accepted == got.proposed > 0 and got.target_forwards < n
    if draft_kind == "wrong":
        assert got.accepted == 0 < got.proposed and len(got.steps) == n - 1
    if draft_kind == "noisy":
        assert 0 < got.accepted < got.proposed


def test_bad_settings_and_another_tokenizer_are_one_sentence(models, tmp_path):
    lm = models[0]
    for k in (0, 33, -1, 2.5, True, "4"):
        with pytest.raises(SettingsError, match="whole number from 1 to 32"):
            S.check_k(k)
    with pytest.raises(SettingsError, match="max_new_tokens"):
        S.speculative_greedy(lm, [1, 2, 3], 0, S.PromptLookup(), k=2)
    default = load_model("smollm2-135m-instruct")
    with pytest.raises(SettingsError, match="another tokenizer") as e:
        S.check_draft(default, lm)
    assert "\n" not in str(e.value)


def test_a_draft_model_after_a_rejection_proposes_its_own_greedy_text(models):
    """The draft's cache keeps what it saw; after the target rejected its proposal the next proposal
    is still the draft's greedy continuation of the text as it now stands (transformers' `generate`
    on that text from scratch), not of the text it had guessed."""
    _, _, noisy = models
    draft = S.DraftModel(noisy)
    context = noisy.tokenizer("the cat sat on the mat")["input_ids"]
    first = draft.propose(context, 4)
    assert first == _reference(noisy, context, 4)
    other = (first[0] + 7) % noisy.model.config.vocab_size  # the target chose another first token
    context = context + [other]
    assert draft.propose(context, 4) == _reference(noisy, context, 4)
    context = context + draft.propose(context, 4)[:2] + [5]  # two kept, then a correction
    assert draft.propose(context, 3) == _reference(noisy, context, 3)


def test_the_first_layers_draft_is_transformers_own_cut_and_leaves_the_target_whole(models, tmp_path):
    """first_layers(lm, n) computes what transformers computes for the same checkpoint loaded with
    num_hidden_layers=n (the later layers dropped), and the target keeps every layer."""
    from transformers import AutoModelForCausalLM

    lm = models[0]
    total = lm.shape.n_layers
    ids = torch.tensor([lm.tokenizer("the cat sat")["input_ids"]])
    draft = S.first_layers(lm, total - 1)
    lm.model.save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, num_hidden_layers=total - 1).eval()
    with torch.no_grad():
        assert torch.allclose(draft.model(ids).logits, reference(ids).logits, atol=1e-5)
        assert len(lm.model.model.layers) == total
        assert not torch.allclose(lm.model(ids).logits, draft.model(ids).logits)
    for n in (0, total, 1.5, True):
        with pytest.raises(SettingsError, match=f"from 1 to {total - 1}"):
            S.first_layers(lm, n)
