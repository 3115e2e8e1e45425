"""Presence and frequency penalties written out by hand (OpenAI's definitions, as vLLM applies them)
over transformers' own logits: the reference the engine, the CLI and the page are checked against."""

import collections

import torch


def by_hand(logits: torch.Tensor, generated, presence: float, frequency: float) -> torch.Tensor:
    """The formula, one token at a time, over the generated ids only."""
    out = logits.clone()
    for t, c in collections.Counter(int(x) for x in generated).items():
        out[t] -= presence * (c > 0) + frequency * c
    return out


def hand_greedy(model, prompt_ids: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding written out: each step a full forward of transformers' model, the formula over
    the tokens generated so far, the argmax."""
    ids, generated = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            t = int(torch.argmax(by_hand(logits, generated, presence, frequency)))
            ids.append(t)
            generated.append(t)
    return generated
