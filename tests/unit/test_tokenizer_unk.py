"""Unknown tokens are shown, counted and rate-reported (issue 20, "the train-then-inspect loop").

A Unigram tokenizer trained on the built-in English corpus cannot represent Burmese: it encodes
"မင်္ဂလာပါ ကျွန်တော်" as `▁ <unk> ▁ <unk>` and decodes it to "<unk> <unk>". The chips must show those
tokens (not the Burmese text they swallowed), mark the unknown ones, and the comparison must
count them and say the round trip fails; a byte-level BPE tokenizer on the same text has no
unknowns and round-trips. Real tokenizers trained here with the project's own training function.
The default model's tokenizer on the same text: tests/reference/test_reference_tokenizer.py; the
Jobs tab's comparison with a real job through Valkey and a worker:
tests/integration/test_tokenizer_compare_job.py.
"""

from __future__ import annotations

import pytest

from app.shared import job_views as jf
from tasks import corpus
from tasks import tokenizer_train as tt

BURMESE = "မင်္ဂလာပါ ကျွန်တော်"
BURMESE_WORD = "မြန်မာစာ"
ENGLISH = "The tokenizer splits each word into pieces, and decoding joins them again."


def _train(algorithm: str):
    p = tt.validate_params({"algorithm": algorithm, "vocab_size": 2000})
    return tt.train(p, corpus.builtin_docs("train", int(0.3 * 2**20))), p


@pytest.fixture(scope="module")
def unigram():
    return _train("unigram")


@pytest.fixture(scope="module")
def bytelevel():
    return _train("byte-level-bpe")


def test_unigram_shows_unk_tokens_not_the_text(unigram):
    tok, _ = unigram
    a = tt.analyse_text(tok, BURMESE)
    pieces = a["pieces"]
    assert [p["display"] for p in pieces] == ["␣", "<unk>", "␣", "<unk>"]
    assert [p["token"] for p in pieces] == ["▁", "<unk>", "▁", "<unk>"]
    assert [p["unk"] for p in pieces] == [False, True, False, True]
    assert a["tokens"] == 4 and a["unknown"] == 2 and a["unknown_rate"] == 0.5
    assert a["unknown_chars"] == len(BURMESE) - 1  # everything but the space between the words
    assert a["roundtrip"] is False and a["decoded"] != BURMESE
    # no chip shows the Burmese it could not represent; the offsets still say what each covered
    assert not any(ch in p["display"] for p in pieces for ch in BURMESE if not ch.isspace())
    unk = [p for p in pieces if p["unk"]]
    assert [BURMESE[p["start"]:p["end"]] for p in unk] == BURMESE.split(" ")
    # the leading "▁" is inserted by the pre-tokenizer: it covers no character of the text
    assert pieces[0]["start"] == pieces[0]["end"] and pieces[0]["text"] == ""
    assert "".join(p["text"] for p in pieces) == BURMESE

    one = tt.analyse_text(tok, BURMESE_WORD)
    assert [p["display"] for p in one["pieces"]] == ["␣", "<unk>"]
    assert one["unknown"] == 1 and one["roundtrip"] is False
    assert BURMESE_WORD[one["pieces"][1]["start"]:one["pieces"][1]["end"]] == BURMESE_WORD


def test_unigram_plain_english_has_no_unknowns_and_round_trips(unigram):
    tok, _ = unigram
    a = tt.analyse_text(tok, ENGLISH)
    assert a["unknown"] == 0 and a["unknown_rate"] == 0.0 and a["unknown_chars"] == 0
    assert a["roundtrip"] is True and a["decoded"] == ENGLISH
    assert not any(p["unk"] for p in a["pieces"])
    # chips are vocabulary strings, made byte-safe: "▁word" shows as "␣word"
    assert all(p["display"] == p["token"].replace("▁", "␣") for p in a["pieces"])
    assert "".join(p["text"] for p in a["pieces"]) == ENGLISH


def test_literal_unk_text_is_not_an_unknown(unigram):
    tok, _ = unigram
    a = tt.analyse_text(tok, "<unk> is a token")
    assert a["pieces"][0]["token"] == "<unk>" and a["pieces"][0]["special"]
    assert a["unknown"] == 0 and a["roundtrip"] is True


def test_bytelevel_bpe_on_burmese_has_no_unknowns_and_round_trips(bytelevel):
    tok, _ = bytelevel
    a = tt.analyse_text(tok, BURMESE)
    assert a["unknown"] == 0 and a["unknown_rate"] == 0.0 and a["roundtrip"] is True
    assert a["tokens"] > len(BURMESE)  # byte tokens: up to 3 per Burmese character
    assert "".join(p["text"] for p in a["pieces"]) == BURMESE
    # a byte token keeps its byte (raw), not a stand-in character or "�", and is shown as the
    # Burmese character it makes with its neighbours ("မ·1/3")
    assert all(p["raw"].startswith("<0x") or p["raw"] == "␣" for p in a["pieces"])
    assert not any("\ufffd" in p["display"] or "<0x" in p["display"] for p in a["pieces"])
    assert any(p["parts"] > 1 and any("\u1000" <= ch <= "\u109f" for ch in p["display"]) for p in a["pieces"])
    h = jf.tokens_html([("byte-level", a)], BURMESE)
    assert h.count("lmscope-glyph") == sum(1 for p in a["pieces"] if p["parts"] > 1 and p["part"] == 1)


def test_html_marks_unknowns_and_states_counts(unigram, bytelevel):
    rows = [("unigram", tt.analyse_text(unigram[0], BURMESE)), ("byte-level", tt.analyse_text(bytelevel[0], BURMESE)),
            ("broken", "could not load")]
    h = jf.tokens_html(rows, BURMESE)
    assert h.count("lmscope-tok-unk") == 2 and h.count("data-unk='1'") == 2
    assert h.count(">&lt;unk&gt;</span>") == 2
    assert "4 tokens" in h and "2 unknown (50% of tokens, 18 of 19 characters)" in h
    assert "data-tokens='4' data-unknown='2' data-roundtrip='false'" in h
    assert "round trip: differs" in h
    assert "data-unknown='0' data-roundtrip='true'" in h and "round trip: exact" in h
    # hovering an unknown chip shows the text it swallowed, with its character range
    assert "covers “မင်္ဂလာပါ” (characters 0–9)" in h
    assert "<em>could not load</em>" in h


def test_report_carries_unknown_rate_on_heldout(unigram, bytelevel):
    held = corpus.builtin_docs("heldout")[:40] + [BURMESE]
    for (tok, p), expect_unk in ((unigram, True), (bytelevel, False)):
        # a reference that is not converted here: the report is built without the default model, and says why
        rep = tt.report(tok, p, held, "test", {}, reference="not-a-converted-model")
        assert "not-a-converted-model is not converted" in rep["reference"]["unavailable"]
        c = rep["compression"]
        assert c["unk_rate"] == round(c["unk_tokens"] / c["tokens"], 6)
        if expect_unk:
            assert c["unk_tokens"] >= 2 and c["unk_rate"] > 0
            assert c["roundtrip_exact_fraction"] < 1
        else:
            assert c["unk_tokens"] == 0 and c["unk_rate"] == 0 and c["roundtrip_exact_fraction"] == 1
