"""One chip group per user-perceived character (issue 15 item 2): byte tokens are grouped by
extended grapheme cluster, not by code point, so a Burmese consonant with its medial, asat or vowel
sign, an emoji ZWJ family and a flag each stand above the tokens that spell them. On the real
default model's tokenizer (SmolLM2, byte-level BPE). References: the clusters written out by hand
for these strings (tests/helpers/graphemes.py), the tokenizer's own decoder and character offsets."""

from __future__ import annotations

import re

import pytest

from app.tabs.explore import figures
from model_core.core.tokenization import (
    codepoint_spans,
    describe_tokens,
    glyph_spans,
    grapheme_bounds,
    spans_of,
    token_bytes,
)
from tests.helpers.graphemes import CASES


@pytest.fixture(scope="module")
def tok(default_lm):
    return default_lm.tokenizer


@pytest.mark.parametrize("name", list(CASES))
def test_tokens_are_grouped_per_user_perceived_character(tok, name):
    text, chars = CASES[name]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rows = describe_tokens(tok, ids)
    raws = [token_bytes(tok, i) for i in ids]
    assert b"".join(raws) == tok.decode(ids).encode() == text.encode()  # the tokenizer's own decoder
    spans = spans_of(rows)
    assert spans == glyph_spans(raws)
    # every span's text is a run of whole characters, and no shorter run of its tokens is
    ends = {len("".join(chars[:k]).encode()) for k in range(len(chars) + 1)}
    off = 0
    for s, e in spans:
        n = [len(raws[k]) for k in range(s, e)]
        assert off in ends and off + sum(n) in ends, rows[s]
        assert not any(off + sum(n[:j]) in ends for j in range(1, e - s)), rows[s]  # shortest
        off += sum(n)
        for k in range(s, e):  # one row (chip, label) per token, the character over all of them
            assert rows[k]["span"] == [s, e] and (rows[k]["part"], rows[k]["parts"]) == (k - s + 1, e - s)
            assert rows[k]["glyph"] == rows[s]["glyph"] and "<0x" not in rows[k]["display"]
    assert "".join(rows[s]["glyph_text"] for s, _ in spans) == text
    # no character is cut between two spans (per code point, every one of these was)
    texts = [rows[s]["glyph_text"] for s, _ in spans]
    assert all(any(c in t for t in texts) for c in chars)
    if name != "combining":  # here byte-level BPE splits every character: one span per character
        assert texts == chars


def test_a_family_emoji_and_a_flag_are_one_glyph_each_in_the_token_strip(tok):
    text = "👨\u200d👩\u200d👧 and 🇲🇲"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rows = describe_tokens(tok, ids)
    html = figures.token_strip_html(rows, [None] + [-1.0] * (len(rows) - 1), 2.0)
    glyphs = re.findall(r'<span class="glyph-text">([^<]*)</span>', html)
    assert glyphs == ["👨\u200d👩\u200d👧", "␣🇲🇲"]  # the space's token also holds the flag's first byte
    assert [int(p) for p in re.findall(r'data-pos="(\d+)"', html)] == list(range(len(ids)))  # a chip per token
    # per code point the family was five characters (three people, two joiners)
    raws = [token_bytes(tok, i) for i in ids]
    assert len(codepoint_spans(raws)) > len(glyph_spans(raws))


def test_a_burmese_sentence_keeps_a_chip_per_token_under_each_syllable_part(tok):
    text = "မြန်မာနိုင်ငံသည် အရှေ့တောင်အာရှတွင် ရှိသည်။"
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    rows = describe_tokens(tok, enc["input_ids"])
    b = grapheme_bounds(text)
    clusters = [text[x:y] for x, y in zip(b, b[1:])]
    spans = spans_of(rows)
    texts = [rows[s]["glyph_text"] for s, _ in spans]
    assert "".join(texts) == text
    # every cluster with a medial or a vowel sign is whole in one span (never cut between chips groups)
    joined = [t for t in texts]
    for c in clusters:
        if len(c) > 1:
            assert any(c in t for t in joined), c
    # each span covers the characters its tokens' offsets cover (the tokenizer's own offsets)
    for s, e in spans:
        a = min(enc["offset_mapping"][k][0] for k in range(s, e))
        z = max(enc["offset_mapping"][k][1] for k in range(s, e))
        assert rows[s]["glyph_text"].strip() == text[a:z].strip()
