"""The input-embedding space: one token from user text (or #id), its nearest tokens by cosine
similarity, and analogies (E[a] - E[b] + E[c]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_core.core.errors import PromptError
from model_core.core.tokenization import describe_tokens


def token_id(lm, text: str) -> int:
    """One token from user text: '#123' means id 123; otherwise the text must be exactly one
    token (leading spaces matter: ' Paris' and 'Paris' are different tokens)."""
    if not isinstance(text, str) or not text:
        raise PromptError("Type a token (or #id).")
    vocab = lm.shape.vocab_size
    if text.startswith("#") and text[1:].strip().isdigit():
        i = int(text[1:])
        if not 0 <= i < vocab:
            raise PromptError(f"Token id must be between 0 and {vocab - 1}.")
        return i
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = " | ".join(t["display"] for t in describe_tokens(lm.tokenizer, ids))
        raise PromptError(f"'{text}' is {len(ids)} tokens ({pieces}); pick one token, or type #id.")
    return int(ids[0])


def resolve_token(lm, text: str) -> tuple[int, str | None]:
    """Like token_id, but text that is several tokens (a word, for a byte-level tokenizer) falls
    back to its first token that is not only whitespace; returns (id, a note saying so, or None)."""
    try:
        return token_id(lm, text), None
    except PromptError:
        if not isinstance(text, str) or not text or (text.startswith("#") and text[1:].strip().isdigit()):
            raise
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise
        toks = describe_tokens(lm.tokenizer, ids)
        pick = next((i for i, t in enumerate(toks) if t["display"].strip("␣ ")), 0)
        return int(ids[pick]), (f"'{text}' is {len(ids)} tokens here ({' '.join(t['display'] for t in toks)}): "
                                f"using {toks[pick]['display']} (#{ids[pick]}).")


def _embedding_matrix(lm) -> torch.Tensor:
    return lm.adapter.embed_tokens.weight.detach().float()


def _neighbours(lm, vec: torch.Tensor, k: int, exclude=()) -> list[dict]:
    E = _embedding_matrix(lm)
    sims = F.cosine_similarity(E, vec[None, :].to(E), dim=-1)
    for i in exclude:
        sims[i] = float("-inf")
    top = sims.topk(min(k, sims.numel() - len(exclude)))
    ids = top.indices.tolist()
    toks = describe_tokens(lm.tokenizer, ids)
    return [{"id": i, "token": t["display"], "cosine": float(s)} for i, t, s in zip(ids, toks, top.values.tolist())]


def nearest_tokens(lm, token: str | int, k: int = 10) -> list[dict]:
    """Tokens whose input embeddings have the highest cosine similarity to `token`'s."""
    i = token if isinstance(token, int) else token_id(lm, token)
    return _neighbours(lm, _embedding_matrix(lm)[i], k, exclude=(i,))


def analogy(lm, a: str | int, b: str | int, c: str | int, k: int = 10) -> list[dict]:
    """Nearest tokens to E[a] - E[b] + E[c] (a, b, c themselves excluded)."""
    ia, ib, ic = (t if isinstance(t, int) else token_id(lm, t) for t in (a, b, c))
    E = _embedding_matrix(lm)
    return _neighbours(lm, E[ia] - E[ib] + E[ic], k, exclude={ia, ib, ic})
