"""When did the change happen: KL(base || model at step s) per token of a prompt set, at every
checkpoint a training run kept, as curves over the run's steps.

A run registered with `keep_checkpoints` lists its checkpoints ('<name>-step<S>') in its lmscope.json;
`run_checkpoints` reads them. `kl_across_run` traces each prompt once through the base and once
through each checkpoint and the final model, and computes KL exactly as
model_core.interp.model_diff.diff_prompt does (float64 from the models' own logits), so the last
point of a curve is that view's mean KL for the same prompt, and the base itself, drawn at step 0,
is exactly 0.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from model_core.core.errors import SettingsError
from model_core.interp.model_diff import _check_pair, kl_per_position

log = logging.getLogger(__name__)

MAX_PROMPTS = 16
MAX_PROMPT_TOKENS = 128
MAX_CHECKPOINTS = 21  # the 20 a run may keep (MAX_KEEP_CHECKPOINTS) and its final model


@dataclass
class RunDiff:
    base: str
    run: str
    steps: list[int]  # [S] step 0 (the base) first, the final model last
    models: list[str]  # [S] the model at each step
    prompts: list[str]  # [P] each prompt's text as tokenized (decoded back)
    tokens: list[list[str]]  # [P][T_p] tokens as displayed
    kl: list[list[list[float]]]  # [S][P][T_p] KL(base || model at the step) per position, nats
    mean_kl: list[list[float]]  # [S][P] mean over the prompt's positions

    def to_dict(self) -> dict:
        return asdict(self)


def run_checkpoints(name: str) -> list[tuple[int, str]]:
    """[(step, model name)] of a registered run: its kept checkpoints, then the final model at its
    last step. A model without checkpoints gives [] (nothing to draw a curve through)."""
    from model_core.core.registry import finetuned_path

    folder = finetuned_path(name)
    if folder is None:
        return []
    try:
        info = json.loads((folder / "lmscope.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(info, dict):
        return []
    kept = [(int(c["step"]), str(c["name"])) for c in info.get("checkpoints") or []
            if isinstance(c, dict) and isinstance(c.get("step"), int) and isinstance(c.get("name"), str)
            and finetuned_path(c["name"]) is not None]
    if not kept:
        return []
    history = [r.get("step") for r in info.get("history") or [] if isinstance(r, dict)]
    last = max([s for s in history if isinstance(s, int)] + [max(s for s, _ in kept) + 1])
    return sorted(st for st in kept if st[0] < last) + [(last, name)]


def kl_across_run(base, models: list[tuple[int, object]] | list[tuple[int, Callable[[], object]]],
                  prompts: list[str] | None = None, token_ids: list[list[int]] | None = None,
                  progress: Callable[[float], None] | None = None) -> RunDiff:
    """base: the run's base (a LoadedModel); models: [(step, LoadedModel or a loader of one)] in step
    order (a loader that does not cache, tasks.diff_job._transient, holds one checkpoint at a time); prompts (or their token ids) as the
    base tokenizes them, at most MAX_PROMPTS of at most MAX_PROMPT_TOKENS tokens each."""
    from model_core.interp.trace import encode_prompt, trace

    if token_ids is None:
        texts = [p for p in (prompts or []) if isinstance(p, str) and p.strip()]
        # a longer prompt keeps its last MAX_PROMPT_TOKENS tokens (where the curve is read)
        token_ids = [encode_prompt(base, p, max_tokens=MAX_PROMPT_TOKENS, truncate=True) for p in texts]
    if not token_ids:
        raise SettingsError("Give at least one prompt to follow across the run.")
    if len(token_ids) > MAX_PROMPTS:
        raise SettingsError(f"Follow at most {MAX_PROMPTS} prompts across a run, not {len(token_ids)}.")
    if not models:
        raise SettingsError("This run kept no checkpoints; train with keep_checkpoints to see when it changed.")
    if len(models) > MAX_CHECKPOINTS:
        raise SettingsError(f"At most {MAX_CHECKPOINTS} checkpoints are compared, not {len(models)}.")
    token_ids = [list(ids)[-MAX_PROMPT_TOKENS:] for ids in token_ids]
    with torch.inference_mode():
        base_logits = [trace(base, token_ids=ids).logits() for ids in token_ids]  # [P] of [T_p, V]
        itself = [kl_per_position(lb, lb).cpu().tolist() for lb in base_logits]  # [P][T_p]: 0 (the run's start)
        steps, names, kl = [0], [base.name], [itself]
        for i, (step, lm) in enumerate(models):
            lm = lm() if callable(lm) else lm
            n_vocab, _ = _check_pair(base, lm)
            rows = []
            for ids, lb in zip(token_ids, base_logits):
                lt = trace(lm, token_ids=ids).logits()
                rows.append(kl_per_position(lb[:, :n_vocab], lt[:, :n_vocab]).cpu().tolist())  # [T_p]
            steps.append(int(step))
            names.append(lm.name)
            kl.append(rows)
            if progress is not None:
                progress((i + 1) / len(models))
    from model_core.core.tokenization import describe_tokens

    return RunDiff(
        base=base.name, run=names[-1], steps=steps, models=names,
        prompts=[base.tokenizer.decode(ids) for ids in token_ids],
        tokens=[[d["display"] for d in describe_tokens(base.tokenizer, ids)] for ids in token_ids], kl=kl,
        mean_kl=[[sum(row) / max(len(row), 1) for row in per_step] for per_step in kl])
