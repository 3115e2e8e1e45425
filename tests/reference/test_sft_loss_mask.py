"""SFT's loss mask and length limits on the real SmolLM2 chat template (the default model's tokenizer):
trained tokens are exactly the assistant turns, and truncated or dropped examples are counted."""

from __future__ import annotations

import pytest

from model_core.training import sft


def test_loss_mask_smollm2_token_by_token(default_lm):
    """Trained tokens are exactly the assistant content and its <|im_end|>: not the system prompt
    the template inserts, not the user turns, not '<|im_start|>assistant\\n', not the '\\n' after
    <|im_end|>."""
    tok = default_lm.tokenizer
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok."}]
    ex = sft.encode_conversation(tok, msgs)
    ids = ex["input_ids"]
    # the same ids the template gives when it tokenizes itself
    assert ids == list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))
    pieces = tok.convert_ids_to_tokens(ids)
    trained = [(i, p) for i, (p, l) in enumerate(zip(pieces, ex["labels"])) if l != sft.IGNORE]
    assert [p for _, p in trained] == ["hello", "Ġthere", "<|im_end|>", "ok", ".", "<|im_end|>"]
    # positions: each assistant turn starts right after '<|im_start|>', 'ass', 'istant', 'Ċ'
    for i, p in trained:
        if p in ("hello", "ok"):
            assert pieces[i - 4: i] == ["<|im_start|>", "ass", "istant", "Ċ"]
    assert pieces[trained[2][0] + 1] == "Ċ" and ex["labels"][trained[2][0] + 1] == sft.IGNORE
    for t, l in zip(ids, ex["labels"]):
        assert l == sft.IGNORE or l == t
    assert sum(ex["assistant_mask"]) == 6 and len(ids) == len(ex["labels"])
    # the default system prompt is in the sequence and masked
    assert "ĠSm" in pieces[: trained[0][0]]


def test_truncation_and_dropping_are_counted(default_lm):
    tok = default_lm.tokenizer
    short = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    long_answer = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "word " * 200}]
    long_prompt = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "b"}]
    d = sft.encode_dataset(tok, [short, long_answer, long_prompt], max_length=64)
    assert (d.total, d.truncated, d.dropped, len(d.examples)) == (3, 1, 1, 2)
    assert all(len(e["input_ids"]) <= 64 for e in d.examples)
    with pytest.raises(sft.DatasetError, match="max_length"):
        sft.encode_dataset(tok, [long_prompt], max_length=64)
