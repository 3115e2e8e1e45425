"""The registry of job kinds: the one door through which a kind reaches the job service
(tasks.jobs.submit), the CLI (`lmscope jobs submit <kind>`: one subcommand per kind, with that kind's
options only; tasks/cli.py builds them from here) and the worker (celery_app's include).

A kind lives in its own module (tasks/<name>_job.py): its settings check, its Celery task (on
tasks.lifecycle.JobTask, which owns claim, heartbeat, progress, cancel, finish and fail) and, at the
bottom, one `register(JobKind(...))`. This module imports no kind module when it is imported;
`load()` imports the modules the worker's Celery app includes (tasks.celery_app.KIND_MODULES, an
explicit list of names), and each registers itself. A new kind (reward, DPO, GRPO, feature
jobs...) is one new module and one line in that list; no other kind changes.

Direction of imports: kind modules -> kinds, lifecycle, celery_app; jobs -> kinds, lifecycle;
kinds -> celery_app (the list), lifecycle; lifecycle -> celery_app; celery_app -> config. Nothing
imports a kind module by name but the registry's load() and the worker's include.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_core.core.errors import SettingsError
from tasks.celery_app import KIND_MODULES
from tasks.lifecycle import queue


@dataclass(frozen=True)
class JobKind:
    """One kind of job.

    validate(params) -> params as the worker will use them; SettingsError (one sentence) otherwise.
    task: the Celery task that runs it (a tasks.lifecycle.JobTask; its message carries the job id).
    submit(params, owner, files) -> the queued record; default: validate, then queue a record with
        the validated params (files refused). A kind with uploads or extra record fields brings its own.
    add_arguments(parser): its `lmscope jobs submit <kind>` options, added with `options` to the
        kind's own parser (--model, --lr, --batch-size ... mean the same for every kind by convention).
    params_from_args(args) -> (params, files) from those options (args.kind: the kind's name).
    flags: where one add_arguments serves several kinds (reward / dpo / grpo), the flags this kind
        takes; its parser then has only those. None: all of add_arguments' flags.
    """

    name: str
    validate: Callable[[dict], dict]
    task: Any
    submit: Callable[..., dict] | None = None
    add_arguments: Callable[[Any], None] | None = None
    params_from_args: Callable[[Any], tuple[dict, list]] | None = None
    help: str = ""
    flags: tuple[str, ...] | None = None

    def submit_job(self, params: dict, owner: str = "cli", files: list | None = None) -> dict:
        if self.submit is not None:
            return self.submit(params, owner, files)
        if files:
            raise SettingsError(f"A '{self.name}' job takes no uploaded files.")
        return queue(self.task, self.name, self.validate(params), owner)


_KINDS: dict[str, JobKind] = {}


def register(kind: JobKind) -> JobKind:
    """Called once by each kind module at import."""
    for attr in ("validate", "task"):
        if getattr(kind, attr) is None:
            raise TypeError(f"job kind '{kind.name}' has no {attr}")
    _KINDS[kind.name] = kind
    return kind


def load() -> None:
    """Import every kind module (each registers its kinds); cheap once done."""
    for name in KIND_MODULES:
        importlib.import_module(name)


def find(name: str) -> JobKind | None:
    load()
    return _KINDS.get(name) if isinstance(name, str) else None


def names() -> tuple[str, ...]:
    load()
    return tuple(_KINDS)


def all_kinds() -> list[JobKind]:
    load()
    return list(_KINDS.values())


# ---- what kinds share ---------------------------------------------------------------------

def options(parser, title: str) -> Callable[..., None]:
    """An `add(flag, **kw)` for a kind's CLI option group. It leaves out a flag the parser already
    has (so several kinds' options can share one parser) and, on the CLI's parser for one kind
    (tasks/cli.py sets parser.kind_flags from JobKind.flags), a flag that kind does not take."""
    group = parser.add_argument_group(title)
    have = {a for act in parser._actions for a in act.option_strings}
    takes = getattr(parser, "kind_flags", None)

    def add(flag: str, **kw) -> None:
        if flag not in have and (takes is None or flag in takes):
            group.add_argument(flag, **kw)
            have.add(flag)

    return add


def int_setting(p: dict, key: str, default: int, lo: int, hi: int) -> int:
    """A whole-number setting between lo and hi; `default` when absent. One sentence otherwise
    (model_core's own check, the one the training settings use)."""
    from model_core.training.sft import setting_number

    v = setting_number(p, key, int, lo, hi, allow_none=True)
    return default if v is None else v
