"""The generation's text as it grows (model_core.serving.generate.TextSoFar) against the reference: the
tokenizer's own `decode(ids, skip_special_tokens=True)` of every prefix, on the default model's
byte-level BPE and the sentencepiece-style tokenizers of the random Gemma 3 and Llama models, for
prose with spaces before punctuation, prose without punctuation, Burmese, emoji and code, and for random ids (most of them
halves of a character's bytes). A decoder whose text depends on more than one neighbouring token
is caught at the next check against a whole decode and decoded whole from then on (the finished
generation's text is one whole decode either way)."""

import copy
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

from model_core import load_model
from model_core.serving.generate import TextSoFar

TEXTS = [
    "The cat sat on the mat . It 's fine , isn't it ? Yes !  Two  spaces\tand\ttabs\n\nnew lines",
    "မြန်မာဘာသာစကားသည် မြန်မာနိုင်ငံ၏ ရုံးသုံးဘာသာစကားဖြစ်သည်။ 🙂👍🏽🇫🇷 日本語のテキスト",
    "def f(x):\n    return x**2  # square\n",
    # no punctuation: every token starts with a space (no overlap starting with a visible character)
    "the quick brown fox jumps over a lazy dog while seven curious students measure how far sound "
    "travels in warm air and cold water before the evening bell rings across the quiet valley",
]


def _sequences(tok, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return ([tok(t, add_special_tokens=False)["input_ids"] * 3 for t in TEXTS]
            + [[rng.randrange(vocab) for _ in range(160)] for _ in range(2)])


def _check_every_prefix(tok, ids) -> TextSoFar:
    text = TextSoFar(tok)
    for n, i in enumerate(ids, 1):
        assert text.add(i) == tok.decode(ids[:n], skip_special_tokens=True), f"differs after {n} tokens"
    return text


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "random-gemma3-tiny", "random-llama-tiny"])
def test_incremental_text_equals_decode_of_every_prefix(name, monkeypatch):
    lm = load_model(name, device="cpu")
    whole_decodes = []
    whole = TextSoFar.whole
    monkeypatch.setattr(TextSoFar, "whole", lambda self: whole_decodes.append(1) or whole(self))
    for ids in _sequences(lm.tokenizer, lm.shape.vocab_size):
        whole_decodes.clear()
        text = _check_every_prefix(lm.tokenizer, ids)
        # it did decode piecewise (a silent fall-back to whole decodes would pass the check above):
        # one whole decode per SETTLE_EVERY tokens, not one a step (54 for 99 words without punctuation)
        assert not text.full_only and text.start >= len(ids) - 2 * TextSoFar.SETTLE_EVERY
        assert len(whole_decodes) <= len(ids) / TextSoFar.SETTLE_EVERY + 2, (len(whole_decodes), len(ids))


def _llama2_style_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's / Mistral's decoder, trained here on TEXTS: word starts carry "▁", bytes fall back
    to <0xNN> tokens, and every decode strips one leading space (so a piece decoded alone loses the
    space its word start had in the whole text)."""
    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tk.train_from_iterator(TEXTS[:1] * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=special))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_a_decoder_that_strips_the_first_space_still_equals_decode():
    tok = _llama2_style_tokenizer()
    for ids in _sequences(tok, len(tok)):
        text = _check_every_prefix(tok, ids)
        assert not text.full_only


def test_space_clean_up_across_the_boundary_still_equals_decode():
    tok = copy.deepcopy(load_model("random-gpt2-tiny", device="cpu").tokenizer)
    tok.clean_up_tokenization_spaces = True  # " ." -> "." and " 's" -> "'s" may join two tokens
    _check_every_prefix(tok, tok(TEXTS[0], add_special_tokens=False)["input_ids"] * 4)


class _ShoutsWhenLong:
    """A decoder that is not piecewise: one letter per id, all upper case once the text is longer
    than 20 letters (no one-token overlap can see that)."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(chr(97 + i % 26) for i in ids)
        return text.upper() if len(text) > 20 else text


def test_a_decoder_that_is_not_piecewise_is_found_and_decoded_whole():
    tok, ids = _ShoutsWhenLong(), list(range(60))
    text = TextSoFar(tok)
    got = [text.add(i) for i in ids]
    # caught at the first check after it went wrong (32 tokens), then every text is the whole decode
    assert text.full_only and tok._lmscope_full_decode
    for n in [*range(1, 21), *range(32, 61)]:
        assert got[n - 1] == tok.decode(ids[:n]), n
    assert TextSoFar(tok).full_only  # the tokenizer stays marked
