"""model_core.interp.model_diff on a tiny random Llama (the mechanics; tests/integration/test_model_diff.py
checks the real default model against transformers): a model against itself is exactly 0 everywhere;
with one head's output zeroed (its o_proj columns) the two models agree exactly up to that layer's
patterns and part after it; tokenizers that differ are refused before any forward."""

from __future__ import annotations

import pytest
import torch

from model_core import load_model
from model_core.core.errors import SettingsError
from model_core.interp import model_diff as D

TINY = "random-llama-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny model saved twice by transformers, the second with head 1 of layer 0 zeroed."""
    lm = load_model(TINY)
    root = tmp_path_factory.mktemp("diff")
    for name in ("same", "ablated"):
        lm.model.save_pretrained(root / name)
        lm.tokenizer.save_pretrained(root / name)
    ablated = load_model(str(root / "ablated"))
    head_dim = lm.shape.d_model // lm.shape.n_heads
    with torch.no_grad():
        ablated.model.model.layers[0].self_attn.o_proj.weight[:, head_dim: 2 * head_dim] = 0
    return load_model(str(root / "same")), ablated


def test_a_model_against_itself_is_exactly_zero(pair):
    same, _ = pair
    d = D.diff_prompt(same, same, PROMPT)
    assert set(d.kl) == {0.0} and all(p is None for p in d.parted_at)
    assert all(v == 0.0 for row in d.head_js for v in row) and all(v == 0.0 for row in d.resid_diff for v in row)
    assert d.gained == [[] for _ in d.tokens] and d.lens["base"] == d.lens["tuned"]


def test_a_zeroed_head_parts_the_streams_after_its_layer(pair):
    same, ablated = pair
    d = D.diff_prompt(same, ablated, PROMPT)
    # layer 0's own patterns are computed before its output: unchanged; every later layer reads the change
    assert d.head_js[0] == [0.0] * same.shape.n_heads
    assert all(max(row) > 0 for row in d.head_js[1:])
    assert set(d.resid_diff[0]) == {0.0}  # the embeddings
    assert min(d.resid_diff[1]) > 0  # after layer 0, at every position (each attends at least to itself)
    assert set(d.parted_at) <= {1} and max(d.kl) > 0
    # KL by hand from the two models' own logits
    ids = same.tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        lb = torch.log_softmax(same.model(torch.tensor([ids])).logits[0].double(), -1)
        lt = torch.log_softmax(ablated.model(torch.tensor([ids])).logits[0].double(), -1)
    assert torch.allclose(torch.tensor(d.kl, dtype=torch.float64), (lb.exp() * (lb - lt)).sum(-1), atol=1e-9)


def test_corpus_ranks_contexts_and_different_tokenizers_are_refused(pair):
    same, ablated = pair
    windows = torch.randint(10, same.shape.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    c = D.diff_corpus(same, ablated, windows, top=5)
    kls = [x["kl"] for x in c.contexts]
    assert len(kls) == 5 and kls == sorted(kls, reverse=True)
    top = c.contexts[0]
    # a ranked context re-run as a prompt gives the same KL at its last position, up to float32 arithmetic
    # (the corpus ran it in a batch of 3: its logits differ from a lone run's by ~1e-7 of their size)
    assert D.diff_prompt(same, ablated, token_ids=top["ids"]).kl[-1] == pytest.approx(top["kl"], rel=1e-5)
    assert c.head_js[0] == [0.0] * same.shape.n_heads
    with pytest.raises(SettingsError, match="different tokenizers"):
        D.diff_prompt(same, load_model("smollm2-135m-instruct"), PROMPT)


def test_a_tokenizer_that_only_added_tokens_is_compared_on_the_shared_ids(pair, tmp_path):
    same, _ = pair
    same.model.save_pretrained(tmp_path)
    tok = same.tokenizer
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    grown = AutoTokenizer.from_pretrained(tmp_path)
    grown.add_tokens(["<extra-a>", "<extra-b>"])
    grown.save_pretrained(tmp_path)
    d = D.diff_prompt(same, load_model(str(tmp_path)), PROMPT)
    assert "adds 2 tokens" in d.vocabulary and set(d.kl) == {0.0}
