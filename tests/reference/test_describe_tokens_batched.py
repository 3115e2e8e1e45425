"""describe_tokens reads the vocabulary once per distinct id and decodes in one batch (it runs on
the host while the device runs the trace's forward): its rows equal the one-token-at-a-time
reading through the tokenizer's own convert_ids_to_tokens and decode, on the real default
tokenizer, for scripts, emoji, chat markers and repeated tokens."""

from model_core.core import tokenization as tk

TEXT = ("<|im_start|>user\nမြန်မာဘာသာစကား 👩‍💻 naïve café — the the the 東京 🇫🇷<|im_end|>\n"
        "def f(x):\n\treturn x  # done\r\n")


def _one_by_one(tokenizer, ids):
    return tk.describe_raw(ids, [tk.token_bytes(tokenizer, t) for t in ids], [tokenizer.decode([t]) for t in ids])


def test_batched_rows_equal_per_token_rows(default_lm):
    tok = default_lm.tokenizer
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(set(ids)) < len(ids)  # repeated ids take the per-distinct-id path
    assert tk.describe_tokens(tok, ids) == _one_by_one(tok, ids)


def test_byte_tokenizer_rows_equal_per_token_rows():
    tok = tk.byte_tokenizer()
    ids = list("မြန်မာ 👩‍💻".encode()) + [256, 257]
    assert tk.describe_tokens(tok, ids) == _one_by_one(tok, ids)
