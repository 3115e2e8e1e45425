"""Steering vectors: a direction in the residual stream built from contrastive prompt pairs, added
as alpha * v to one layer's input during a forward pass.

The direction is the mean difference of `blocks.{L}.hook_resid_pre` between the positive and the
negative prompt of each pair, read at each prompt's last token (or averaged over its tokens after the first, the attention sink); the
edit adds alpha * v to `blocks.{L}.hook_resid_pre` at every position from `from_position` on, so
layers before L see exactly the unsteered stream. Shapes: the vector is [d_model]; the edit
receives and returns [B, T, d_model].
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_core.core.errors import PromptError
from model_core.core.hook_names import act_name
from model_core.core.prompts import encode_prompt
from model_core.core.row_edits import AddVector
from model_core.interp.interventions import last_logits
from model_core.interp.trace import trace

MAX_ALPHA = 1000.0  # beyond this a residual stream of norm ~10-100 is pure vector: nothing to read
MAX_PAIRS = 256
POSITIONS = ("last", "mean")

# Built-in pair sets (prompts a user can read in the UI; each line one contrast).
BUILTIN_PAIRS: dict[str, list[tuple[str, str]]] = {
    "love-hate": [
        ("I love you", "I hate you"),
        ("She loves this place", "She hates this place"),
        ("We adore our neighbours", "We despise our neighbours"),
        ("What a lovely day", "What a horrible day"),
        ("He was delighted by the gift", "He was disgusted by the gift"),
    ],
    "formal-informal": [
        ("Good morning, how may I assist you?", "hey whats up"),
        ("I would be grateful for your reply.", "text me back lol"),
        ("Please find the report attached.", "here's the thing u wanted"),
        ("We regret to inform you of the delay.", "sorry dude, it's late"),
        ("Thank you for your kind consideration.", "thx a ton!!"),
        ("Kindly confirm your attendance.", "u coming or what"),
    ],
}


class SteeringError(PromptError):
    """A bad pair file, layer, alpha or vector: one sentence a user can act on."""


@dataclass(frozen=True)
class SteeringPair:
    positive: str
    negative: str


@dataclass(frozen=True)
class SteeringVector:
    """v = mean_i(resid_pre[L](positive_i) - resid_pre[L](negative_i)) at `position`."""

    model_name: str
    layer: int
    vector: torch.Tensor  # [d_model], float32 on the CPU
    n_pairs: int
    position: str

    @property
    def norm(self) -> float:
        return float(self.vector.norm())


def builtin_pairs(name: str) -> list[SteeringPair]:
    if name not in BUILTIN_PAIRS:
        raise SteeringError(f"Unknown pair set {name!r}; choose one of: {', '.join(BUILTIN_PAIRS)}.")
    return [SteeringPair(p, n) for p, n in BUILTIN_PAIRS[name]]


def parse_pairs(text: str) -> list[SteeringPair]:
    """JSONL with one {"positive": ..., "negative": ...} per line (blank lines skipped). Every
    malformed line is reported by its number before anything runs."""
    pairs, problems = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            problems.append(f"line {n} is not JSON")
            continue
        if not isinstance(row, dict):
            problems.append(f"line {n} is not an object")
            continue
        pos, neg = row.get("positive"), row.get("negative")
        if not isinstance(pos, str) or not isinstance(neg, str) or not pos.strip() or not neg.strip():
            problems.append(f'line {n} needs non-empty "positive" and "negative" texts')
            continue
        pairs.append(SteeringPair(pos, neg))
    if problems:
        shown = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        raise SteeringError(f"The pairs file has problems: {shown}.")
    if not pairs:
        raise SteeringError("The pairs file has no pairs: give one JSON object per line.")
    if len(pairs) > MAX_PAIRS:
        raise SteeringError(f"The pairs file has {len(pairs)} pairs; at most {MAX_PAIRS} are used at once.")
    return pairs


def check_layer(lm, layer) -> int:
    n = lm.shape.n_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
        raise SteeringError(f"The steering layer must be a whole number from 0 to {n - 1}.")
    return layer


def check_alpha(alpha) -> float:
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise SteeringError("The steering strength alpha must be a number.") from None
    if not math.isfinite(a) or abs(a) > MAX_ALPHA:
        raise SteeringError(f"The steering strength alpha must be a finite number between {-MAX_ALPHA:g} and {MAX_ALPHA:g}.")
    return a


def steering_vector(lm, pairs: list[SteeringPair], layer: int, *, position: str = "last",
                    chat: bool = False) -> SteeringVector:
    """Mean difference of the residual stream entering `layer` over the pairs (one traced forward per
    prompt, capturing that layer only)."""
    layer = check_layer(lm, layer)
    if position not in POSITIONS:
        raise SteeringError(f"The position must be one of: {', '.join(POSITIONS)}.")
    if not pairs:
        raise SteeringError("Give at least one positive/negative pair.")

    def read(prompt: str) -> torch.Tensor:
        resid = trace(lm, prompt, layers=[layer], chat=chat).resid_pre[layer]  # [T, d_model]
        if resid.shape[0] < 2:
            # Position 0 is the attention sink: its residual norm is several times the others'
            # (756 vs ~95 on SmolLM2 at layer 6), so a one-token pair would steer with noise.
            raise SteeringError(f"The prompt {prompt[:40]!r} is one token; give each prompt at least two.")
        return (resid[-1] if position == "last" else resid[1:].mean(0)).float().cpu()

    diffs = torch.stack([read(p.positive) - read(p.negative) for p in pairs])  # [pairs, d_model]
    return SteeringVector(model_name=lm.name, layer=layer, vector=diffs.mean(0), n_pairs=len(pairs),
                          position=position)


def steering_edits(lm, vec: SteeringVector, alpha, *, from_position: int = 0) -> dict:
    """{hook name: edit} adding alpha * v to the input of `vec.layer` at positions >= from_position
    of each forward (a decode step's single position always counts as later)."""
    alpha = check_alpha(alpha)
    check_layer(lm, vec.layer)
    if vec.vector.shape != (lm.shape.d_model,):
        raise SteeringError(f"This steering vector has width {vec.vector.shape[-1]}; "
                            f"{lm.name} has a residual stream of width {lm.shape.d_model}.")
    if alpha == 0.0:
        return {}  # the unsteered model, bit for bit
    # a RowEdit: the engine adds it per row of a batched decode step (model_core.core.row_edits)
    return {act_name("resid_pre", vec.layer): AddVector(alpha * vec.vector.float(), start=from_position)}


@dataclass(frozen=True)
class SweepRow:
    alpha: float
    kl_from_unsteered: float  # KL(steered || unsteered) of the next-token distribution, nats
    target_logprob: float | None  # mean log-prob of the named target tokens (the on-target score)
    top_tokens: list[tuple[str, float]]  # (token text, probability), best first
    text: str | None = None  # with generate options: the steered continuation
    base_perplexity: float | None = None  # ... and its perplexity under the unsteered model


MAX_SWEEP = 16  # alphas in one sweep (each is a forward, and with generate options a generation)
MAX_TARGETS = 16


def parse_alphas(text) -> list[float]:
    """'-8, -4, 0, 4, 8' -> [-8.0, -4.0, 0.0, 4.0, 8.0] (each checked like any alpha; order kept,
    repeats dropped)."""
    parts = [t for t in str(text or "").replace(";", ",").replace(" ", ",").split(",") if t.strip()]
    if not parts:
        raise SteeringError("Give the alphas to sweep, separated by commas (e.g. -8, -4, 0, 4, 8).")
    if len(parts) > MAX_SWEEP:
        raise SteeringError(f"A sweep takes at most {MAX_SWEEP} alphas; got {len(parts)}.")
    return list(dict.fromkeys(check_alpha(t) for t in parts))


def target_ids(lm, text) -> list[tuple[str, int]]:
    """'love, happy' -> [(' love', id), (' happy', id)]: each comma-separated word as it appears
    after another word (with its leading space), and the first token it becomes (what the on-target
    score reads). Empty text: no targets."""
    words = [w.strip() for w in str(text or "").split(",") if w.strip()]
    if len(words) > MAX_TARGETS:
        raise SteeringError(f"Name at most {MAX_TARGETS} target words; got {len(words)}.")
    out = []
    for w in words:
        ids = lm.tokenizer(" " + w, add_special_tokens=False)["input_ids"]
        if not ids:
            raise SteeringError(f"The target {w!r} is no token of this tokenizer.")
        out.append((lm.tokenizer.decode([ids[0]]), int(ids[0])))
    return out


def alpha_sweep(lm, prompt: str, vec: SteeringVector, alphas, *, targets: list[int] | None = None,
                chat: bool = False, top: int = 5, from_position: int = 0,
                continuation: Callable[[float], tuple[str, float | None]] | None = None) -> list[SweepRow]:
    """Next-token distribution at the prompt's end under each alpha, against alpha = 0. With
    `continuation` (alpha -> (steered text, its perplexity under the unsteered model); the serving
    side's `model_core.serving.steered.alpha_sweep` passes a generation), each row also holds one."""
    ids = torch.tensor([encode_prompt(lm, prompt, chat=chat)], device=lm.device)
    base = torch.log_softmax(last_logits(lm, ids)[0].float(), -1)  # [V]
    rows = []
    for a in alphas:
        edits = steering_edits(lm, vec, a, from_position=from_position)
        lp = torch.log_softmax(last_logits(lm, ids, edits)[0].float(), -1)  # [V]
        kl = float((lp.exp() * (lp - base)).sum())
        tgt = float(lp[targets].mean()) if targets else None
        p, i = lp.exp().topk(top)
        text, ppl = continuation(float(a)) if continuation is not None else (None, None)
        rows.append(SweepRow(alpha=float(a), kl_from_unsteered=max(kl, 0.0), target_logprob=tgt,
                             top_tokens=[(lm.tokenizer.decode([int(t)]), float(q)) for t, q in zip(i, p)],
                             text=text, base_perplexity=ppl))
    return rows


def base_perplexity(lm, prompt_ids: list[int], new_ids: list[int]) -> float | None:
    """Perplexity of `new_ids` after `prompt_ids` under the unedited model (one plain forward)."""
    if not new_ids:
        return None
    ids = torch.tensor([list(prompt_ids) + list(new_ids)], device=lm.device)
    with torch.inference_mode():
        logits = lm.model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1: -1].float()  # [N, V]
    nll = -torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None])[:, 0]  # [N]
    return float(torch.exp(nll.mean()))


def steering_to_json(vec: SteeringVector) -> dict:
    return {"model": vec.model_name, "layer": vec.layer, "n_pairs": vec.n_pairs, "position": vec.position,
            "norm": round(vec.norm, 6)}
