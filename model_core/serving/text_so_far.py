"""The continuation's text as it grows by one token per step (`TextSoFar`), and its cut at the
first stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, str | None]:
    """The text cut before the first stop string that appears in it, and that string (or None)."""
    hit = None
    if stop:
        found = [(text.find(s), s) for s in stop if s in text]
        if found:
            pos, hit = min(found)
            text = text[:pos]
    return text, hit


class TextSoFar:
    """`tok.decode(ids, skip_special_tokens=True)` as `ids` grows by one token per step, without
    decoding the whole continuation at every step (256 tokens cost 32 us a step on a 2-core CPU,
    and 32 users at 300 steps/s each would spend a third of the interpreter's time there).

    The text is a settled part (the whole decode of the first `start` tokens, checked against a
    whole decode when it moves) plus the decode of the tokens since, read through an overlap of
    the tokens just before `start` whose text begins with a visible character: a decoder that
    treats the start of what it decodes specially (a sentencepiece decoder stripping a leading
    space) then sees the same start in both, and bytes of one character are decoded together.
    Where the overlap does not explain the step's text, the step decodes everything; a tokenizer
    whose incremental text ever differed from its whole decode is decoded whole from then on."""

    SETTLE_EVERY = 16  # tokens between checks against a whole decode
    MAX_OVERLAP = 8  # tokens looked back for an overlap that starts with a visible character

    def __init__(self, tok):
        self.tok, self.ids = tok, []
        self.settled, self.start = "", 0  # decode(ids[:start])
        self.lo, self.head = 0, ""  # the overlap ids[lo:start] and its decode
        self.full_only = bool(getattr(tok, "_lmscope_full_decode", False))
        self._decode = _piece_decoder(tok)

    def whole(self) -> str:  # the reference every check is against: decode(ids) through what tok.decode runs
        return self._decode(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self.full_only:
            return self.whole()
        window = self._decode(self.ids[self.lo:])
        if not window.startswith(self.head):
            return self.whole()
        text = self.settled + window[len(self.head):]
        if len(self.ids) - self.start >= self.SETTLE_EVERY and not text.endswith("\ufffd"):
            whole = self.whole()
            if whole != text:  # this tokenizer does not decode piecewise: whole from now on
                self.tok._lmscope_full_decode = self.full_only = True
                return whole
            self._settle(whole)
        return text

    def _settle(self, whole: str) -> None:
        n = len(self.ids)
        for lo in range(n - 1, max(self.start, n - self.MAX_OVERLAP) - 1, -1):
            head = self._decode(self.ids[lo:])
            if head and not head[0].isspace():
                self.settled, self.start, self.lo, self.head = whole, n, lo, head
                return
        # Prose without punctuation: every token of the last few starts with a space. The last token
        # still serves where the whole text ends with its decode (a decoder that strips the leading
        # space strips it in the window too); left unsettled, every later step would decode everything.
        head = self._decode(self.ids[n - 1:])
        if head and whole.endswith(head):
            self.settled, self.start, self.lo, self.head = whole, n, n - 1, head


def _piece_decoder(tok) -> Callable[[list[int]], str]:
    """`tok.decode(ids, skip_special_tokens=True)` for TextSoFar's windows and whole decodes. Where that
    is the `tokenizers` backend's decode and nothing more (transformers' `TokenizersBackend` with its
    stock `decode` and `_decode`, without space clean-up), the backend is called directly:
    transformers' argument conversion cost 3.6 of 6.4 us a call (and 5% of the interpreter's time at
    32 users, in the whole decodes every SETTLE_EVERY tokens)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers without it: the wrapper
        TokenizersBackend = None
    backend = getattr(tok, "_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tok, TokenizersBackend) and backend is not None
            and type(tok)._decode is TokenizersBackend._decode and not tok.clean_up_tokenization_spaces
            and type(tok).decode is PreTrainedTokenizerBase.decode and "decode" not in vars(tok)):
        return partial(backend.decode, skip_special_tokens=True)
    return partial(tok.decode, skip_special_tokens=True)
