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
