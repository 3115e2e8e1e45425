"""What fine-tuning did, measured on held-out data: exact-match accuracy of greedy answers before
and after a run, and the greedy samples of a few held-out prompts generated while it trains (at
step 0, every sample_every steps and at the end). Re-exported by model_core.training.sft."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from model_core.training.sft_settings import SFTCancelled

# =============================================================================================
# Held-out accuracy by greedy generation

def normalise_answer(s: str) -> str:
    return " ".join(s.strip().split()).rstrip(".").strip()


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int = 24,
                   batch_size: int = 16, should_stop: Callable[[], bool] | None = None) -> list[str]:
    """Greedy completions (assistant turn only, special tokens dropped) of chat prompts."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    outs = []
    try:
        for i in range(0, len(prompts), batch_size):
            if should_stop and should_stop():
                raise SFTCancelled()
            enc = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                   for p in prompts[i:i + batch_size]]
            ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in enc]
            T = max(map(len, ids))
            x = torch.full((len(ids), T), pad, dtype=torch.long)
            att = torch.zeros_like(x)
            for j, s in enumerate(ids):  # left padding
                x[j, T - len(s):] = torch.tensor(s)
                att[j, T - len(s):] = 1
            gen = model.generate(input_ids=x.to(device), attention_mask=att.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=pad)
            for row in gen[:, T:]:
                outs.append(tokenizer.decode(row.tolist(), skip_special_tokens=True))
    finally:
        model.train(was_training)
    return outs


def evaluate_accuracy(model, tokenizer, items: list[tuple[list[dict], str]], max_new_tokens: int | None = None,
                      should_stop=None, n_show: int = 5) -> dict | None:
    """Exact match (whitespace- and final-period-insensitive) of greedy answers to references."""
    if not items:
        return None
    if max_new_tokens is None:
        longest = max(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for _, a in items)
        max_new_tokens = min(128, longest + 4)
    got = greedy_answers(model, tokenizer, [p for p, _ in items], max_new_tokens, should_stop=should_stop)
    ok = [normalise_answer(g) == normalise_answer(a) for g, (_, a) in zip(got, items)]
    return {"accuracy": sum(ok) / len(ok), "correct": sum(ok), "n": len(ok),
            "examples": [{"prompt": p[-1]["content"], "expected": a, "got": g, "correct": c}
                         for (p, a), g, c in list(zip(items, got, ok))[:n_show]]}


# =============================================================================================
# Sample generations during training

SAMPLE_MAX_NEW_TOKENS = 24
MAX_SAMPLE_STEPS = 50  # sample points kept in a run record (thinned evenly beyond this; first and last kept)
_SAMPLE_PROMPT_CHARS = 300


def sample_steps(max_steps: int, sample_every: int | None, n_prompts: int) -> list[int]:
    """Steps at which the run generates its samples: 0 (before training), every `sample_every` steps
    (default: ceil(max_steps / 4), about 4 points) and the last step. [] when off (0, or no prompts)."""
    if sample_every == 0 or n_prompts <= 0:
        return []
    every = sample_every or max(1, math.ceil(max_steps / 4))
    return sorted({0, max_steps, *range(every, max_steps + 1, every)})


def sample_max_new_tokens(tokenizer, items: list[tuple[list[dict], str | None]]) -> int:
    """24 tokens, more (up to 64) when a known answer needs them."""
    longest = max((len(tokenizer(a, add_special_tokens=False)["input_ids"]) for _, a in items if a), default=0)
    return max(SAMPLE_MAX_NEW_TOKENS, min(64, longest + 4))


def sample_generations(model, tokenizer, items: list[tuple[list[dict], str | None]], step: int,
                       max_new_tokens: int = SAMPLE_MAX_NEW_TOKENS, should_stop=None) -> list[dict]:
    """Greedy completions of held-out prompts by the model as it is now: [{step, index, prompt,
    completion, expected, correct}] with correct = exact match (as held-out accuracy) when the answer
    is known, else None. Prompts of the same token length share a generate call and others run
    alone, so no row is ever padded. Eval mode and no_grad for the generation, the training mode and
    RNG state restored."""
    dev = next(model.parameters()).device
    groups: dict[int, list[int]] = {}
    for i, (msgs, _) in enumerate(items):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        groups.setdefault(len(tokenizer(text, add_special_tokens=False)["input_ids"]), []).append(i)
    got: list[str] = [""] * len(items)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for idx in groups.values():
            outs = greedy_answers(model, tokenizer, [items[i][0] for i in idx], max_new_tokens,
                                  batch_size=len(idx), should_stop=should_stop)
            for i, o in zip(idx, outs):
                got[i] = o
    rows = []
    for i, ((msgs, expected), completion) in enumerate(zip(items, got)):
        prompt = msgs[-1]["content"] if msgs else ""
        if len(prompt) > _SAMPLE_PROMPT_CHARS:
            prompt = prompt[: _SAMPLE_PROMPT_CHARS - 1] + "…"
        rows.append({"step": int(step), "index": i, "prompt": prompt, "completion": completion,
                     "expected": expected,
                     "correct": None if expected is None else normalise_answer(completion) == normalise_answer(expected)})
    return rows


def thin_samples(samples: list[dict], max_points: int = MAX_SAMPLE_STEPS) -> list[dict]:
    """Sample rows of at most `max_points` distinct steps, evenly spread (the first and last kept)."""
    steps = sorted({r["step"] for r in samples})
    if len(steps) <= max_points:
        return list(samples)
    keep = {steps[round(i * (len(steps) - 1) / (max_points - 1))] for i in range(max_points)}
    return [r for r in samples if r["step"] in keep]
