"""Hand-written references for the grapheme tests: each text's user-perceived characters (UAX #29
extended grapheme clusters), shared by tests/unit/test_graphemes.py (the clusters themselves) and
tests/reference/test_grapheme_chips.py (the default model's tokens grouped by them)."""

# text -> its user-perceived characters, written out by hand (UAX #29 extended grapheme clusters)
CASES = {
    "burmese": ("မြန်မာ", ["မြ", "န်", "မ", "ာ"]),  # ma + medial ra; na + asat; ma; aa (not a SpacingMark in UAX #29)
    "burmese2": ("ကျွန်တော်", ["ကျွ", "န်", "တေ", "ာ်"]),  # ka + medial ya + medial wa; ...
    "family": ("👨\u200d👩\u200d👧", ["👨\u200d👩\u200d👧"]),  # man ZWJ woman ZWJ girl
    "flag": ("🇲🇲🇯🇵", ["🇲🇲", "🇯🇵"]),  # two regional indicators each
    "combining": ("e\u0301te\u0301", ["e\u0301", "t", "e\u0301"]),
    "skin_tone": ("👍🏽!", ["👍🏽", "!"]),
}
