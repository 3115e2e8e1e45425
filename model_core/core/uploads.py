"""Every uploaded text file is read here, under one set of limits, before anything parses or
tokenizes it: the file's size, the number of lines, each line's length, each text field's length
and JSON nesting. The README's promise ("every text is capped before anything tokenizes it:
LMSCOPE_MAX_PROMPT_TOKENS tokens, and 16 characters per token") holds for uploads through this
module; its callers are the SFT, preference and task readers (model_core/training/*) and the
corpus reader (tasks/corpus.py), used by the web app's upload endpoints and by the jobs alike.

Why characters and not tokens: a tokenizer's cost on one long "word" grows much faster than its
length (a 15 MB line of one letter held a core and 8-15 GB for minutes), so the cap has to hold
before the tokenizer sees the text. A failure is one sentence of the caller's error class naming
the line."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from model_core.core import settings
from model_core.core.errors import LmscopeError

CHARS_PER_TOKEN = 16  # the same rule as the app's text inputs (app/shared/context.py CHARS_PER_TOKEN_CAP)
TEXTS_PER_LINE = 4  # a line may hold a few texts at the cap (a prompt and two answers, a short chat)
MAX_LINES = 200_000  # examples or paragraphs in one file; far more than a fine-tune of minutes needs
MAX_DEPTH = 32  # JSON nesting: a chat line is 3 levels deep; anything deeper is not our format


class UploadError(LmscopeError):
    pass


class BadLine(ValueError):
    """One line's problem (the reader collects these with line numbers)."""


@dataclass(frozen=True)
class UploadLimits:
    max_bytes: int
    text_chars: int  # one text (a prompt, a message, a document line)
    line_chars: int
    max_lines: int = MAX_LINES
    max_depth: int = MAX_DEPTH

    @property
    def tokens(self) -> int:
        return self.text_chars // CHARS_PER_TOKEN


def limits() -> UploadLimits:
    """The limits this process runs with (LMSCOPE_MAX_PROMPT_TOKENS and LMSCOPE_UPLOAD_MAX_MB)."""
    s = settings.current()
    text = s.max_prompt_tokens * CHARS_PER_TOKEN
    return UploadLimits(max_bytes=s.upload_max_bytes, text_chars=text, line_chars=text * TEXTS_PER_LINE)


def read_text(path: str | os.PathLike, what: str = "Dataset file", error_cls: type = UploadError,
              lim: UploadLimits | None = None) -> str:
    """A file's UTF-8 text after the size check; a missing, oversized, binary or non-UTF-8 file is
    one sentence of `error_cls`."""
    lim = lim or limits()
    p = Path(path)
    if not p.is_file():
        raise error_cls(f"{what} '{p.name}' does not exist.")
    size = p.stat().st_size
    if size > lim.max_bytes:
        raise error_cls(f"{what} '{p.name}' is {size / 2**20:.1f} MB, over this server's "
                        f"{lim.max_bytes / 2**20:.0f} MB upload limit.")
    raw = p.read_bytes()
    if b"\x00" in raw:
        raise error_cls(f"{what} '{p.name}' looks binary (it contains NUL bytes); upload UTF-8 text.")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error_cls(f"{what} '{p.name}' is not valid UTF-8 text (bad byte at offset {e.start}).") from None


def split_lines(text: str, name: str, what: str = "Dataset file", error_cls: type = UploadError,
                lim: UploadLimits | None = None) -> list[tuple[int, str]]:
    """[(line number, line)] for the non-blank lines, after the line-count and line-length checks
    (the first line over the limit is named; nothing is parsed before every line has passed)."""
    lim = lim or limits()
    n_lines = text.count("\n") + 1
    if n_lines > lim.max_lines:
        raise error_cls(f"{what} '{name}' has {n_lines:,} lines; this server takes at most {lim.max_lines:,}.")
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if len(line) > lim.line_chars:
            raise error_cls(f"{what} '{name}' line {i} is {len(line):,} characters long; this server takes at most "
                            f"{lim.line_chars:,} per line ({lim.text_chars:,} per text, about {lim.tokens:,} tokens).")
        if line.strip():
            out.append((i, line))
    return out


def read_lines(path: str | os.PathLike, what: str = "Dataset file", error_cls: type = UploadError,
               lim: UploadLimits | None = None) -> tuple[str, list[tuple[int, str]]]:
    """(file name, [(line number, line)] of the non-blank lines) of an uploaded file, every limit checked."""
    lim = lim or limits()
    p = Path(path)
    return p.name, split_lines(read_text(p, what, error_cls, lim), p.name, what, error_cls, lim)


def _depth_over(line: str, max_depth: int) -> bool:
    """True when brackets outside strings nest deeper than max_depth (checked before json.loads,
    whose recursion would otherwise be the limit)."""
    if line.count("[") + line.count("{") <= max_depth:
        return False
    depth, in_str, esc = 0, False, False
    for ch in line:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _long_text(obj, max_chars: int) -> int:
    """The length of the first string (key or value) longer than max_chars in a parsed line, else 0."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if len(x) > max_chars:
                return len(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return 0


def json_line(line: str, lim: UploadLimits | None = None):
    """One JSONL line parsed, or BadLine with the reason (no line number: the caller adds it).
    Nesting and each text's length are checked; json's own errors become plain words."""
    lim = lim or limits()
    if _depth_over(line, lim.max_depth):
        raise BadLine(f"nested more than {lim.max_depth} levels deep")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadLine(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # the depth check above should make this unreachable; kept as a backstop
        raise BadLine(f"nested more than {lim.max_depth} levels deep") from None
    n = _long_text(obj, lim.text_chars)
    if n:
        raise BadLine(f"a text of {n:,} characters; this server takes at most {lim.text_chars:,} "
                      f"(about {lim.tokens:,} tokens)")
    return obj


def check_text(text: str, where: str, error_cls: type = UploadError, lim: UploadLimits | None = None) -> str:
    """One text (a .txt paragraph) under the per-text cap, or one sentence naming where it is."""
    lim = lim or limits()
    if len(text) > lim.text_chars:
        raise error_cls(f"{where} is a text of {len(text):,} characters; this server takes at most "
                        f"{lim.text_chars:,} (about {lim.tokens:,} tokens).")
    return text
