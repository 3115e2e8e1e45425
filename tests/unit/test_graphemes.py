"""One chip group per user-perceived character (issue 15 item 2): text is cut into extended grapheme
clusters, not code points, so a Burmese consonant with its medial, asat or vowel sign, an emoji ZWJ
family and a flag are each one character. Reference: the clusters written out by hand
(tests/helpers/graphemes.py). How the default model's byte tokens are grouped by them:
tests/reference/test_grapheme_chips.py."""

from __future__ import annotations

import pytest

from model_core.core.tokenization import grapheme_bounds
from tests.helpers.graphemes import CASES


@pytest.mark.parametrize("name", list(CASES))
def test_grapheme_bounds_are_the_characters_people_see(name):
    text, chars = CASES[name]
    b = grapheme_bounds(text)
    assert [text[x:y] for x, y in zip(b, b[1:])] == chars


def test_ascii_text_is_cut_as_the_unicode_rules_cut_it():
    """grapheme_bounds' and the byte spans' shortcut for ASCII (a character per byte, CR LF one cluster)
    against the `regex` module's \\X (Unicode's extended grapheme clusters) and the general walk."""
    import random

    import regex

    from model_core.core import tokenization as tk

    rng = random.Random(0)
    alphabet = "ab \r\n\t\x00\x1b\x7f.\r\r\n\n"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        assert grapheme_bounds(text) == [m.start() for m in regex.finditer(r"\X", text)] + [len(text)], repr(text)
        raw = text.encode()
        for clusters in (False, True):
            assert tk._inside(raw, clusters) == tk._inside_any(raw, clusters), repr(text)
    assert tk._inside(b"a\r\nb", True) == {2}  # can turn red: the \n is inside the CR LF cluster
