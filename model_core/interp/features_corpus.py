"""The text features are trained and evaluated on: the built-in corpus (the standard library's
docstrings) or a list of texts, split into train and held-out, and cut into token windows.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from model_core.core import paths
from model_core.interp.features_sae import DEFAULT_CONTEXT, FeatureError

DEFAULT_EVAL_TOKENS = 4096  # three full forwards each (clean, spliced, zero-ablated): ~1/3 of 100k training tokens on a CPU

# The same text and files as tasks/corpus.py's builtin (the standard library's docstrings; every
# 10th file held out; the jsonl files it caches under <cache dir>/corpus/), readable from model_core.

BUILTIN_VERSION = "stdlib-docstrings-v2"
_BUILTIN_MAX_BYTES = 4 * 1024 * 1024


def builtin_texts(split: str = "train") -> list[str]:
    """The built-in corpus's documents ('train' or 'heldout'), extracted once per Python version."""
    if split not in ("train", "heldout"):
        raise FeatureError("The built-in corpus has the splits 'train' and 'heldout'.")
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    dest = paths.cache_dir() / "corpus" / f"{BUILTIN_VERSION}-py{v}"
    if not ((dest / "train.jsonl").exists() and (dest / "heldout.jsonl").exists()):
        _extract_builtin(dest)
    lines = (dest / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines if line]


def _extract_builtin(dest: Path) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test", "__pycache__")
    files = sorted(p for p in stdlib.rglob("*.py") if not any(s in skip for s in p.relative_to(stdlib).parts))
    seen: set[str] = set()
    split: dict[str, list[str]] = {"train": [], "heldout": []}
    total = 0
    for i, f in enumerate(files):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
            continue
        docs = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node, clean=True)
                if d and len(d) >= 40 and d.strip() not in seen:
                    seen.add(d.strip())
                    docs.append(d.strip())
        split["heldout" if i % 10 == 0 else "train"].extend(docs)
        total += sum(len(d.encode()) + 2 for d in docs)
        if total >= _BUILTIN_MAX_BYTES:
            break
    dest.mkdir(parents=True, exist_ok=True)
    for name, docs in split.items():
        tmp = dest / f"{name}.jsonl.tmp{os.getpid()}"
        tmp.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        os.replace(tmp, dest / f"{name}.jsonl")


def dataset_texts(dataset, split: str) -> list[str]:
    """'builtin' -> the built-in corpus's split; a list of texts -> every 10th for 'heldout', the
    rest for 'train' (all of them for both when fewer than 10)."""
    if dataset == "builtin":
        return builtin_texts(split)
    if isinstance(dataset, (list, tuple)) and dataset and all(isinstance(t, str) for t in dataset):
        texts = [t for t in dataset if t.strip()]
        if len(texts) < 10:
            return texts
        return [t for i, t in enumerate(texts) if (i % 10 == 9) == (split == "heldout")]
    raise FeatureError("The dataset must be 'builtin' or a list of texts.")


def window_batches(tokenizer, texts: Iterable[str], n_tokens: int, context: int,
                   batch_size: int) -> Iterator[torch.Tensor]:
    """[<=batch_size, context] int64 batches: the texts tokenized one after another (each followed
    by a blank line, no special tokens) and cut into whole windows, n_tokens at most in all. Holds
    one text's tokens and one batch at a time."""
    if context < 2:
        raise FeatureError("The context must be at least 2 tokens.")
    ids: list[int] = []
    rows: list[list[int]] = []
    left = int(n_tokens) // context
    for t in texts:
        if left <= 0:
            break
        ids += tokenizer(t + "\n\n", add_special_tokens=False)["input_ids"]
        while len(ids) >= context and left > 0:
            rows.append(ids[:context])
            ids = ids[context:]
            left -= 1
            if len(rows) == batch_size:
                yield torch.tensor(rows, dtype=torch.int64)
                rows = []
    if rows:
        yield torch.tensor(rows, dtype=torch.int64)


def eval_windows(tokenizer, dataset, eval_tokens: int = DEFAULT_EVAL_TOKENS,
                 context: int = DEFAULT_CONTEXT) -> torch.Tensor:
    """[N, context]: the held-out windows every evaluation reads (the first eval_tokens tokens)."""
    batches = list(window_batches(tokenizer, dataset_texts(dataset, "heldout"), eval_tokens, context, 1 << 30))
    if not batches:
        raise FeatureError(f"The held-out text has fewer than {context} tokens; nothing to evaluate on.")
    return batches[0]
