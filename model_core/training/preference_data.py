"""Data for preference training (reward models, DPO) and RL with verifiable rewards (GRPO).

Pure Python: no torch, no TRL. Everything built in is generated offline from a seed, so a run is
reproducible and its data hash is stable.

Preference pairs (PreferenceData: train + held-out test):
  - "date": the SFT demo task (rewrite an ISO date as DD/MM/YYYY, answer with the date only).
    chosen = the correct DD/MM/YYYY; rejected = a plausible wrong answer, labelled by kind:
    "swap" (MM/DD/YYYY, the classic US/EU mix-up), "iso" (the input left as it was), "dashes"
    (DD-MM-YYYY), "short-year" (DD/MM/YY), "off-by-one" (the day one off).
  - "style": short factual questions; chosen = the concise answer ("Paris."), rejected = a
    rambling answer with the same fact wrapped in filler. Test questions use facts that no train
    question uses, so held-out accuracy measures the style preference, not memorised facts.
  Uploads: JSONL, one {"prompt": str, "chosen": str, "rejected": str} per line.

Verifiable tasks (TaskData: train + held-out test), each with a verifier that is plain code:
  - "arithmetic": "What is 7 + 5? Answer with the number only." (verifier "number": the last
    number in the answer equals the sum). SmolLM2-135M-Instruct is right about half the time
    (it often answers "7 + 5 = 12", or starts explaining and runs out of tokens), so GRPO has
    groups with both outcomes to learn from.
  - "date": the date task above (verifier "date": the whole answer is the expected DD/MM/YYYY).
    The 135M model is never right on it before SFT, so GRPO alone gets no signal there.
  Uploads: JSONL, one {"prompt": str, "answer": str | number} per line (optionally "verifier":
  name, else the one chosen for the run).

Malformed upload lines are all found before anything runs and reported by line number, one
sentence each (PreferenceDataError.lines).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from model_core.core import uploads
from model_core.training.sft_data import held_out_split
from model_core.training.sft_settings import DatasetError

BUILTIN = "builtin"
PREFERENCE_SETS = ("date", "style")
TASK_SETS = ("arithmetic", "date")
DEFAULT_TASK_SET = "arithmetic"
_TEST_SEED_OFFSET = 10_007
MAX_ERRORS_SHOWN = 5


class PreferenceDataError(DatasetError):
    """Bad upload data. str() is one paragraph for the user; `lines` = [(line number, sentence)] for
    every malformed line (empty when the problem is the file itself)."""

    def __init__(self, message: str, lines: list[tuple[int, str]] | None = None):
        super().__init__(message)
        self.lines = list(lines or [])


# =============================================================================================
# Records

@dataclass(frozen=True)
class PreferencePair:
    prompt: str  # the user's message
    chosen: str  # the preferred assistant answer
    rejected: str  # the dispreferred one
    kind: str = ""  # built-in: "date/swap", "style/rambling", ...; uploads: ""

    def conversational(self) -> dict:
        """The row TRL's DPOTrainer / RewardTrainer take (conversational: the chat template applies)."""
        return {"prompt": [{"role": "user", "content": self.prompt}],
                "chosen": [{"role": "assistant", "content": self.chosen}],
                "rejected": [{"role": "assistant", "content": self.rejected}]}


@dataclass(frozen=True)
class Task:
    prompt: str  # the user's message
    answer: str  # what the verifier checks against ("" when the verifier needs none)
    verifier: str  # a key of VERIFIERS
    kind: str = ""

    def conversational(self) -> dict:
        """The row TRL's GRPOTrainer takes; extra columns reach the reward function as keyword lists."""
        return {"prompt": [{"role": "user", "content": self.prompt}], "answer": self.answer,
                "verifier": self.verifier}


def _hash_rows(tag: str, train: list, test: list) -> str:
    h = hashlib.sha256(tag.encode())
    for split, rows in (("train", train), ("test", test)):
        for r in rows:
            h.update(json.dumps([split, asdict(r)], sort_keys=True, ensure_ascii=False).encode())
            h.update(b"\n")
    return "sha256:" + h.hexdigest()[:16]


@dataclass
class PreferenceData:
    train: list[PreferencePair]
    test: list[PreferencePair]
    source: dict = field(default_factory=dict)  # {"source": "builtin", "sets": [...]} | {"source": "upload", ...}

    def data_hash(self) -> str:
        """sha256 (16 hex) of every pair with its split, in order: two runs on equal data share it."""
        return _hash_rows("preference", self.train, self.test)

    def describe(self) -> dict:
        kinds: dict[str, int] = {}
        for p in self.train:
            kinds[p.kind or "upload"] = kinds.get(p.kind or "upload", 0) + 1
        return {**self.source, "train": len(self.train), "test": len(self.test), "train_kinds": kinds,
                "hash": self.data_hash()}


@dataclass
class TaskData:
    train: list[Task]
    test: list[Task]
    source: dict = field(default_factory=dict)

    def data_hash(self) -> str:
        return _hash_rows("tasks", self.train, self.test)

    def describe(self) -> dict:
        verifiers = sorted({t.verifier for t in self.train + self.test})
        return {**self.source, "train": len(self.train), "test": len(self.test), "verifiers": verifiers,
                "hash": self.data_hash()}


# =============================================================================================
# Verifiers: completion text -> reward in [0, 1]

def normalise_answer(s: str) -> str:
    """Whitespace collapsed, a final period and surrounding spaces dropped (as SFT's accuracy)."""
    return " ".join(s.strip().split()).rstrip(".").strip()


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_DATE = re.compile(r"^(\d{2})/(\d{2})/(\d{4})$")


def _as_number(s: str) -> float | None:
    try:
        return float(s.replace(",", "").strip())
    except ValueError:
        return None


def verify_exact(completion: str, answer: str) -> float:
    """1 when the whole answer equals the expected text (case, spacing and a final period ignored)."""
    return float(normalise_answer(completion).lower() == normalise_answer(answer).lower())


def verify_number(completion: str, answer: str) -> float:
    """1 when the last number in the answer equals the expected number (the usual math-answer rule)."""
    nums = _NUMBER.findall(completion.replace(",", ""))
    want = _as_number(answer)
    return float(bool(nums) and want is not None and abs(float(nums[-1]) - want) < 1e-9)


def verify_date(completion: str, answer: str) -> float:
    """1 when the whole answer is the expected date written DD/MM/YYYY (spacing, final period ignored)."""
    got = normalise_answer(completion)
    return float(bool(_DATE.match(got)) and got == normalise_answer(answer))


@dataclass(frozen=True)
class Verifier:
    name: str
    fn: Callable[[str, str], float]
    description: str
    check_answer: Callable[[str], str | None] | None = None  # -> reason the answer is unusable, or None


def _check_number(a: str) -> str | None:
    return None if _as_number(a) is not None else f"'answer' must be a number for the number verifier, got {a!r}"


def _check_date(a: str) -> str | None:
    return None if _DATE.match(normalise_answer(a)) else f"'answer' must be a date written DD/MM/YYYY, got {a!r}"


VERIFIERS: dict[str, Verifier] = {
    "exact": Verifier("exact", verify_exact, verify_exact.__doc__.strip()),
    "number": Verifier("number", verify_number, verify_number.__doc__.strip(), _check_number),
    "date": Verifier("date", verify_date, verify_date.__doc__.strip(), _check_date),
}


def score(completion: str, answer: str, verifier: str) -> float:
    """The verifier's reward for one completion."""
    v = VERIFIERS.get(verifier)
    if v is None:
        raise DatasetError(f"Unknown verifier {verifier!r}; use one of {', '.join(VERIFIERS)}.")
    return float(v.fn(completion, answer))


def completion_text(completion) -> str:
    """A TRL completion (text, or conversational [{role, content}, ...]) as plain text."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(m.get("content", "") if isinstance(m, dict) else str(m) for m in completion)
    return str(completion)


def verifiable_reward(completions, answer, verifier, **_) -> list[float]:
    """TRL reward function (GRPOTrainer's reward_funcs signature): the named verifier of each row
    applied to its completion. `answer` and `verifier` come from the dataset's columns."""
    return [score(completion_text(c), a, v) for c, a, v in zip(completions, answer, verifier)]


verifiable_reward.__name__ = "verifier"  # TRL logs rewards/<name>/mean


# =============================================================================================
# Built-in data

_DAYS_IN = {2: 28, 4: 30, 6: 30, 9: 30, 11: 30}
DATE_PROMPT = "Rewrite the date {y:04d}-{m:02d}-{d:02d} in the format DD/MM/YYYY. Answer with the date only."


def _random_date(rng: random.Random) -> tuple[int, int, int]:
    y, m = rng.randint(1950, 2049), rng.randint(1, 12)
    return y, m, rng.randint(1, _DAYS_IN.get(m, 31))


def _wrong_date(y: int, m: int, d: int, rng: random.Random) -> tuple[str, str]:
    """(kind, a plausible wrong answer) for the date task; never equal to the right one."""
    right = f"{d:02d}/{m:02d}/{y:04d}"
    kinds = ["swap", "swap", "swap", "iso", "dashes", "short-year", "off-by-one"]
    while True:
        kind = rng.choice(kinds)
        wrong = {
            "swap": f"{m:02d}/{d:02d}/{y:04d}",
            "iso": f"{y:04d}-{m:02d}-{d:02d}",
            "dashes": f"{d:02d}-{m:02d}-{y:04d}",
            "short-year": f"{d:02d}/{m:02d}/{y % 100:02d}",
            "off-by-one": f"{(d % 28) + 1:02d}/{m:02d}/{y:04d}",
        }[kind]
        if wrong != right:
            return kind, wrong


def _date_pairs(n: int, rng: random.Random, avoid: set[str]) -> list[PreferencePair]:
    out = []
    while len(out) < n:
        y, m, d = _random_date(rng)
        q = DATE_PROMPT.format(y=y, m=m, d=d)
        if q in avoid:
            continue
        avoid.add(q)
        kind, wrong = _wrong_date(y, m, d, rng)
        out.append(PreferencePair(q, f"{d:02d}/{m:02d}/{y:04d}", wrong, f"date/{kind}"))
    return out


# Facts for the style set: (question, concise answer, the answer inside a sentence).
_FACTS = (
    [(f"What is the capital of {c}?", f"{k}.", f"the capital of {c} is {k}") for c, k in [
        ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
        ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"),
        ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Poland", "Warsaw"), ("Ireland", "Dublin"),
        ("Austria", "Vienna"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Chile", "Santiago"),
        ("Cuba", "Havana"), ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"), ("Denmark", "Copenhagen"),
        ("Hungary", "Budapest"), ("Belgium", "Brussels")]]
    + [(f"What is {a} times {b}?", f"{a * b}.", f"{a} times {b} is {a * b}") for a, b in [
        (3, 4), (6, 7), (8, 9), (5, 6), (7, 7), (9, 4), (2, 8), (6, 9), (4, 7), (3, 9), (8, 6), (5, 8)]]
    + [(f"What is the opposite of {w}?", f"{o.capitalize()}.", f"the opposite of {w} is {o}") for w, o in [
        ("hot", "cold"), ("up", "down"), ("early", "late"), ("light", "dark"), ("full", "empty"),
        ("wet", "dry"), ("fast", "slow"), ("open", "closed"), ("strong", "weak"), ("loud", "quiet")]]
    + [(f"Which day comes after {a}?", f"{b}.", f"the day after {a} is {b}") for a, b in [
        ("Monday", "Tuesday"), ("Tuesday", "Wednesday"), ("Wednesday", "Thursday"), ("Thursday", "Friday"),
        ("Friday", "Saturday"), ("Saturday", "Sunday"), ("Sunday", "Monday")]]
    + [(f"What is the plural of {s}?", f"{p.capitalize()}.", f"the plural of {s} is {p}") for s, p in [
        ("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"), ("goose", "geese"),
        ("man", "men"), ("woman", "women"), ("person", "people")]]
)

_OPENERS = [
    "Great question! Let me think about this carefully.",
    "That is a really interesting thing to ask.",
    "Well, there are many ways to look at this.",
    "Thank you for asking! I am happy to explain.",
    "Okay, so, let me start from the beginning.",
]
_MIDDLES = ["After some thought,", "Putting it all together,", "To put it simply,", "As it turns out,"]
_CLOSERS = [
    "I hope this helps, and let me know if you have more questions!",
    "There is always more to learn about topics like this.",
    "It is a fascinating subject, so feel free to ask more.",
    "Let me know if anything here was unclear.",
]


def _rambling(sentence: str, rng: random.Random) -> str:
    return (f"{rng.choice(_OPENERS)} {rng.choice(_MIDDLES)} {sentence}. "
            f"{rng.choice(_CLOSERS)}")


def _style_pairs(n_train: int, n_test: int, seed: int) -> tuple[list[PreferencePair], list[PreferencePair]]:
    facts = list(_FACTS)
    random.Random(seed).shuffle(facts)
    n_test_facts = max(1, len(facts) // 4) if n_test else 0
    test_facts, train_facts = facts[:n_test_facts], facts[n_test_facts:]
    rng, test_rng = random.Random(seed + 1), random.Random(seed + _TEST_SEED_OFFSET)

    def make(pool, k, r):
        out = []
        for i in range(k):
            q, short, sentence = pool[i % len(pool)]
            out.append(PreferencePair(q, short, _rambling(sentence, r), "style/rambling"))
        return out

    return make(train_facts, n_train, rng), (make(test_facts, n_test, test_rng) if n_test else [])


def builtin_preferences(n_train: int = 128, n_test: int = 40, seed: int = 0,
                        sets: tuple[str, ...] | list[str] = PREFERENCE_SETS) -> PreferenceData:
    """Built-in preference pairs: the sets named (split evenly, the date set takes any odd one),
    train and held-out test with disjoint prompts (style: disjoint facts), in a seeded order."""
    sets = tuple(sets)
    unknown = [s for s in sets if s not in PREFERENCE_SETS]
    if unknown or not sets:
        raise DatasetError(f"Unknown built-in preference set {', '.join(unknown) or '(none)'}; "
                           f"use {', '.join(PREFERENCE_SETS)}.")
    share = lambda n, i: n // len(sets) + (1 if i < n % len(sets) else 0)  # noqa: E731
    train: list[PreferencePair] = []
    test: list[PreferencePair] = []
    for i, name in enumerate(sets):
        a, b = share(n_train, i), share(n_test, i)
        if name == "date":
            seen: set[str] = set()
            test += _date_pairs(b, random.Random(seed + _TEST_SEED_OFFSET), seen)
            train += _date_pairs(a, random.Random(seed), seen)
        else:
            tr, te = _style_pairs(a, b, seed)
            train += tr
            test += te
    random.Random(seed + 2).shuffle(train)
    return PreferenceData(train, test, {"source": BUILTIN, "sets": list(sets), "seed": seed})


def _arithmetic_task(a: int, b: int) -> Task:
    return Task(f"What is {a} + {b}? Answer with the number only.", str(a + b), "number", "arithmetic")


def _arithmetic_tasks(n_train: int, n_test: int, seed: int) -> tuple[list[Task], list[Task]]:
    """The 81 single-digit sums, shuffled: the first n_test are held out; train cycles through the
    rest (reshuffled on each pass), so train prompts repeat only when n_train exceeds 81 - n_test."""
    universe = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(seed + _TEST_SEED_OFFSET).shuffle(universe)
    test, pool = universe[:n_test], universe[n_test:]
    rng, train = random.Random(seed), []
    while len(train) < n_train:
        rng.shuffle(pool)
        train += pool[: n_train - len(train)]
    return [_arithmetic_task(a, b) for a, b in train], [_arithmetic_task(a, b) for a, b in test]


def _date_tasks(n_train: int, n_test: int, seed: int) -> tuple[list[Task], list[Task]]:
    def make(rng, n, avoid):
        out = []
        while len(out) < n:
            y, m, d = _random_date(rng)
            q = DATE_PROMPT.format(y=y, m=m, d=d)
            if q not in avoid:
                avoid.add(q)
                out.append(Task(q, f"{d:02d}/{m:02d}/{y:04d}", "date", "date"))
        return out

    seen: set[str] = set()
    test = make(random.Random(seed + _TEST_SEED_OFFSET), n_test, seen)
    return make(random.Random(seed), n_train, seen), test


def builtin_tasks(n_train: int = 64, n_test: int = 20, seed: int = 0,
                  sets: tuple[str, ...] | list[str] = (DEFAULT_TASK_SET,)) -> TaskData:
    """Built-in verifiable tasks (the sets named, split evenly); held-out prompts never appear in train."""
    sets = tuple(sets)
    unknown = [s for s in sets if s not in TASK_SETS]
    if unknown or not sets:
        raise DatasetError(f"Unknown built-in task set {', '.join(unknown) or '(none)'}; use {', '.join(TASK_SETS)}.")
    share = lambda n, i: n // len(sets) + (1 if i < n % len(sets) else 0)  # noqa: E731
    train: list[Task] = []
    test: list[Task] = []
    for i, name in enumerate(sets):
        a, b = share(n_train, i), share(n_test, i)
        if name == "arithmetic" and b > 40:
            raise DatasetError("The arithmetic set has 81 distinct questions; hold out at most 40 of them.")
        tr, te = (_arithmetic_tasks if name == "arithmetic" else _date_tasks)(a, b, seed)
        train += tr
        test += te
    random.Random(seed + 2).shuffle(train)
    return TaskData(train, test, {"source": BUILTIN, "sets": list(sets), "seed": seed})


# =============================================================================================
# Uploads

def _read_lines(path: str | os.PathLike) -> tuple[str, list[tuple[int, str]]]:
    """Every upload limit (size, lines, line length) is checked here, before anything is parsed
    (model_core.core.uploads)."""
    return uploads.read_lines(path, "Dataset file", PreferenceDataError)


def _kind(obj) -> str:
    return {type(None): "null", list: "a list", str: "a string", bool: "true/false", int: "a number",
            float: "a number"}.get(type(obj), "something else")


def _report(name: str, bad: list[tuple[int, str]], n: int) -> PreferenceDataError:
    shown = " ".join(f"Line {i}: {why}" for i, why in bad[:MAX_ERRORS_SHOWN])
    k = len(bad) - MAX_ERRORS_SHOWN
    more = f" And {k} more malformed line{'s' if k > 1 else ''}." if k > 0 else ""
    return PreferenceDataError(f"{len(bad)} of {n} lines in '{name}' are malformed; nothing was run. {shown}{more}",
                               bad)


def _json_line(i: int, line: str, bad: list[tuple[int, str]]):
    try:
        obj = uploads.json_line(line)
    except uploads.BadLine as e:
        bad.append((i, f"{e}."))
        return None
    if not isinstance(obj, dict):
        bad.append((i, f"expected a JSON object, got {_kind(obj)}."))
        return None
    return obj


def parse_preference_lines(lines: list[tuple[int, str]], name: str = "upload") -> list[PreferencePair]:
    """[(line number, text)] -> pairs; PreferenceDataError naming every malformed line."""
    pairs, bad = [], []
    for i, line in lines:
        obj = _json_line(i, line, bad)
        if obj is None:
            continue
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in obj]
        wrong = [k for k in ("prompt", "chosen", "rejected") if k in obj and not isinstance(obj[k], str)]
        empty = [k for k in ("prompt", "chosen", "rejected") if isinstance(obj.get(k), str) and not obj[k].strip()]
        if missing:
            bad.append((i, f"missing {', '.join(repr(k) for k in missing)} (each line needs string fields 'prompt', "
                           "'chosen' and 'rejected')."))
        elif wrong:
            bad.append((i, f"{', '.join(repr(k) for k in wrong)} must be a string, got {_kind(obj[wrong[0]])}."))
        elif empty:
            bad.append((i, f"{', '.join(repr(k) for k in empty)} is empty."))
        elif obj["chosen"].strip() == obj["rejected"].strip():
            bad.append((i, "'chosen' and 'rejected' are the same text, so there is nothing to prefer."))
        else:
            pairs.append(PreferencePair(obj["prompt"], obj["chosen"], obj["rejected"]))
    if bad:
        raise _report(name, bad, len(lines))
    if not pairs:
        raise PreferenceDataError(f"Dataset file '{name}' has no examples.")
    return pairs


def parse_task_lines(lines: list[tuple[int, str]], verifier: str | None, name: str = "upload") -> list[Task]:
    """[(line number, text)] -> tasks checked with `verifier` (or a line's own "verifier");
    PreferenceDataError naming every malformed line."""
    if verifier is not None and verifier not in VERIFIERS:
        raise PreferenceDataError(f"Unknown verifier {verifier!r}; use one of {', '.join(VERIFIERS)}.")
    tasks, bad = [], []
    for i, line in lines:
        obj = _json_line(i, line, bad)
        if obj is None:
            continue
        v = obj.get("verifier", verifier)
        p, a = obj.get("prompt"), obj.get("answer")
        if not isinstance(p, str) or not p.strip():
            bad.append((i, "needs a non-empty string 'prompt'." if p is None or isinstance(p, str)
                        else f"'prompt' must be a string, got {_kind(p)}."))
        elif v is None:
            bad.append((i, f"no verifier: choose one for the run or give 'verifier' ({', '.join(VERIFIERS)})."))
        elif v not in VERIFIERS:
            bad.append((i, f"unknown verifier {v!r}; use one of {', '.join(VERIFIERS)}."))
        elif a is None or isinstance(a, bool) or not isinstance(a, (str, int, float)) or not str(a).strip():
            bad.append((i, f"needs an 'answer' (a string or number) for the {v} verifier to check against."))
        elif VERIFIERS[v].check_answer and (why := VERIFIERS[v].check_answer(str(a))):
            bad.append((i, why + "."))
        else:
            tasks.append(Task(p, str(a), v))
    if bad:
        raise _report(name, bad, len(lines))
    if not tasks:
        raise PreferenceDataError(f"Dataset file '{name}' has no examples.")
    return tasks


def load_preference_jsonl(path: str | os.PathLike, eval_fraction: float = 0.1, seed: int = 0) -> PreferenceData:
    """A prompt/chosen/rejected JSONL file, split into train and held-out test (seeded)."""
    name, lines = _read_lines(path)
    pairs = parse_preference_lines(lines, name)
    train, test = held_out_split(pairs, eval_fraction, seed)
    return PreferenceData(train, test, {"source": "upload", "file": name, "lines": len(lines),
                                        "eval_fraction": eval_fraction, "seed": seed})


def load_task_jsonl(path: str | os.PathLike, verifier: str | None = None, eval_fraction: float = 0.1,
                    seed: int = 0) -> TaskData:
    """A prompt/answer JSONL file checked by a built-in verifier, split into train and held-out test."""
    name, lines = _read_lines(path)
    tasks = parse_task_lines(lines, verifier, name)
    train, test = held_out_split(tasks, eval_fraction, seed)
    return TaskData(train, test, {"source": "upload", "file": name, "lines": len(lines), "verifier": verifier,
                                  "eval_fraction": eval_fraction, "seed": seed})


def _builtin_sets(spec: str, allowed: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...] | None:
    """'builtin' -> default; 'builtin:date,style' -> ('date', 'style'); anything else -> None (a path)."""
    if spec == BUILTIN:
        return default
    if spec.startswith(BUILTIN + ":"):
        sets = tuple(s.strip() for s in spec.split(":", 1)[1].split(",") if s.strip())
        bad = [s for s in sets if s not in allowed]
        if bad or not sets:
            raise DatasetError(f"Unknown built-in set {', '.join(bad) or '(none)'}; use {', '.join(allowed)}.")
        return sets
    return None


def preference_dataset(spec: str | PreferenceData, n_train: int = 128, n_test: int = 40, seed: int = 0,
                       eval_fraction: float = 0.1) -> PreferenceData:
    """'builtin' (date + style), 'builtin:date', 'builtin:style', a JSONL path, or PreferenceData as is."""
    if isinstance(spec, PreferenceData):
        return spec
    spec = str(spec).strip()
    sets = _builtin_sets(spec, PREFERENCE_SETS, PREFERENCE_SETS)
    if sets is not None:
        return builtin_preferences(n_train, n_test, seed, sets)
    return load_preference_jsonl(spec, eval_fraction, seed)


def task_dataset(spec: str | TaskData, verifier: str | None = None, n_train: int = 64, n_test: int = 20,
                 seed: int = 0, eval_fraction: float = 0.1) -> TaskData:
    """'builtin' (arithmetic), 'builtin:date', 'builtin:arithmetic,date', a JSONL path (with a
    verifier), or TaskData as is."""
    if isinstance(spec, TaskData):
        return spec
    spec = str(spec).strip()
    sets = _builtin_sets(spec, TASK_SETS, (DEFAULT_TASK_SET,))
    if sets is not None:
        return builtin_tasks(n_train, n_test, seed, sets)
    return load_task_jsonl(spec, verifier, eval_fraction, seed)
