"""Tokenizer training with HF `tokenizers` and the report that compares it with a reference.

Pure functions (no Redis, no Celery): `validate_params`, `build_tokenizer`, `train`, `report`,
`token_pieces` / `hf_pieces` / `analyse_text` (one text: chips, unknown tokens, round trip). The
Celery task in tasks.tokenizer_job wires them to job records.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from model_core.core.errors import LmscopeError
from tasks.corpus import first_bytes

ALGORITHMS = ("bpe", "byte-level-bpe", "wordpiece", "unigram")
# Below 300 a byte-level vocabulary is little more than its 256-byte alphabet; above 200k the
# embedding table of any model using it dwarfs the small models lmscope is for.
VOCAB_MIN, VOCAB_MAX = 300, 200_000
MIN_FREQ_MAX = 1_000_000
DEFAULT_SPECIALS = {
    "bpe": ["<unk>", "<s>", "</s>", "<pad>"],
    "byte-level-bpe": ["<|endoftext|>"],
    "wordpiece": ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"],
    "unigram": ["<unk>", "<s>", "</s>", "<pad>"],
}
UNK = {"bpe": "<unk>", "wordpiece": "[UNK]", "unigram": "<unk>"}


class TokenizerParamsError(LmscopeError):
    pass


def parse_special_tokens(value) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [t.strip() for t in value.split(",")]
    toks = [str(t).strip() for t in value if str(t).strip()]
    return toks


def validate_params(params: dict) -> dict:
    """Normalise and check training parameters; raises TokenizerParamsError with one sentence."""
    algo = str(params.get("algorithm", "byte-level-bpe")).strip().lower()
    if algo not in ALGORITHMS:
        raise TokenizerParamsError(f"Unknown algorithm '{algo}'; choose one of {', '.join(ALGORITHMS)}.")
    try:
        vocab = int(params.get("vocab_size", 4000))
    except (TypeError, ValueError):
        raise TokenizerParamsError("Vocabulary size must be a whole number.") from None
    if vocab < VOCAB_MIN:
        raise TokenizerParamsError(f"Vocabulary size {vocab} is too small; use at least {VOCAB_MIN}.")
    if vocab > VOCAB_MAX:
        raise TokenizerParamsError(f"Vocabulary size {vocab} is too large; use at most {VOCAB_MAX:,}.")
    try:
        min_freq = int(params.get("min_frequency", 2))
    except (TypeError, ValueError):
        raise TokenizerParamsError("Minimum frequency must be a whole number.") from None
    if not 1 <= min_freq <= MIN_FREQ_MAX:
        raise TokenizerParamsError(f"Minimum frequency must be between 1 and {MIN_FREQ_MAX:,}.")
    specials = parse_special_tokens(params.get("special_tokens"))
    if specials is None or not specials:
        specials = list(DEFAULT_SPECIALS[algo])
    if len(specials) > 100 or any(len(t) > 50 for t in specials):
        raise TokenizerParamsError("Use at most 100 special tokens of at most 50 characters each.")
    specials = list(dict.fromkeys(specials))
    if algo in UNK and UNK[algo] not in specials:
        specials.insert(0, UNK[algo])
    if len(specials) >= vocab // 2:
        raise TokenizerParamsError("Too many special tokens for this vocabulary size.")
    max_mb = params.get("corpus_max_mb")
    if max_mb is not None:
        try:
            max_mb = float(max_mb)
        except (TypeError, ValueError):
            raise TokenizerParamsError("corpus_max_mb must be a positive number.") from None
        if not 0 < max_mb < float("inf"):
            raise TokenizerParamsError("corpus_max_mb must be a positive number.")
    return {**params, "algorithm": algo, "vocab_size": vocab, "min_frequency": min_freq,
            "special_tokens": specials, "corpus_max_mb": max_mb}


def build_tokenizer(p: dict) -> tuple[Tokenizer, object]:
    algo, vocab, mf, sp = p["algorithm"], p["vocab_size"], p["min_frequency"], p["special_tokens"]
    if algo == "byte-level-bpe":  # GPT-2 style: lossless on any text
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=mf, special_tokens=sp,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    elif algo == "bpe":  # character-level BPE over "▁"-marked words (SentencePiece style)
        tok = Tokenizer(models.BPE(unk_token=UNK[algo]))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=mf, special_tokens=sp, show_progress=False)
    elif algo == "wordpiece":  # BERT style, cased
        tok = Tokenizer(models.WordPiece(unk_token=UNK[algo]))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab, min_frequency=mf, special_tokens=sp,
                                            show_progress=False)
    else:  # unigram LM (SentencePiece style); has no min_frequency
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=sp, unk_token=UNK[algo],
                                          show_progress=False)
    return tok, trainer


def train(p: dict, docs: list[str], on_progress: Callable[[float], None] | None = None,
          check_cancel: Callable[[], None] | None = None, chunk: int = 200) -> Tokenizer:
    """Train on docs. The corpus is fed in chunks; between chunks we report the fraction read
    and call check_cancel(), which raises to stop (a job passes tasks.lifecycle.Job.check_cancel);
    once more after training. The merge phase after reading runs in Rust and cannot be
    interrupted cooperatively (a revoke terminates the process instead)."""
    tok, trainer = build_tokenizer(p)

    def batches() -> Iterable[list[str]]:
        n = len(docs)
        for i in range(0, n, chunk):
            if check_cancel:
                check_cancel()
            if on_progress:
                on_progress(i / max(1, n))
            yield docs[i:i + chunk]

    tok.train_from_iterator(batches(), trainer=trainer, length=len(docs))
    if check_cancel:
        check_cancel()
    return tok


# ---- report --------------------------------------------------------------------------------

def _readable(piece: str, algo: str) -> str:
    if algo == "byte-level-bpe":
        return _bytelevel_to_text(piece)
    if algo == "wordpiece":
        return piece[2:] if piece.startswith("##") else piece
    return piece.replace("▁", " ")


def _bytelevel_to_text(piece: str) -> str:
    from model_core.core.tokenization import byte_level_decoder

    table = byte_level_decoder()
    return bytes(table.get(ch, 63) for ch in piece).decode("utf-8", errors="replace")


def merges_of(tok: Tokenizer) -> list[list[str]]:
    model = json.loads(tok.to_str())["model"]
    if model.get("type") != "BPE":
        return []
    return [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model.get("merges", [])]


def compression(encode: Callable[[str], list[str] | list[int]], texts: list[str]) -> dict:
    chars = sum(len(t) for t in texts)
    words = sum(len(t.split()) for t in texts)
    nbytes = sum(len(t.encode()) for t in texts)
    ntok = sum(len(encode(t)) for t in texts)
    return {
        "tokens": ntok, "chars": chars, "words": words, "bytes": nbytes,
        "chars_per_token": round(chars / max(1, ntok), 4),
        "bytes_per_token": round(nbytes / max(1, ntok), 4),
        "tokens_per_word": round(ntok / max(1, words), 4),
    }


def length_histogram(pieces: Iterable[str], max_len: int = 16) -> dict:
    c = Counter(min(len(p), max_len) for p in pieces)
    return {"lengths": list(range(1, max_len + 1)), "counts": [c.get(i, 0) for i in range(1, max_len + 1)],
            "last_bucket_is_at_least": max_len}


def reference_tokenizer(name: str = "smollm2-135m-instruct"):
    """The default model's tokenizer (transformers), or (None, reason)."""
    try:
        from transformers import AutoTokenizer

        from model_core.core.registry import converted_dir

        d = converted_dir(name)
        if not d.exists():
            return None, f"{name} is not converted on this machine (run `lmscope prepare`)"
        return AutoTokenizer.from_pretrained(str(d)), None
    except Exception as e:  # noqa: BLE001 - the report says why, training still succeeds
        return None, f"could not load {name}'s tokenizer: {str(e).splitlines()[0][:200]}"


def report(tok: Tokenizer, p: dict, heldout: list[str], heldout_source: str, train_stats: dict,
           reference: str = "smollm2-135m-instruct", max_eval_bytes: int = 200_000) -> dict:
    algo = p["algorithm"]
    vocab = tok.get_vocab()
    specials = set(p["special_tokens"])
    pieces = [_readable(t, algo) for t in vocab if t not in specials]
    merges = merges_of(tok)

    def fmt(m):
        return [_readable(m[0], algo), _readable(m[1], algo)]

    texts = first_bytes(heldout, max_eval_bytes)
    ids = [tok.encode(s, add_special_tokens=False).ids for s in texts]
    by_text = dict(zip(texts, ids))
    ours = compression(lambda s: by_text[s], texts)
    # unknown tokens on the held-out sample: text the tokenizer cannot represent (0 for byte-level)
    unk_id = unk_id_of(tok)
    ours["unk_tokens"] = sum(x.count(unk_id) for x in ids) if unk_id is not None else 0
    ours["unk_rate"] = round(ours["unk_tokens"] / max(1, ours["tokens"]), 6)
    rt = sum(tok.decode(x, skip_special_tokens=False) == s for s, x in zip(texts, ids))
    ours["roundtrip_exact_fraction"] = round(rt / max(1, len(texts)), 4)
    ref_tok, why = reference_tokenizer(reference)
    ref = {"name": reference}
    if ref_tok is not None:
        ref.update(compression(lambda s: ref_tok.encode(s, add_special_tokens=False), texts))
        ref["vocab_size"] = len(ref_tok)
    else:
        ref["unavailable"] = why
    return {
        "algorithm": algo,
        "params": {k: p[k] for k in ("algorithm", "vocab_size", "min_frequency", "special_tokens")},
        "vocab_size": tok.get_vocab_size(),
        "num_merges": len(merges),
        "first_merges": [fmt(m) for m in merges[:20]],
        "last_merges": [fmt(m) for m in merges[-20:]],
        "first_merges_raw": merges[:20],
        "last_merges_raw": merges[-20:],
        "token_length_histogram": length_histogram(pieces),
        "heldout": {"source": heldout_source, "documents": len(texts)},
        "compression": ours,
        "reference": ref,
        "train": train_stats,
        "python": sys.version.split()[0],
        "created": time.time(),
    }


# ---- one text through one tokenizer: chips, unknowns, round trip ---------------------------
#
# A chip shows the token itself: the vocabulary's string for its id (never the input text it was
# matched on: Unigram and BPE report the input characters as the "token" of an <unk>), made
# byte-safe like everywhere else (model_core.core.tokenization: ␣ space, ↵ newline, byte tokens that
# only make a character together as "glyph·k/n", their <0xNN> bytes kept in `raw` and `bytes`;
# `glyph`, `part`, `parts` say which character and which part of it). Each piece also says which
# characters of the text it covered:
#   start, end  the encoding's offsets (text[start:end]; several byte-level tokens share one
#               character, and an inserted "▁" marker covers none: start == end)
#   text        a partition of the text: the pieces' texts concatenate back to it (whitespace a
#               pre-tokenizer dropped goes to the next token; shared characters to the first)

def unk_id_of(tok: Tokenizer) -> int | None:
    """The id of the tokenizer's unknown token, or None when its model has none (byte-level BPE)."""
    unk = getattr(tok.model, "unk_token", None)  # BPE, WordPiece
    if unk:
        return tok.token_to_id(unk)
    if type(tok.model).__name__ == "Unigram":
        return json.loads(tok.model.__getstate__()).get("unk_id")
    return None


def _pieces(ids, offsets, tokens: list[str], raw: list[bytes], specials: set[int], unk_id: int | None,
            unk_token: str | None, text: str) -> list[dict]:
    from model_core.core.tokenization import describe_raw

    shown = describe_raw(ids, raw)  # byte tokens that make a character together: "မ·1/3" (glyph spans)
    out, pos = [], 0
    for tid, (a, b), token, rb, row in zip(ids, offsets, tokens, raw, shown):
        a, b = min(a, len(text)), min(b, len(text))
        covered = text[a:b]
        readable = rb.decode("utf-8", errors="replace")
        # an inserted marker (Metaspace's leading "▁" before a word): its offsets point at the
        # word, but it stands for a space that is not in the text. It covers nothing.
        marker = bool(tid not in specials and readable and not readable.strip()
                      and covered and not any(ch.isspace() for ch in covered))
        if marker:
            b, piece_text = a, ""
        else:
            end = max(b, pos)
            piece_text, pos = text[pos:end], end
        out.append({
            "id": int(tid), "token": token, "display": token if tid in specials else row["display"],
            "raw": token if tid in specials else row["raw"], "bytes": row["bytes"], "glyph": row["glyph"],
            "part": row["part"], "parts": row["parts"],
            "text": piece_text, "start": a, "end": b,
            # a literal "<unk>" typed in the text is matched as the special token: not unknown text
            "unk": unk_id is not None and tid == unk_id and covered != unk_token,
            "special": tid in specials,
        })
    if pos < len(text) and out:
        out[-1]["text"] += text[pos:]
    return out


def token_pieces(tok: Tokenizer, text: str) -> list[dict]:
    """[{id, token, display, text, start, end, unk, special}] for a `tokenizers` Tokenizer (the
    jobs' tokenizer.json); see the comment above for the fields."""
    from model_core.core.tokenization import piece_bytes, vocab_kind

    enc = tok.encode(text, add_special_tokens=False)
    kind = vocab_kind(tok)  # byte-level, sentencepiece ("▁", <0xNN>) or plain (WordPiece keeps its "##")
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    unk_id = unk_id_of(tok)
    tokens = [tok.id_to_token(i) or "" for i in enc.ids]
    raw = [t.encode("utf-8") if i in specials else piece_bytes(t, kind) for i, t in zip(enc.ids, tokens)]
    return _pieces(enc.ids, enc.offsets, tokens, raw, specials, unk_id,
                   tok.id_to_token(unk_id) if unk_id is not None else None, text)


def hf_pieces(hf_tok, text: str) -> list[dict]:
    """Same as token_pieces for a transformers fast tokenizer (e.g. the default model's)."""
    from model_core.core.tokenization import token_bytes

    enc = hf_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(i) for i in enc["input_ids"]]
    specials = set(getattr(hf_tok, "all_special_ids", ()) or ())
    tokens = [t or "" for t in hf_tok.convert_ids_to_tokens(ids)]
    raw = [token_bytes(hf_tok, i) for i in ids]
    return _pieces(ids, enc["offset_mapping"], tokens, raw, specials, hf_tok.unk_token_id, hf_tok.unk_token, text)


def analyse_text(tok, text: str) -> dict:
    """One text through one tokenizer (a `tokenizers` Tokenizer or a transformers fast tokenizer):
    {pieces, tokens, unknown, unknown_rate (of tokens), unknown_chars (characters covered by
    unknown tokens), roundtrip (decode(encode(text)) == text, special tokens kept), decoded}."""
    if isinstance(tok, Tokenizer):
        pieces = token_pieces(tok, text)
        decoded = tok.decode([p["id"] for p in pieces], skip_special_tokens=False)
    else:
        pieces = hf_pieces(tok, text)
        decoded = tok.decode([p["id"] for p in pieces], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False)
    unk = [p for p in pieces if p["unk"]]
    covered = set()
    for p in unk:
        covered.update(range(p["start"], p["end"]))
    return {"pieces": pieces, "tokens": len(pieces), "unknown": len(unk),
            "unknown_rate": round(len(unk) / len(pieces), 4) if pieces else 0.0,
            "unknown_chars": len(covered), "roundtrip": decoded == text, "decoded": decoded}
