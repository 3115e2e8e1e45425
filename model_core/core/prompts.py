"""Prompt text -> token ids, with the checks every entry point needs (traces, generation,
interventions, anatomy, compare). Its own small module, so that generation and decoding encode
prompts without importing the tracing machinery; `model_core.interp.trace` re-exports these names."""

from __future__ import annotations

from model_core.core import settings
from model_core.core.errors import PromptError

DEFAULT_MAX_TOKENS = 1024


def server_token_cap() -> int:
    """LMSCOPE_MAX_PROMPT_TOKENS, where an operator set one: it bounds every entry point that
    encodes a prompt (traces, generation, interventions, anatomy, compare), not only the ones
    that pass max_tokens."""
    return settings.current().prompt_token_cap or 10**9


def encode_prompt(lm, prompt: str, chat: bool = False, max_tokens: int | None = DEFAULT_MAX_TOKENS,
                  truncate: bool = False) -> list[int]:
    """Prompt text -> token ids, with the checks every entry point needs."""
    if not isinstance(prompt, str):
        raise PromptError("The prompt must be text.")
    if not prompt.strip():
        raise PromptError("The prompt is empty: type some text to look at.")
    tok = lm.tokenizer
    if chat:
        if not getattr(tok, "chat_template", None):
            raise PromptError(f"Model '{lm.name}' has no chat template; turn off the chat wrap.")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
    ids = [int(i) for i in ids]
    limit = min(max_tokens or 10**9, server_token_cap(), lm.shape.context_length)
    if len(ids) > limit:
        if not truncate:
            raise PromptError(
                f"The prompt is {len(ids)} tokens; the limit is {limit}. Shorten it, or turn on truncation "
                f"to keep its last {limit} tokens."
            )
        ids = ids[-limit:]
    return ids


def prompt_ids(lm, prompt, chat: bool = False, max_tokens: int | None = DEFAULT_MAX_TOKENS) -> list[int]:
    """A prompt as token ids: text is encoded (encode_prompt), ids (a list or tensor) pass as they are."""
    if isinstance(prompt, str):
        return encode_prompt(lm, prompt, chat=chat, max_tokens=max_tokens)
    ids = [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
    if not ids:
        raise PromptError("No tokens to run.")
    return ids
