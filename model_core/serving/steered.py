"""Generations with a steering vector (model_core.interp.steering) added in every forward.

The vector and its single-forward views live in interp; generating with it is serving's work, so
the steered runs and the alpha sweep that also generates live here."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from model_core.interp import steering as St
from model_core.interp.steering import SteeringVector, SweepRow, base_perplexity, check_alpha, steering_edits
from model_core.serving.generate import Generation, generate


@dataclass(frozen=True)
class SteeredRun:
    """One generation with the vector at `alpha` (alpha 0: the unsteered run, same seed)."""

    alpha: float
    generation: Generation
    base_perplexity: float | None  # of the generated tokens under the unsteered model


def steered_generation(lm, prompt: str, vec: SteeringVector, alpha, *, from_position: int = 0,
                       **options) -> SteeredRun:
    """generate() with alpha * v added at vec.layer in every forward (options as generate's)."""
    gen = generate(lm, prompt, edits=steering_edits(lm, vec, alpha, from_position=from_position), **options)
    return SteeredRun(alpha=check_alpha(alpha), generation=gen,
                      base_perplexity=base_perplexity(lm, gen.prompt_ids, gen.token_ids))


def generations_at_once(lm, prompt: str, edit_sets: list, **options) -> list[Generation]:
    """One generate() per edit set (None: unedited), all submitted at once: on the model's engine
    they run in the same decode steps (model_core.serving.engine_edits). Options as generate's."""
    with ThreadPoolExecutor(len(edit_sets), thread_name_prefix="lmscope-side-by-side") as pool:
        futures = [pool.submit(generate, lm, prompt, edits=e, **options) for e in edit_sets]
        return [f.result() for f in futures]


def steered_pair(lm, prompt: str, vec: SteeringVector, alpha, *, from_position: int = 0,
                 **options) -> tuple[SteeredRun, SteeredRun]:
    """The unsteered and the steered generation (same seed), run side by side."""
    alpha = check_alpha(alpha)
    edits = steering_edits(lm, vec, alpha, from_position=from_position)
    base, steered = generations_at_once(lm, prompt, [None, edits], **options)
    return tuple(SteeredRun(alpha=a, generation=g, base_perplexity=base_perplexity(lm, g.prompt_ids, g.token_ids))
                 for a, g in ((0.0, base), (alpha, steered)))


def alpha_sweep(lm, prompt: str, vec: SteeringVector, alphas, *, chat: bool = False, from_position: int = 0,
                generate_options: dict | None = None, **sweep_options) -> list[SweepRow]:
    """interp's alpha sweep; with generate_options (generate()'s keywords: max_new_tokens, settings,
    seed, ...) each alpha also generates a continuation (same seed for all), scored under the
    unsteered model."""

    def continuation(alpha: float):
        run = steered_generation(lm, prompt, vec, alpha, from_position=from_position, chat=chat, **generate_options)
        return run.generation.text, run.base_perplexity

    return St.alpha_sweep(lm, prompt, vec, alphas, chat=chat, from_position=from_position,
                          continuation=continuation if generate_options is not None else None, **sweep_options)
