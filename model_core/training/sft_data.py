"""Fine-tuning's data: chat JSONL parsing (malformed lines named by number), the built-in
date-reformat task, tokenisation with the assistant-only loss mask, the train / held-out split and
the collator. The masking rule is described in model_core.training.sft's docstring; everything here
is re-exported there."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from model_core.core import uploads
from model_core.training.sft_settings import (
    BUILTIN,
    IGNORE,
    SIMPLE_CHAT_TEMPLATE,
    DatasetError,
    SFTError,
    SFTSettings,
)

# =============================================================================================
# JSONL parsing

def _check_messages(msgs, where: str) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects.")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: message {j + 1} must be an object with string 'role' and 'content'.")
        role = m["role"].strip().lower()
        if role not in ("system", "user", "assistant"):
            raise DatasetError(f"{where}: message {j + 1} has role {m['role']!r}; use system, user or assistant.")
        out.append({"role": role, "content": m["content"]})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise DatasetError(f"{where}: no assistant turn (nothing to learn from).")
    return out


def parse_example(obj, where: str = "example") -> list[dict]:
    """One JSON object -> a list of messages (prompt/completion becomes user + assistant)."""
    if not isinstance(obj, dict):
        kind = {type(None): "null", list: "a list", str: "a string", bool: "true/false", int: "a number",
                float: "a number"}.get(type(obj), "something else")
        raise DatasetError(f"{where}: expected a JSON object like {{\"messages\": [...]}}, got {kind}.")
    if "messages" in obj:
        return _check_messages(obj["messages"], where)
    if "prompt" in obj or "completion" in obj:
        p, c = obj.get("prompt"), obj.get("completion")
        if not isinstance(p, str) or not isinstance(c, str):
            raise DatasetError(f"{where}: 'prompt' and 'completion' must both be strings.")
        if not c.strip():
            raise DatasetError(f"{where}: no assistant turn (the completion is empty).")
        return [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
    raise DatasetError(f"{where}: needs 'messages', or 'prompt' and 'completion'.")


def read_dataset_text(p: Path, error_cls: type = DatasetError) -> str:
    """A dataset file's text; a missing, oversized, binary or non-UTF-8 file is one sentence of
    `error_cls` (model_core.core.uploads, the one place upload limits live)."""
    return uploads.read_text(p, "Dataset file", error_cls)


def _scan_jsonl(p: Path) -> tuple[list[list[dict]], list[tuple[int, str]], int]:
    """(good conversations in file order, [(line number, reason)] for every bad line, number of
    non-blank lines). Raises DatasetError for a missing, oversized or non-UTF-8 file, too many
    lines or an over-long line (model_core.core.uploads: checked before anything is parsed)."""
    lim = uploads.limits()
    _, lines = uploads.read_lines(p, "Dataset file", DatasetError, lim)
    convs, bad = [], []
    for i, line in lines:
        try:
            obj = uploads.json_line(line, lim)
        except uploads.BadLine as e:
            bad.append((i, str(e)))
            continue
        try:
            convs.append(parse_example(obj, f"line {i}"))
        except DatasetError as e:
            bad.append((i, str(e).removeprefix(f"line {i}: ")))
    return convs, bad, len(lines)


def _bad_lines_text(bad: list[tuple[int, str]], max_errors: int) -> str:
    shown = "; ".join(f"line {i}: {why.rstrip('.')}" for i, why in bad[:max_errors])
    more = f" (and {len(bad) - max_errors} more)" if len(bad) > max_errors else ""
    return shown + more


def load_jsonl(path: str | os.PathLike, max_errors: int = 5, skip_bad: bool = False):
    """Parse a chat JSONL file. Blank lines are skipped. All bad lines are found.

    skip_bad=False (default): -> [conversation, ...]; any bad line raises DatasetError naming up to
    `max_errors` of them with their line numbers (and the column, for broken JSON).
    skip_bad=True: -> (conversations from the good lines, report) where report is
    {file, lines_kept, lines_skipped, skipped: [{line, reason}] (the first `max_errors`), message};
    it still raises DatasetError when no good line is left (naming the bad ones) or there are no
    examples at all. The report's `message` is one sentence for a panel."""
    p = Path(path)
    convs, bad, n = _scan_jsonl(p)
    if bad and not (skip_bad and convs):
        lead = (f"No usable examples in '{p.name}': all {len(bad)} line(s) are malformed: " if skip_bad and not convs
                else f"{len(bad)} malformed line(s) in '{p.name}': ")
        raise DatasetError(lead + _bad_lines_text(bad, max_errors) + ".")
    if not convs:
        raise DatasetError(f"Dataset file '{p.name}' has no examples.")
    if not skip_bad:
        return convs
    if bad:
        message = (f"Kept {len(convs)} of {n} lines of '{p.name}'; skipped {len(bad)} malformed: "
                   + _bad_lines_text(bad, max_errors) + ".")
    else:
        message = f"All {n} lines of '{p.name}' are good."
    return convs, {"file": p.name, "lines_kept": len(convs), "lines_skipped": len(bad),
                   "skipped": [{"line": i, "reason": why} for i, why in bad[:max_errors]], "message": message}


# =============================================================================================
# The built-in demo task: rewrite an ISO date as DD/MM/YYYY.
#
# Checkable (exact match), generated offline from a seed, and a pure format rule that a model must
# copy digits for: SmolLM2-135M-Instruct usually answers in another format, swaps day and month,
# or adds words; a few minutes of SFT on this CPU teach it the rule (see the README for numbers).

BUILTIN_TASK = "date-reformat"
_TEST_SEED_OFFSET = 10_007


def _date_example(rng: random.Random) -> tuple[str, str]:
    y, m = rng.randint(1950, 2049), rng.randint(1, 12)
    d = rng.randint(1, 28 if m == 2 else (30 if m in (4, 6, 9, 11) else 31))
    q = f"Rewrite the date {y:04d}-{m:02d}-{d:02d} in the format DD/MM/YYYY. Answer with the date only."
    return q, f"{d:02d}/{m:02d}/{y:04d}"


def builtin_dataset(n_train: int = 512, n_test: int = 50, seed: int = 0):
    """(train conversations, held-out [(messages without the answer, answer)]); disjoint questions."""
    rng = random.Random(seed)
    test_rng = random.Random(seed + _TEST_SEED_OFFSET)
    test, seen = [], set()
    while len(test) < n_test:
        q, a = _date_example(test_rng)
        if q not in seen:
            seen.add(q)
            test.append(([{"role": "user", "content": q}], a))
    train = []
    while len(train) < n_train:
        q, a = _date_example(rng)
        if q in seen:
            continue
        seen.add(q)
        train.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return train, test


def write_builtin_jsonl(path: str | os.PathLike, n: int = 512, seed: int = 0) -> Path:
    train, _ = builtin_dataset(n, 0, seed)
    p = Path(path)
    p.write_text("".join(json.dumps({"messages": c}) + "\n" for c in train), encoding="utf-8")
    return p


# =============================================================================================
# Tokenisation with the loss mask

def ensure_chat_template(tokenizer) -> bool:
    """Give a template-less tokenizer SIMPLE_CHAT_TEMPLATE. True if one was added."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return True


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(full rendered text, [(start, end)) character spans of the assistant turns incl. end-of-turn)."""
    full = _render(tokenizer, messages, False)
    eos = tokenizer.eos_token or ""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        a = _render(tokenizer, messages[:i], True)
        b = _render(tokenizer, messages[: i + 1], False)
        if not (b.startswith(a) and full.startswith(b)):
            raise SFTError("This model's chat template is not prefix-stable (rendering a conversation changes "
                           "its earlier turns), so the assistant tokens cannot be located; use prompt/completion "
                           "data with a simpler template.")
        start, end = len(a), len(b)
        if eos:
            k = b.rfind(eos, start)
            if k >= 0:
                end = k + len(eos)  # keep the end-of-turn token, drop the glue after it
        if end > start:
            spans.append((start, end))
    return full, spans


def encode_conversation(tokenizer, messages: list[dict]) -> dict:
    """{input_ids, labels, assistant_mask} for one conversation (no truncation)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SFTError("The tokenizer has no chat template; call ensure_chat_template first.")
    full, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(x) for x in enc["input_ids"]]
    mask = []
    for s, _e in enc["offset_mapping"]:  # a token belongs to the turn its first character is in
        mask.append(any(a <= s < b for a, b in spans))
    labels = [t if m else IGNORE for t, m in zip(ids, mask)]
    return {"input_ids": ids, "labels": labels, "assistant_mask": mask}


@dataclass
class EncodedData:
    examples: list[dict]
    total: int
    truncated: int
    dropped: int
    tokens: int
    trained_tokens: int

    def stats(self) -> dict:
        return {"examples": len(self.examples), "total": self.total, "truncated": self.truncated,
                "dropped": self.dropped, "tokens": self.tokens, "trained_tokens": self.trained_tokens}


def encode_dataset(tokenizer, convs: list[list[dict]], max_length: int) -> EncodedData:
    """Encode and cut to max_length tokens (right truncation). An example whose assistant tokens all
    fall beyond max_length is dropped (it would teach nothing); the counts are reported."""
    out, truncated, dropped, tok, trained = [], 0, 0, 0, 0
    for msgs in convs:
        ex = encode_conversation(tokenizer, msgs)
        if len(ex["input_ids"]) > max_length:
            ex = {k: v[:max_length] for k, v in ex.items()}
            if not any(ex["assistant_mask"][1:]):
                dropped += 1
                continue
            truncated += 1
        # The first token is never predicted (labels are shifted inside the model).
        if not any(l != IGNORE for l in ex["labels"][1:]):
            dropped += 1
            continue
        tok += len(ex["input_ids"])
        trained += sum(1 for l in ex["labels"][1:] if l != IGNORE)
        out.append(ex)
    if not out:
        raise DatasetError(f"All {len(convs)} examples are longer than max_length={max_length} before their "
                           "assistant turn; raise max_length.")
    return EncodedData(out, len(convs), truncated, dropped, tok, trained)


def quiet_datasets() -> None:
    """No progress bars from datasets' map/filter (TRL's trainers prepare data with them) in job logs."""
    try:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    except ImportError:  # pragma: no cover - datasets comes with trl
        pass


def _flat(batch: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(every example's input ids, its labels, one after another; each example's length): one tensor
    each, so a batch of hundreds of examples is laid out by indexing rather than per-example copies
    (collation runs between GPU steps). Examples come as tensors (ListDataset) or lists."""
    lens = torch.tensor([len(b["input_ids"]) for b in batch])
    if isinstance(batch[0]["input_ids"], torch.Tensor):
        return torch.cat([b["input_ids"] for b in batch]), torch.cat([b["labels"] for b in batch]), lens
    ids = torch.tensor([t for b in batch for t in b["input_ids"]], dtype=torch.long)
    labels = torch.tensor([t for b in batch for t in b["labels"]], dtype=torch.long)
    return ids, labels, lens


def _within(lens: torch.Tensor) -> torch.Tensor:
    """For every token, its place inside its own example."""
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)


class Collator:
    """Right-pad a batch; labels padded with -100."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict:
        flat_ids, flat_labels, lens = _flat(batch)
        B, T = len(batch), int(lens.max())
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        labels = torch.full((B, T), IGNORE, dtype=torch.long)
        att = torch.zeros((B, T), dtype=torch.long)
        row, col = torch.repeat_interleave(torch.arange(B), lens), _within(lens)
        ids[row, col], labels[row, col], att[row, col] = flat_ids, flat_labels, 1
        return {"input_ids": ids, "labels": labels, "attention_mask": att}


class PackingCollator:
    """Padding-free batches: a step's examples packed first-fit (longest first) into rows of at most
    `row_tokens` tokens, position_ids restarting at each example and no attention mask, so that
    transformers' masking (masking_utils.find_packed_sequence_indices) keeps every example to its
    own tokens. The first token of each example gets no label (the one before it belongs to another
    example). What is left at the end of a row is one padding segment of its own, label -100. The
    loss is the same mean over the same tokens as Collator's padded batch (tests/unit/test_sft_packing.py)."""

    def __init__(self, pad_id: int, row_tokens: int):
        self.pad_id = pad_id
        self.row_tokens = int(row_tokens)

    def rows(self, batch: list[dict]) -> list[list[dict]]:
        cap = max(self.row_tokens, max(len(b["input_ids"]) for b in batch))
        rows: list[list[dict]] = []
        room: list[int] = []
        for b in sorted(batch, key=lambda b: -len(b["input_ids"])):
            n = len(b["input_ids"])
            i = next((j for j, r in enumerate(room) if r >= n), None)
            if i is None:
                rows.append([])
                room.append(cap)
                i = len(rows) - 1
            rows[i].append(b)
            room[i] -= n
        return rows

    def __call__(self, batch: list[dict]) -> dict:
        rows = self.rows(batch)
        order = [b for r in rows for b in r]
        flat_ids, flat_labels, lens = _flat(order)
        row_of = torch.tensor([i for i, r in enumerate(rows) for _ in r])
        used = torch.zeros(len(rows), dtype=torch.long).index_add_(0, row_of, lens)
        T = int(used.max())
        starts = torch.cumsum(lens, 0) - lens  # each example's offset in the flat layout ...
        row_start = torch.cumsum(used, 0) - used
        offset = starts - row_start[row_of]  # ... and in its row
        within = _within(lens)
        row, col = torch.repeat_interleave(row_of, lens), torch.repeat_interleave(offset, lens) + within
        flat_labels = flat_labels.clone()
        flat_labels[starts] = IGNORE  # an example's first token: the token before it is another example's
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
        # the padding after each row's examples: a segment of its own (positions from 0)
        pos = torch.arange(T).expand(len(rows), T) - used[:, None]
        pos = pos.clamp(min=0).clone()
        ids[row, col], labels[row, col], pos[row, col] = flat_ids, flat_labels, within
        # use_cache=False: with a cache, transformers builds a plain causal mask over the whole row
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "use_cache": False}


def unused_token_id(examples: list[dict], vocab_size: int) -> int:
    """The largest token id no example uses: a packed batch's padding, so that the Trainer's
    non-padding count (input_ids != pad id) counts exactly the examples' tokens (the tokenizer's
    own pad id is often its end-of-turn token, which the examples hold)."""
    used = {t for e in examples for t in e["input_ids"]}
    return next(i for i in range(vocab_size - 1, -1, -1) if i not in used)


@dataclass
class PadOnly:
    """The Trainer's processing_class for packed batches: it reads pad_token_id to count tokens."""

    pad_token_id: int


class ListDataset(torch.utils.data.Dataset):
    """Encoded examples as the Trainer reads them (input_ids and labels; Collator pads them), held as
    tensors: building a batch from Python lists took 8.5 ms for 512 examples on the 2-core CPU,
    from tensors 1.8 ms, and on a GPU that time sits between the steps."""

    def __init__(self, rows):
        self.rows = [{"input_ids": torch.tensor(r["input_ids"], dtype=torch.long),
                      "labels": torch.tensor(r["labels"], dtype=torch.long)} for r in rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


# =============================================================================================
# Train / held-out split and the data of one run

def held_out_split(rows: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded shuffle, at least one held-out row once there are 4 and a
    fraction is asked for, never all of them."""
    idx = list(range(len(rows)))
    random.Random(seed).shuffle(idx)
    n_eval = int(round(len(rows) * eval_fraction))
    if eval_fraction > 0 and len(rows) >= 4:
        n_eval = max(1, n_eval)
    n_eval = min(n_eval, len(rows) - 1)
    return [rows[i] for i in idx[n_eval:]], [rows[i] for i in idx[:n_eval]]


def heldout_from_convs(convs: list[list[dict]]) -> list[tuple[list[dict], str]]:
    """Held-out items from eval conversations: everything before the last assistant turn -> its text."""
    items = []
    for c in convs:
        last = max(i for i, m in enumerate(c) if m["role"] == "assistant")
        items.append((c[:last], c[last]["content"]))
    return items


def prepare_data(s: SFTSettings, tokenizer):
    """-> (train EncodedData, eval EncodedData | None, held-out accuracy items, dataset description)."""
    train, ev, test, _samples, desc = prepare_run_data(s, tokenizer)
    return train, ev, test, desc


def prepare_run_data(s: SFTSettings, tokenizer):
    """prepare_data plus the prompts sampled during training: the first `sample_prompts` held-out items
    (built-in task: its held-out questions, with answers; uploads: the eval split's conversations up
    to their last assistant turn, whose text is the expected answer). Never trained on."""
    n_samples = s.sample_prompts if s.sample_every != 0 else 0
    if s.dataset == BUILTIN:
        convs, held = builtin_dataset(s.builtin_train_size, max(s.accuracy_examples, n_samples), s.seed)
        desc = {"source": BUILTIN, "task": BUILTIN_TASK, "size": len(convs)}
    else:
        convs = load_jsonl(s.dataset)
        held = None
        desc = {"source": "upload", "file": Path(s.dataset).name, "size": len(convs)}
    train_c, eval_c = held_out_split(convs, s.eval_fraction, s.seed)
    if held is None:
        held = heldout_from_convs(eval_c)
    train = encode_dataset(tokenizer, train_c, s.max_length)
    ev = encode_dataset(tokenizer, eval_c, s.max_length) if eval_c else None
    return train, ev, held[: s.accuracy_examples], held[:n_samples], desc
