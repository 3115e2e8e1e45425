"""Tokens as people should see them: ids, decoded text, and a byte-safe display string.

Byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) stores bytes as printable stand-in characters
("Ġ" is a space); SentencePiece (Gemma, Llama 2) uses "▁" and <0xNN> byte-fallback tokens.
We recover each token's raw bytes so that spaces, newlines and partial UTF-8 sequences show
up honestly instead of as "�".
"""

from __future__ import annotations

import functools
import re

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
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


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes a token stands for (best effort for unusual vocabularies)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    if piece in getattr(tokenizer, "all_special_tokens", ()):
        return piece.encode("utf-8")
    m = _BYTE_FALLBACK.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    table = _byte_level_decoder()
    if "▁" not in piece and all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.replace("▁", " ").encode("utf-8")


_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def display_bytes(raw: bytes) -> str:
    """Byte-safe display: whitespace made visible, control chars and broken UTF-8 as <0xNN>."""
    out: list[str] = []
    i = 0
    while i < len(raw):
        # Decode the longest valid UTF-8 sequence starting at i (1..4 bytes).
        for width in (1, 2, 3, 4):
            chunk = raw[i : i + width]
            try:
                ch = chunk.decode("utf-8")
            except UnicodeDecodeError:
                continue
            break
        else:
            out.append(f"<0x{raw[i]:02X}>")
            i += 1
            continue
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif len(ch) == 1 and (ord(ch) < 32 or ord(ch) == 127):
            out.append(f"<0x{ord(ch):02X}>")
        else:
            out.append(ch)
        i += len(chunk)
    return "".join(out)


def describe_tokens(tokenizer, ids) -> list[dict]:
    """[{id, text, display}] for a sequence of ids; `text` is the plain decode of that one token."""
    rows = []
    for tid in ids:
        tid = int(tid)
        rows.append({
            "id": tid,
            "text": tokenizer.decode([tid]),
            "display": display_bytes(token_bytes(tokenizer, tid)),
        })
    return rows


def byte_tokenizer():
    """A 258-token byte-level tokenizer built in memory (no files, no hub): every byte is a
    token, plus <bos>/<eos>. Random-weight models use it, so they run anywhere, GPU box included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(_byte_level_decoder(), key=_byte_level_decoder().get))}
    vocab["<bos>"] = 256
    vocab["<eos>"] = 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>")
    return fast
