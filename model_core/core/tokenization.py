"""Tokens as people should see them: ids, decoded text, and a byte-safe display string.

Byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) stores bytes as printable stand-in characters
("Ġ" is a space); SentencePiece (Gemma, Llama 2) uses "▁" and <0xNN> byte-fallback tokens.
We recover each token's raw bytes so that spaces, newlines and partial UTF-8 sequences show
up honestly instead of as "�".

Glyph spans. A character outside ASCII is 2-4 bytes, and a byte-level vocabulary often splits
it over several tokens (SmolLM2 spells every Burmese letter as three one-byte tokens). Those
tokens mean nothing alone, so every view shows the character they make together while keeping
one chip / one axis label per token. What a reader counts as one character is often several code
points: a Burmese consonant with its medials and vowel signs (မြ, ကျွ), a letter with combining
marks (é as e + U+0301), an emoji ZWJ sequence (👨‍👩‍👧), a flag (two regional indicators). So
`describe_tokens` groups tokens into spans, each the shortest run of tokens whose bytes start and
end on a boundary of those user-perceived characters (Unicode extended grapheme clusters, the
`regex` module's \\X), and labels a token of a run of n as "glyph·k/n" (e.g. "မြ·2/6"). The
spans' texts concatenate back to the decoded text exactly.
"""

from __future__ import annotations

import codecs
import functools
import re
import unicodedata
from collections.abc import Callable

try:  # transformers depends on it; the fallback below is a simpler rule for the common cases
    import regex as _regex
except ImportError:  # pragma: no cover
    _regex = None

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    # The GPT-2 bytes_to_unicode table, inverted: printable char -> byte value.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# ---- what a vocabulary string stands for ------------------------------------------------------

_KIND_ATTR = "_lmscope_vocab_kind"


def vocab_kind(tokenizer) -> str:
    """How the tokenizer spells bytes in its vocabulary: "byte-level" (GPT-2's table: every piece is
    bytes written as stand-in characters), "sentencepiece" ("▁" for a space, <0xNN> byte fallback)
    or "plain" (pieces are text). Read from the tokenizer's own decoder, cached on the tokenizer.
    The kind belongs to the vocabulary, never to one piece: "é" is a letter in a SentencePiece
    vocabulary although the byte-level table also has a character "é" (for byte 0xE9)."""
    kind = getattr(tokenizer, _KIND_ATTR, None)
    if kind:
        return kind
    kind = _detect_kind(tokenizer)
    try:
        setattr(tokenizer, _KIND_ATTR, kind)
    except Exception:  # noqa: BLE001 - a read-only object: detect again next time (cheap)
        pass
    return kind


def _detect_kind(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "decoder") and hasattr(tokenizer, "id_to_token"):
        backend = tokenizer  # a bare `tokenizers.Tokenizer`
    dec = getattr(backend, "decoder", None) if backend is not None else None
    if dec is not None:
        try:
            state = dec.__getstate__()
            state = state.decode() if isinstance(state, bytes) else str(state)
        except Exception:  # noqa: BLE001
            state = type(dec).__name__
        if "ByteLevel" in state:
            return "byte-level"
        if "ByteFallback" in state or "Metaspace" in state or "\u2581" in state or "\\u2581" in state:
            return "sentencepiece"
        return "plain"
    if getattr(tokenizer, "sp_model", None) is not None:  # a slow SentencePiece tokenizer
        return "sentencepiece"
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001
        vocab = {}
    if "Ġ" in vocab or "Ġt" in vocab or "Ġthe" in vocab:
        return "byte-level"
    if any(p.startswith("\u2581") for p in list(vocab)[:5000]):
        return "sentencepiece"
    return "plain"


def _added_ids(tokenizer) -> frozenset[int]:
    """Ids of added tokens (chat markers, <|endoftext|>...): their string is literal text."""
    cached = getattr(tokenizer, "_lmscope_added_ids", None)
    if cached is not None:
        return cached
    ids: set[int] = set()
    try:
        ids |= {int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}
    except Exception:  # noqa: BLE001
        pass
    try:
        ids |= {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or ())}
    except Exception:  # noqa: BLE001
        pass
    out = frozenset(ids)
    try:
        tokenizer._lmscope_added_ids = out
    except Exception:  # noqa: BLE001
        pass
    return out


def piece_bytes(piece: str, kind: str) -> bytes:
    """The bytes one (non-added) vocabulary string stands for, in a vocabulary of `kind`."""
    if kind == "byte-level":
        table = byte_level_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode("utf-8")
    if kind == "sentencepiece":
        m = _BYTE_FALLBACK.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("▁", " ").encode("utf-8")
    return piece.encode("utf-8")


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes a token stands for (best effort for unusual vocabularies)."""
    token_id = int(token_id)
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        piece = tokenizer.convert_ids_to_tokens(token_id)
    else:
        piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    if token_id in _added_ids(tokenizer) or piece in getattr(tokenizer, "all_special_tokens", ()):
        return piece.encode("utf-8")
    return piece_bytes(piece, vocab_kind(tokenizer))


# ---- showing bytes ----------------------------------------------------------------------------

_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
# Characters that draw nothing (or reorder what follows): named so a chip or a label is never
# blank and never flips the text around it.
_NAMED = {"\u200d": "ZWJ", "\u200c": "ZWNJ", "\u200b": "ZWSP", "\u2060": "WJ", "\ufeff": "BOM",
          "\u00ad": "SHY", "\u200e": "LRM", "\u200f": "RLM", "\u061c": "ALM"}
_JOINERS = {"\u200d", "\u200c"}  # shown as is between two characters (they join an emoji or a script)
DOTTED_CIRCLE = "\u25cc"  # the base a lone combining mark is drawn on


def _utf8_len(lead: int) -> int:
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0  # never starts a character


def char_units(raw: bytes) -> list[tuple[int, int, str | None]]:
    """Split bytes into units [(start, end, char or None)]: each valid UTF-8 character, or a
    single byte that is not part of one (None)."""
    out, i, n = [], 0, len(raw)
    while i < n:
        w = _utf8_len(raw[i])
        if w and i + w <= n:
            try:
                out.append((i, i + w, raw[i: i + w].decode("utf-8")))
                i += w
                continue
            except UnicodeDecodeError:
                pass
        out.append((i, i + 1, None))
        i += 1
    return out


def _is_mark(ch: str) -> bool:
    return unicodedata.category(ch).startswith("M")


def _show_char(ch: str, at_edge: bool) -> str:
    if ch in _VISIBLE:
        return _VISIBLE[ch]
    if len(ch) == 1 and (ord(ch) < 32 or ord(ch) == 127):
        return f"<0x{ord(ch):02X}>"
    if ch in _JOINERS and not at_edge:
        return ch
    if ch in _NAMED:
        return f"⟨{_NAMED[ch]}⟩"
    cat = unicodedata.category(ch)
    if cat == "Cf" or (0x202A <= ord(ch) <= 0x202E) or (0x2066 <= ord(ch) <= 0x2069):
        return f"⟨U+{ord(ch):04X}⟩"
    if 0xFE00 <= ord(ch) <= 0xFE0F and at_edge:
        return f"⟨VS{ord(ch) - 0xFE00 + 1}⟩"
    return ch


def display_bytes(raw: bytes) -> str:
    """Byte-safe display: whitespace made visible, control chars and broken UTF-8 as <0xNN>,
    invisible format characters named (⟨ZWJ⟩), a combining mark with nothing to sit on drawn on ◌."""
    units = char_units(raw)
    out: list[str] = []
    for j, (a, _, ch) in enumerate(units):
        if ch is None:
            out.append(f"<0x{raw[a]:02X}>")
            continue
        shown = _show_char(ch, at_edge=j == 0 or j == len(units) - 1)
        if _is_mark(ch) and shown == ch and (not out or out[-1][-1:] in "␣↵⇥␍>⟩"):
            shown = DOTTED_CIRCLE + ch
        out.append(shown)
    return "".join(out)


def token_display(tokenizer, token_id: int) -> str:
    """display_bytes(token_bytes(...)) of one token, kept per tokenizer: a streamed step shows ~20
    of them and the web process builds every user's steps (0.3 -> 0.05 ms a step, see PERFORMANCE)."""
    return _per_token(tokenizer, "_lmscope_display", token_id, lambda i: display_bytes(token_bytes(tokenizer, i)))


def token_text(tokenizer, token_id: int) -> str:
    """tokenizer.decode([token_id]), kept per tokenizer like token_display."""
    return _per_token(tokenizer, "_lmscope_text", token_id, lambda i: tokenizer.decode([i]))


def token_displays(tokenizer) -> Callable[[int], str]:
    """token_display for one tokenizer, its kept strings looked up once: a step's JSON shows ~20 tokens."""
    cache = _kept(tokenizer, "_lmscope_display")

    def display(token_id: int) -> str:
        shown = cache.get(token_id)
        if shown is None:
            shown = cache[token_id] = display_bytes(token_bytes(tokenizer, token_id))
        return shown

    return display


def _kept(tokenizer, attr: str) -> dict:
    cache = getattr(tokenizer, attr, None)
    if cache is None:
        cache = {}
        try:
            setattr(tokenizer, attr, cache)
        except Exception:  # noqa: BLE001 - a read-only object: kept for this call only
            pass
    return cache


def _per_token(tokenizer, attr: str, token_id: int, make) -> str:
    cache = _kept(tokenizer, attr)
    token_id = int(token_id)
    shown = cache.get(token_id)
    if shown is None:
        # a tokenizer that grows (add_tokens) keeps its old ids' pieces, so entries never go stale
        shown = cache[token_id] = make(token_id)
    return shown


def hex_bytes(raw: bytes) -> str:
    """'E1 80 99': a token's byte values, for hover texts."""
    return " ".join(f"{b:02X}" for b in raw)


# ---- glyph spans -----------------------------------------------------------------------------

_CLUSTER = _regex.compile(r"\X") if _regex is not None else None
# without `regex`: a character with what attaches to it (marks, variation selectors, skin tones,
# tags, ZWJ + the next character; regional indicators in pairs), close to extended grapheme clusters
_ATTACHES = re.compile("[\ufe00-\ufe0f\U0001F3FB-\U0001F3FF\U000E0020-\U000E007F\U000E0100-\U000E01EF]")


def _is_ri(ch: str) -> bool:
    return "\U0001F1E6" <= ch <= "\U0001F1FF"


def grapheme_bounds(text: str) -> list[int]:
    """Character offsets where each user-perceived character (extended grapheme cluster) of `text`
    starts, and len(text) at the end."""
    if not text:
        return [0]
    if text.isascii():  # a cluster per character, but CR LF is one (most generated text: no regex walk)
        return [i for i in range(len(text)) if not (text[i] == "\n" and i and text[i - 1] == "\r")] + [len(text)]
    if _CLUSTER is not None:
        starts = [m.start() for m in _CLUSTER.finditer(text)]
    else:  # pragma: no cover - regex is a dependency of transformers
        starts, i, n = [], 0, len(text)
        while i < n:
            starts.append(i)
            if text.startswith("\r\n", i):
                i += 2
                continue
            i += 2 if _is_ri(text[i]) and i + 1 < n and _is_ri(text[i + 1]) else 1
            while i < n:
                ch = text[i]
                if unicodedata.category(ch).startswith("M") or _ATTACHES.match(ch):
                    i += 1
                elif ch == "\u200d":
                    i += 2 if i + 1 < n else 1
                else:
                    break
    return starts + [len(text)]


def _inside(raw: bytes, clusters: bool) -> set[int]:
    """Byte offsets of `raw` that fall inside a character (clusters: inside a user-perceived one)."""
    if raw.isascii():  # a character per byte; the one cluster of two is CR LF (no walk over each byte)
        return {i + 1 for i in range(len(raw) - 1) if raw[i] == 13 and raw[i + 1] == 10} if clusters else set()
    return _inside_any(raw, clusters)


def _inside_any(raw: bytes, clusters: bool) -> set[int]:
    """_inside for any bytes."""
    cuts = set()
    units = char_units(raw)
    for a, b, ch in units:
        if ch is not None and b - a > 1:
            cuts.update(range(a + 1, b))
    if not clusters:
        return cuts
    i = 0
    while i < len(units):  # each run of valid characters, split into grapheme clusters
        if units[i][2] is None:
            i += 1
            continue
        j = i
        while j < len(units) and units[j][2] is not None:
            j += 1
        run = units[i:j]
        text = "".join(u[2] for u in run)
        bounds = grapheme_bounds(text)
        for a, b in zip(bounds, bounds[1:]):
            cuts.update(run[c][0] for c in range(a + 1, b))  # the start of every later character in it
        i = j
    return cuts


def codepoint_spans(raws: list[bytes]) -> list[tuple[int, int]]:
    """Token index ranges [start, end): the shortest runs of tokens whose bytes decode together
    (no code point cut at either edge)."""
    return _spans(raws, _inside(b"".join(raws), clusters=False))


def glyph_spans(raws: list[bytes]) -> list[tuple[int, int]]:
    """Token index ranges [start, end): the shortest runs of tokens whose bytes start and end on a
    boundary of user-perceived characters (grapheme clusters: a Burmese syllable's consonant with
    its medials and vowel signs, an emoji ZWJ sequence, a flag, a letter and its combining marks).
    A token holding whole characters is a run of its own; bytes that never make a character end
    their run (shown as <0xNN>)."""
    return _spans(raws, _inside(b"".join(raws), clusters=True))


def _spans(raws: list[bytes], cuts: set[int]) -> list[tuple[int, int]]:
    spans, start, off = [], 0, 0
    for i, r in enumerate(raws):
        off += len(r)
        if off not in cuts:
            spans.append((start, i + 1))
            start = i + 1
    if start < len(raws):  # cannot happen (the end is never inside a character), kept for safety
        spans.append((start, len(raws)))
    return spans


LABEL_GLYPH_CHARS = 8
_MARKER = re.compile(r"⟨[^⟩]*⟩|<0x[0-9A-F]{2}>")


def glyph_label(glyph: str, part: int, parts: int) -> str:
    """A token's label: its glyph, and for a token that is one of several making it, which part
    ("မ·1/3")."""
    if parts <= 1:
        return glyph
    g = glyph
    if len(glyph) > LABEL_GLYPH_CHARS:  # cut, but never inside a ⟨ZWJ⟩ / <0xNN> marker
        cut = LABEL_GLYPH_CHARS - 1
        for m in _MARKER.finditer(glyph):
            if m.start() < cut < m.end():
                cut = m.end()
        g = glyph[:cut] + ("…" if cut < len(glyph) else "")
    return f"{g}·{part}/{parts}"


def describe_raw(ids, raws: list[bytes], texts: list[str] | None = None) -> list[dict]:
    """Token rows from ids and their bytes (see describe_tokens)."""
    rows: list[dict] = []
    display_bytes_once = functools.lru_cache(maxsize=4096)(display_bytes)  # prompts repeat tokens
    for s, e in glyph_spans(raws):
        joined = b"".join(raws[s:e])
        text = joined.decode("utf-8", errors="replace")
        glyph = display_bytes_once(joined)
        for k in range(s, e):
            raw = raws[k]
            own = display_bytes_once(raw)
            rows.append({
                "id": int(ids[k]),
                "text": texts[k] if texts is not None else raw.decode("utf-8", errors="replace"),
                "display": own if e - s == 1 else glyph_label(glyph, k - s + 1, e - s),
                "bytes": hex_bytes(raw), "raw": own,
                "glyph": glyph, "glyph_text": text, "span": [s, e], "part": k - s + 1, "parts": e - s,
            })
    return rows


def _hex_bytes(err: UnicodeDecodeError) -> tuple[str, int]:
    """codecs error handler: each byte that makes no whole character as <0xNN>, as the views show it."""
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start:err.end]), err.end


codecs.register_error("lmscope-hex", _hex_bytes)


def byte_safe_decode(tokenizer, ids) -> str:
    """The tokenizer's decode of ids, unless it holds a replacement character the bytes do not (a
    token sequence cut inside a character): then the bytes, each stray byte as <0xNN>."""
    ids = [int(t) for t in ids]
    text = tokenizer.decode(ids)
    if "\ufffd" not in text:
        return text
    raw = b"".join(token_bytes(tokenizer, t) for t in ids)
    return raw.decode("utf-8", errors="lmscope-hex")


def describe_tokens(tokenizer, ids) -> list[dict]:
    """One row per id:
      id, text     the id and the plain decode of that one token ("�" for a partial character)
      display      what views show for the token: its byte-safe text, or for one of n tokens that
                   only make a character together, "glyph·k/n"
      raw          the token's own bytes shown byte-safe ("<0xE1><0x80>")
      bytes        its byte values in hex ("E1 80"), for hover texts
      glyph, glyph_text  the span's text shown byte-safe / exactly (equal for a token of its own)
      span, part, parts  the span [start, end) of tokens in `ids`, this token's 1-based place in it
    The glyph_text of each span, once per span, concatenates to the decoded bytes of `ids`."""
    ids = [int(t) for t in ids]
    raws = _token_bytes_many(tokenizer, ids)
    if hasattr(tokenizer, "batch_decode"):  # one call into the Rust tokenizer, not one per token
        texts = tokenizer.batch_decode([[t] for t in ids])
    else:
        texts = [tokenizer.decode([t]) for t in ids]
    return describe_raw(ids, raws, texts)


def _token_bytes_many(tokenizer, ids: list[int]) -> list[bytes]:
    """token_bytes of every id, the vocabulary read once per distinct id: a trace of 2,048 tokens
    spends its host time here while the device runs the forward."""
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        return [token_bytes(tokenizer, t) for t in ids]
    distinct = list(dict.fromkeys(ids))
    pieces = tokenizer.convert_ids_to_tokens(distinct)
    literal = _added_ids(tokenizer)
    specials = set(getattr(tokenizer, "all_special_tokens", ()))
    kind = vocab_kind(tokenizer)
    by_id = {}
    for t, piece in zip(distinct, pieces):
        if piece is None:
            by_id[t] = b""
        elif t in literal or piece in specials:
            by_id[t] = piece.encode("utf-8")
        else:
            by_id[t] = piece_bytes(piece, kind)
    return [by_id[t] for t in ids]


def spans_of(rows: list[dict]) -> list[tuple[int, int]]:
    """The (start, end) spans of describe_tokens rows, in order (rows without spans: one each)."""
    out, i = [], 0
    while i < len(rows):
        s, e = rows[i].get("span") or (i, i + 1)
        e = max(e - s, 1) + i  # spans are relative to the list describe_tokens was given
        out.append((i, e))
        i = e
    return out


def pending_bytes(raws: list[bytes]) -> bytes:
    """The bytes at the end of `raws` that start a character not finished yet (b"" if none)."""
    joined = b"".join(raws[-4:])
    for back in range(1, min(4, len(joined)) + 1):
        lead = joined[-back]
        if lead < 0x80:
            return b""
        if lead >= 0xC0:
            w = _utf8_len(lead)
            return joined[-back:] if w > back else b""
    return b""


def continuation_display(pending: bytes, raw: bytes) -> str:
    """How to show a token `raw` that follows unfinished bytes `pending`: "…မ" when it finishes
    the character (the ellipsis: the character started in an earlier token), else byte-safe."""
    if pending and raw:
        units = char_units(pending + raw)
        if units and units[0][2] is not None and units[0][1] > len(pending):
            return "…" + display_bytes(pending + raw)
    return display_bytes(raw)


def spaced_alternative(tokenizer, text) -> dict | None:
    """A target typed without its leading space ("Paris") is a different token from the one a model
    writes mid-sentence (" Paris"). When `text` has no leading space and " " + text is one token
    that differs from what `text` encodes to, says both: {text, ids, shown, spaced, spaced_id,
    spaced_shown} (shown: the tokens as views show them); else None."""
    if not isinstance(text, str) or not text or text[0].isspace() or text.strip().lstrip("-").isdigit():
        return None
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    spaced = list(tokenizer(" " + text, add_special_tokens=False)["input_ids"])
    if len(spaced) != 1 or spaced == ids:
        return None
    return {"text": text, "ids": [int(i) for i in ids], "shown": [r["display"] for r in describe_tokens(tokenizer, ids)],
            "spaced": " " + text, "spaced_id": int(spaced[0]),
            "spaced_shown": describe_tokens(tokenizer, spaced)[0]["display"]}


def byte_tokenizer():
    """A 258-token byte-level tokenizer built in memory (no files, no hub): every byte is a
    token, plus <bos>/<eos>. Random-weight models use it, so they run anywhere, GPU box included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(byte_level_decoder(), key=byte_level_decoder().get))}
    vocab["<bos>"] = 256
    vocab["<eos>"] = 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>")
    return fast
