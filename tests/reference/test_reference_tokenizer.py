"""The default model's real tokenizer (the reference a trained tokenizer's report and the Jobs tab's
comparison stand beside) on Burmese: no unknown tokens, an exact round trip, and its own unknown
token typed as text matched as a special token, not counted as unknown."""

from __future__ import annotations

from tasks import tokenizer_train as tt

BURMESE = "မင်္ဂလာပါ ကျွန်တော်"


def test_default_model_tokenizer_on_burmese():
    ref, why = tt.reference_tokenizer()
    assert ref is not None, why
    a = tt.analyse_text(ref, BURMESE)
    assert a["unknown"] == 0 and a["roundtrip"] is True
    assert "".join(p["text"] for p in a["pieces"]) == BURMESE
    lit = tt.analyse_text(ref, "end <|endoftext|> here")  # its unk token, typed: matched, not unknown
    assert any(p["special"] for p in lit["pieces"]) and lit["unknown"] == 0
