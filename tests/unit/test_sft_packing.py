"""Padding-free SFT batches (model_core.training.sft_data.PackingCollator) on a random-weight Llama,
checked against transformers' own forward of the same examples padded (Collator): the packed batch
has the same loss (the same tokens, each example seeing only its own) and the same gradients, in
fewer padded positions. The check turns red when the examples can see each other (a cache left on:
transformers then builds one causal mask over the whole row)."""

from __future__ import annotations

import random

import torch

from model_core import load_model
from model_core.training.sft_data import IGNORE, Collator, ListDataset, PackingCollator


def _examples(vocab: int, n: int = 9, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(5, 40)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        prompt = rng.randint(1, length - 2)  # the loss on the answer only, as the SFT job masks it
        out.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return out


def _loss_and_grads(model, batch: dict):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_batches_equal_the_padded_batch_loss_and_gradients():
    lm = load_model("random-llama-tiny")
    model = lm.model.float().requires_grad_(True)
    model.train()
    try:
        _check(model)
    finally:  # the model is shared with other tests, which read it for inference
        model.requires_grad_(False).eval()


def _check(model):
    examples = _examples(model.config.vocab_size)
    padded = Collator(pad_id=0)(examples)
    packer = PackingCollator(pad_id=0, row_tokens=64)
    packed = packer(examples)
    # fewer positions, and each row holds whole examples
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    assert sorted(len(e["input_ids"]) for r in packer.rows(examples) for e in r) == sorted(
        len(e["input_ids"]) for e in examples)
    assert int((packed["labels"] != IGNORE).sum()) == int((padded["labels"][:, 1:] != IGNORE).sum())
    ref_loss, ref_grads = _loss_and_grads(model, padded)  # the reference: transformers' forward, padded
    loss, grads = _loss_and_grads(model, packed)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, atol=1e-6 + 1e-4 * float(g.abs().max())), name
    # red: with a cache, the packed examples see each other and the loss moves
    leaky = {**packed, "use_cache": True}
    with torch.no_grad():
        assert abs(float(model(**leaky).loss) - ref_loss) > 1e-3


def test_an_example_longer_than_a_row_gets_a_row_of_its_own():
    packer = PackingCollator(pad_id=0, row_tokens=8)
    batch = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
             {"input_ids": list(range(1, 13)), "labels": list(range(1, 13))},
             {"input_ids": [8, 9, 10, 11], "labels": [IGNORE, IGNORE, 10, 11]}]
    out = packer(batch)
    assert out["input_ids"].shape == (2, 12)  # the 12-token example fills a row; the other two share one
    assert out["position_ids"][0].tolist() == list(range(12))
    assert out["position_ids"][1].tolist() == [0, 1, 2, 3, 0, 1, 2] + list(range(5))  # 4, 3, then padding
    assert out["labels"][1].tolist()[:7] == [IGNORE, IGNORE, 10, 11, IGNORE, 6, 7]  # none across a boundary
    assert out["labels"][1, 7:].eq(IGNORE).all()


def test_the_trainers_dataset_collates_as_the_lists_do():
    """ListDataset holds examples as tensors (a faster batch); both collators make the same batch of
    them as of the encoded lists, bit for bit."""
    examples = _examples(1000, n=17, seed=3)
    held = ListDataset(examples)
    assert isinstance(held[0]["input_ids"], torch.Tensor) and len(held) == len(examples)
    for collate in (Collator(pad_id=0), PackingCollator(pad_id=0, row_tokens=64)):
        want, got = collate(examples), collate([held[i] for i in range(len(held))])
        assert want.keys() == got.keys()
        for k, v in want.items():
            assert torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k], k
