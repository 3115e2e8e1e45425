"""Every script: tokens whose bytes only make a character together are shown as that character
(one label per token, "glyph·k/n"), on the real default tokenizer (SmolLM2, byte-level BPE) and on
a SentencePiece-style vocabulary. References: the tokenizer's own decoder and its character
offsets (Rust `tokenizers`), never our own decoding."""

import pytest
import regex

from model_core.core.tokenization import (
    char_units,
    continuation_display,
    describe_raw,
    describe_tokens,
    display_bytes,
    glyph_spans,
    pending_bytes,
    spans_of,
    token_bytes,
    vocab_kind,
)

SCRIPTS = {
    "burmese": "မြန်မာနိုင်ငံသည် အရှေ့တောင်အာရှတွင် ရှိသည်။",
    "cjk": "東京は日本の首都です。서울은 한국의 수도",
    "arabic": "مرحبا بالعالم، هذا نص عربي",
    "emoji_zwj": "👩‍💻 writes code 🍕 and 👨‍👩‍👧",
    "combining": "e\u0301te\u0301 and cafe\u0301",
    "mixed": "Hello, မင်္ဂလာပါ 世界 🦜!",
}


@pytest.fixture(scope="module")
def smol_tok(default_lm):
    """The real default model's tokenizer (loading it converts the model if needed; never skipped)."""
    return default_lm.tokenizer


def _check_rows(tok, text, ids, rows):
    raws = [token_bytes(tok, i) for i in ids]
    # the tokens' bytes are the text's bytes (the tokenizer's own decoder is the reference)
    assert b"".join(raws) == tok.decode(ids).encode("utf-8")
    spans = spans_of(rows)
    assert spans == glyph_spans(raws)
    assert [r["span"] for r in rows] == [[s, e] for s, e in spans for _ in range(s, e)]
    # the glyphs round-trip to the exact decoded text
    assert "".join(rows[s]["glyph_text"] for s, _ in spans) == tok.decode(ids) == text
    # span edges are exactly the token edges that fall on a boundary of user-perceived characters
    # (extended grapheme clusters as the `regex` module's \X finds them in the decoded text)
    full = tok.decode(ids)
    cluster_edges = {len(full[: m.start()].encode()) for m in regex.finditer(r"\X", full)} | {len(full.encode())}
    token_edges = [sum(len(r) for r in raws[:k]) for k in range(len(raws) + 1)]
    cut = [k for k in range(1, len(raws) + 1) if token_edges[k] in cluster_edges]
    assert spans == list(zip([0, *cut[:-1]], cut))
    for s, e in spans:
        b"".join(raws[s:e]).decode("utf-8")  # a span decodes on its own
        for k in range(s, e):
            r = rows[k]
            assert (r["part"], r["parts"]) == (k - s + 1, e - s)
            assert r["display"] == (r["raw"] if e - s == 1 else f"{r['glyph']}·{k - s + 1}/{e - s}")
            assert r["bytes"] == " ".join(f"{b:02X}" for b in raws[k])
        assert "<0x" not in rows[s]["glyph"] and "\ufffd" not in rows[s]["glyph"]
    assert not any("<0x" in r["display"] for r in rows)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_scripts_on_the_default_tokenizer(smol_tok, name):
    text = SCRIPTS[name]
    enc = smol_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    rows = describe_tokens(smol_tok, ids)
    _check_rows(smol_tok, text, ids, rows)
    # each span's text is the text its tokens' character offsets cover (tokenizers' own offsets)
    for s, e in spans_of(rows):
        a = min(enc["offset_mapping"][k][0] for k in range(s, e))
        b = max(enc["offset_mapping"][k][1] for k in range(s, e))
        assert rows[s]["glyph_text"].strip() == text[a:b].strip(), (rows[s], text[a:b])


def test_burmese_letters_are_shown_as_letters(smol_tok):
    text = SCRIPTS["burmese"]
    ids = smol_tok(text, add_special_tokens=False)["input_ids"]
    rows = describe_tokens(smol_tok, ids)
    assert any(r["parts"] > 1 for r in rows)  # byte-level BPE does split them
    # every raw byte chip of old is now the Burmese character (consonant + medial) it helps spell
    first = regex.findall(r"\X", text)[0]  # "မြ": ma with the medial ra, one user-perceived character
    assert rows[0]["glyph"] == first and rows[0]["display"] == f"{first}·1/{rows[0]['parts']}"
    assert rows[0]["raw"] == "<0xE1>" and rows[0]["bytes"] == "E1"
    assert all(any("\u1000" <= ch <= "\u109f" for ch in r["display"]) for r in rows if r["parts"] > 1)
    # a lone vowel sign sits on a dotted circle so a label never glues it to its neighbour
    assert any(r["glyph"].startswith("◌") for r in rows)


def test_emoji_zwj_and_combining_marks_are_visible(smol_tok):
    ids = smol_tok("👩‍💻", add_special_tokens=False)["input_ids"]
    rows = describe_tokens(smol_tok, ids)
    assert [rows[s]["glyph"] for s, _ in spans_of(rows)] == ["👩\u200d💻"]  # one character, not three
    ids = smol_tok("e\u0301", add_special_tokens=False)["input_ids"]
    rows = describe_tokens(smol_tok, ids)
    assert [rows[s]["glyph"] for s, _ in spans_of(rows)] == ["e\u0301"]  # the letter with its mark


def test_display_bytes_edge_cases():
    assert display_bytes(b" a\n") == "␣a↵"
    assert display_bytes("🦜".encode()[:2]) == "<0xF0><0x9F>"
    assert display_bytes("é".encode()) == "é"
    assert display_bytes("e\u0301".encode()) == "e\u0301"  # a mark on its letter stays composed
    assert display_bytes("\u0301".encode()) == "◌\u0301"
    assert display_bytes("👩\u200d💻".encode()) == "👩\u200d💻"  # a joiner inside its sequence joins
    assert display_bytes("\u200d".encode()) == "⟨ZWJ⟩"
    assert display_bytes("a\u202eb".encode()) == "a⟨U+202E⟩b"  # never reorders the label around it
    assert [c for *_, c in char_units(b"\xe1\x80a\x99")] == [None, None, "a", None]


def test_spans_with_broken_bytes_end_where_nothing_can_follow():
    # a generation stopped after two bytes of a three-byte letter: each stray byte is its own run
    raws = [b"a", b"\xe1", b"\x80"]
    assert glyph_spans(raws) == [(0, 1), (1, 2), (2, 3)]
    rows = describe_raw([1, 2, 3], raws)
    assert [r["display"] for r in rows] == ["a", "<0xE1>", "<0x80>"]
    # a character cut across three tokens, one of which also holds the next character
    raws = ["東".encode()[:2], "東".encode()[2:] + "京".encode()[:1], "京".encode()[1:], b"!"]
    assert glyph_spans(raws) == [(0, 3), (3, 4)]
    assert [r["display"] for r in describe_raw([1, 2, 3, 4], raws)] == ["東京·1/3", "東京·2/3", "東京·3/3", "!"]


def test_pending_bytes_and_continuations():
    assert pending_bytes([b"a", b"\xe1"]) == b"\xe1"
    assert pending_bytes([b"a", b"\xe1", b"\x80"]) == b"\xe1\x80"
    assert pending_bytes([b"a", "မ".encode()]) == b""
    assert continuation_display(b"\xe1\x80", b"\x99") == "…မ"
    assert continuation_display(b"\xe1", b"\x80") == "<0x80>"
    assert continuation_display(b"", b" x") == "␣x"


def _sentencepiece_style():
    """A SentencePiece-style vocabulary in memory: "▁" for spaces, <0xNN> byte fallback, and
    letters such as "é" that the byte-level table also contains (as the stand-in for byte 0xE9)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁caf", "é", "▁t", "h", "▁the", "▁l", "a", "c", "f", "t", "e", "l", "ñ", "▁año"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "l"), ("c", "a"), ("ca", "f"), ("▁", "caf")]
    vocab.setdefault("▁th", len(vocab))
    vocab.setdefault("ca", len(vocab))
    vocab.setdefault("caf", len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_sentencepiece_letters_are_letters_and_byte_fallback_merges():
    tok = _sentencepiece_style()
    assert vocab_kind(tok) == "sentencepiece"
    e_id = tok.convert_tokens_to_ids("é")
    # the known bug: "é" went through the byte-level table and came out as byte 0xE9
    assert token_bytes(tok, e_id) == "é".encode()
    text = "café the lü 🦜"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert "é" in pieces and "<0xC3>" in pieces and "<0xF0>" in pieces  # letters and byte fallback
    rows = describe_tokens(tok, ids)
    # the tokenizer's own decoder (which strips the leading space it added) is the reference
    assert "".join(rows[s]["glyph_text"] for s, _ in spans_of(rows)) == " " + tok.decode(ids) == " " + text
    glyphs = [rows[s]["glyph"] for s, _ in spans_of(rows)]
    assert "ü" in glyphs and "🦜" in glyphs and "é" in glyphs
    assert not any("<0x" in r["display"] for r in rows)
    assert any(r["display"] == "ü·1/2" for r in rows)


def test_byte_level_vocabulary_kind(smol_tok):
    from model_core.core.tokenization import byte_tokenizer

    assert vocab_kind(smol_tok) == "byte-level"
    assert vocab_kind(byte_tokenizer()) == "byte-level"
    bt = byte_tokenizer()
    ids = bt("é🦜", add_special_tokens=False)["input_ids"]
    rows = describe_tokens(bt, ids)
    assert [r["display"] for r in rows] == ["é·1/2", "é·2/2", "🦜·1/4", "🦜·2/4", "🦜·3/4", "🦜·4/4"]


def test_generate_labels_streamed_tokens_by_the_character_they_make():
    """Generate's tokens arrive one at a time: once a character's last byte token is in, every token
    of it is labelled with the character, and a step's candidates that finish a character the text
    left open show it ("…é")."""
    from app.tabs.generate.tab import _highlight, _Labeller
    from model_core.core.tokenization import byte_tokenizer

    bt = byte_tokenizer()
    ids = bt("aé🦜", add_special_tokens=False)["input_ids"]
    lab = _Labeller(bt, bt("x", add_special_tokens=False)["input_ids"])
    steps = []
    for i in ids:
        step = {"chosen": {"id": i, "token": "", "prob": 0.5},
                "top_before": [{"id": j, "token": "?"} for j in ids], "top_after": [{"id": i, "token": "?"}]}
        lab.add(step)
        steps.append(step)
        lab.label(steps)
    assert [t for t, _ in _highlight(steps)] == ["a", "é·1/2", "é·2/2", "🦜·1/4", "🦜·2/4", "🦜·3/4", "🦜·4/4"]
    assert steps[2]["pending"] == "C3" and steps[2]["top_after"][0]["token"] == "…é"
    assert steps[1].get("pending") is None and steps[1]["top_after"][0]["token"] == "?"  # nothing open: as given
    assert steps[6]["top_after"][0]["token"] == "…🦜" and steps[3]["chosen"]["bytes"] == "F0"


def test_token_display_kept_per_tokenizer_equals_working_it_out(smol_tok):
    """token_display / token_text (kept per tokenizer for the streamed steps) against display_bytes of
    token_bytes and the tokenizer's own decode, over byte tokens, words, the chat markers and EOS."""
    from model_core.core.tokenization import display_bytes, token_bytes, token_display, token_text

    ids = [*range(0, 300), *range(49000, 49152), smol_tok.eos_token_id, *smol_tok.all_special_ids]
    for _ in range(2):  # the second pass reads what the first kept
        assert [token_display(smol_tok, i) for i in ids] == [display_bytes(token_bytes(smol_tok, i)) for i in ids]
        assert [token_text(smol_tok, i) for i in ids] == [smol_tok.decode([i]) for i in ids]


@pytest.mark.parametrize("text", ["aé🦜", "ကျွန်တော် မြန်မာ", "e\u0301\u0301x 👨\u200d👩\u200d👧 🇫🇷🇩🇪🇯", "日本語 ok ✓"])
@pytest.mark.parametrize("every", [1, 3])
def test_streamed_labels_equal_labelling_the_whole_generation_once(text, every):
    """Reference: describe_raw over all the tokens at once. _Labeller.label describes again only from
    the last glyph span on; fed a byte tokenizer's tokens one at a time (combining marks, a ZWJ family,
    flags as regional-indicator pairs, Burmese medials), labelled after every token or every third,
    every token ends with the label the whole-text description gives it."""
    from app.tabs.generate.tab import _Labeller
    from model_core.core.tokenization import byte_tokenizer, describe_raw, token_bytes

    bt = byte_tokenizer()
    ids = bt(text, add_special_tokens=False)["input_ids"]
    lab = _Labeller(bt, bt("x", add_special_tokens=False)["input_ids"])
    steps = []
    for n, i in enumerate(ids, 1):
        step = {"chosen": {"id": i}, "top_before": [], "top_after": []}
        lab.add(step)
        steps.append(step)
        if n % every == 0:
            lab.label(steps)
    lab.label(steps)
    whole = describe_raw(ids, [token_bytes(bt, i) for i in ids])
    assert [s["chosen"]["label"] for s in steps] == [r["display"] for r in whole]
    assert [s["chosen"]["bytes"] for s in steps] == [r["bytes"] for r in whole]
    assert 0 < lab.settled < len(ids)  # it did skip the settled spans


def test_lens_cells_after_an_open_character_show_the_character_they_finish(default_lm):
    """On the real model: where the prompt stops two bytes into a Burmese letter, the last layer's
    guess is the letter's last byte; the lens cell shows the letter it finishes ("…မ"), not <0x99>."""
    from app.tabs.explore import views
    from model_core.interp.trace import trace

    tr = trace(default_lm, SCRIPTS["burmese"])
    lv = views.lens_view(tr, tr.n_tokens - 1)
    open_two = [j for j, p in enumerate(lv["positions"]) if tr.tokens[p]["parts"] == 3 and tr.tokens[p]["part"] == 2]
    assert open_two
    last = lv["top"][-1]
    finished = [last[j] for j in open_two if last[j].startswith("…")]
    assert len(finished) >= len(open_two) // 2, [last[j] for j in open_two]
    assert all(any("\u1000" <= ch <= "\u109f" for ch in c) for c in finished)
    assert not any(c.startswith("…") for j, c in enumerate(last) if tr.tokens[lv["positions"][j]]["parts"] == 1)


def test_exports_carry_bytes_and_characters(default_lm):
    """tokens.csv and trace.json: each token's bytes, the character it helps spell and which part."""
    from app.tabs.explore import views
    from model_core.interp.trace import trace
    from model_core.interp.trace_summary import trace_summary

    text = "🍕 " + SCRIPTS["burmese"][:6]
    tr = trace(default_lm, text)
    table = views.token_table(tr)
    assert b"".join(bytes.fromhex(h) for h in table["bytes"]) == text.encode()
    assert list(table["part"])[:3] == ["1/3", "2/3", "3/3"] and list(table["glyph"])[:3] == ["🍕"] * 3
    assert "".join(g for g, p in zip(table["glyph"], table["part"]) if p == "" or p.startswith("1/")) == text
    toks = trace_summary(default_lm, tr)["tokens"]
    assert [t["glyph"] for t in toks[:3]] == ["🍕"] * 3 and toks[0]["bytes"] == "F0 9F"
