"""Text corpora for tokenizer training.

builtin: the docstrings of Python's own standard library (real English technical prose that ships
with every Python, no download). Extracted with `ast` from the stdlib's .py files in sorted order,
de-duplicated, capped at BUILTIN_MAX_BYTES; every 10th file goes to the held-out split. Cached
under <cache dir>/corpus/ so extraction runs once per Python version.

uploads: .txt (one document per blank-line separated paragraph) or .jsonl (one JSON object per
line with a "text" string). Checked before any job is queued: empty, binary/non-UTF-8, malformed
and over-limit (LMSCOPE_UPLOAD_MAX_MB, default 20) files are refused with one sentence.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from pathlib import Path

from model_core.core import paths, uploads
from model_core.core.errors import LmscopeError

BUILTIN_VERSION = "stdlib-docstrings-v2"
BUILTIN_MAX_BYTES = 4 * 1024 * 1024
HELDOUT_EVERY = 10


class CorpusError(LmscopeError):
    pass


def _builtin_dir() -> Path:
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    return paths.cache_dir() / "corpus" / f"{BUILTIN_VERSION}-py{v}"


def _docstrings(src: str) -> list[str]:
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node, clean=True)
            if d and len(d) >= 40:
                out.append(d.strip())
    return out


def build_builtin(dest: Path | None = None) -> Path:
    """Extract the stdlib docstrings into dest/{train,heldout}.jsonl (one {"text": docstring} per
    line). Deterministic for a given Python version."""
    dest = dest or _builtin_dir()
    if (dest / "train.jsonl").exists() and (dest / "heldout.jsonl").exists():
        return dest
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not any(part in ("site-packages", "test", "tests", "idle_test", "__pycache__")
                              for part in p.relative_to(stdlib).parts))
    seen: set[str] = set()
    train, held = [], []
    total = 0
    for i, f in enumerate(files):
        try:
            src = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs = []
        for d in _docstrings(src):
            if d not in seen:
                seen.add(d)
                docs.append(d)
        (held if i % HELDOUT_EVERY == 0 else train).extend(docs)
        total += sum(len(d.encode()) + 2 for d in docs)
        if total >= BUILTIN_MAX_BYTES:
            break
    dest.mkdir(parents=True, exist_ok=True)
    for name, docs in (("train", train), ("heldout", held)):
        tmp = dest / f"{name}.jsonl.tmp{os.getpid()}"
        tmp.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        os.replace(tmp, dest / f"{name}.jsonl")
    return dest


def split_docs(text: str) -> list[str]:
    return [d.strip("\n") for d in text.split("\n\n") if d.strip()]


def first_bytes(docs: list[str], max_bytes: int | None) -> list[str]:
    """The leading documents up to max_bytes of UTF-8 in all (at least one; all when None)."""
    if not max_bytes:
        return docs
    out, n = [], 0
    for d in docs:
        n += len(d.encode())
        if n > max_bytes and out:
            break
        out.append(d)
    return out


def builtin_docs(split: str = "train", max_bytes: int | None = None) -> list[str]:
    path = build_builtin() / f"{split}.jsonl"
    docs = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line]
    return first_bytes(docs, max_bytes)


def check_upload(path: str | os.PathLike) -> str:
    """Validate an uploaded corpus file; returns its kind ('txt'|'jsonl') or raises CorpusError.
    Size, lines, line length and each text's length are checked before anything is parsed
    (model_core.core.uploads, the limits every upload reader shares)."""
    p = Path(path)
    name = p.name
    if not p.is_file():
        raise CorpusError(f"Corpus file '{name}' does not exist.")
    ext = p.suffix.lower()
    if ext not in (".txt", ".jsonl"):
        raise CorpusError(f"Corpus file '{name}' must be a .txt or .jsonl file.")
    if p.stat().st_size == 0:
        raise CorpusError(f"Corpus file '{name}' is empty.")
    docs = file_docs(p)
    if not any(d.strip() for d in docs):
        raise CorpusError(f"Corpus file '{name}' has no text to train on.")
    return ext[1:]


def _parse(text: str, ext: str, name: str) -> list[str]:
    lim = uploads.limits()
    lines = uploads.split_lines(text, name, "Corpus file", CorpusError, lim)
    if ext == ".txt":
        return split_docs(text)
    docs = []
    for n, line in lines:
        try:
            obj = uploads.json_line(line, lim)
        except uploads.BadLine as e:
            raise CorpusError(f"Corpus file '{name}' line {n}: {e}.") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise CorpusError(f"Corpus file '{name}' line {n} has no \"text\" string field.")
        if obj["text"].strip():
            docs.append(obj["text"])
    return docs


def file_docs(path: str | os.PathLike) -> list[str]:
    p = Path(path)
    return _parse(uploads.read_text(p, "Corpus file", CorpusError), p.suffix.lower(), p.name)


def split_heldout(docs: list[str]) -> tuple[list[str], list[str]]:
    """Every 10th document is held out, when there are at least 10."""
    if len(docs) < HELDOUT_EVERY:
        return docs, []
    train = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    held = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return train, held
