"""Search-based decoding: beam search, diverse (group) beam search and contrastive search, with what
each one scored, so the Generate tab can show every beam and why it won.

- Beam search runs transformers' own `generate(num_beams=N, output_scores=True,
  return_dict_in_generate=True)`; every number shown is read back from its output: the returned
  beams (`sequences`), their length-normalised scores (`sequences_scores` = sum of log-probs /
  generated_length ** length_penalty), the per-step log-probs (`scores`, indexed through
  `beam_indices`).
- Diverse beam search and contrastive search left transformers' core `generate` in version 5: they
  live in Hub repositories (transformers-community/group-beam-search, .../contrastive-search) that
  need `trust_remote_code` and a network, neither of which lmscope uses. They are implemented here,
  step for step after transformers 4.55's `_group_beam_search` (BeamSearchScorer, BeamHypotheses,
  HammingDiversityLogitsProcessor) and `_contrastive_search` (`_ranking_fast`), and tested token for
  token against that release's own run on the default model (tests/data/decoding_reference.json,
  written by tests/data/make_decoding_reference.py).
- `repetition(ids, n)`: the share of a text's n-grams that repeat an earlier one (the degeneration
  beam search is known for).
- Every beam's log-probability is also scored by one plain forward pass of the finished texts
  (teacher forcing): the search's bookkeeping against the model itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from model_core.core.cache_api import cache_kwarg, new_cache
from model_core.core.errors import SettingsError
from model_core.core.sampling import parse_number

METHODS = ("beam", "diverse", "contrastive")
MAX_BEAMS = 8
MAX_NEW_TOKENS = 64  # beams x tokens forwards; keeps a CPU request to seconds
MAX_CONTRASTIVE_K = 20
REPEAT_N = 3  # repeated 3-grams is the headline repetition measure


# ---------------------------------------------------------------------------------------------
# settings

@dataclass(frozen=True)
class DecodingSettings:
    method: str = "beam"  # beam | diverse | contrastive
    num_beams: int = 4
    num_beam_groups: int = 1  # diverse: groups of num_beams // groups beams
    diversity_penalty: float = 0.0  # diverse: subtracted per use of a token by earlier groups at this step
    length_penalty: float = 1.0  # score = sum log p / length ** length_penalty
    penalty_alpha: float = 0.6  # contrastive: score = (1 - a) p - a max cos
    top_k: int = 4  # contrastive: candidates per step
    max_new_tokens: int = 20

    def validated(self) -> DecodingSettings:
        def whole(name, lo, hi):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise SettingsError(f"{name.replace('_', ' ')} must be a whole number from {lo} to {hi}, got {v!r}.")

        def real(name, lo, hi):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise SettingsError(f"{name.replace('_', ' ')} must be a number from {lo:g} to {hi:g}, got {v!r}.")

        if self.method not in METHODS:
            raise SettingsError(f"The decoding method must be one of {', '.join(METHODS)}, got {self.method!r}.")
        whole("max_new_tokens", 1, MAX_NEW_TOKENS)
        real("length_penalty", -5, 5)
        if self.method in ("beam", "diverse"):
            whole("num_beams", 2, MAX_BEAMS)
        if self.method == "diverse":
            whole("num_beam_groups", 1, self.num_beams)
            if self.num_beams % self.num_beam_groups:
                raise SettingsError(f"{self.num_beams} beams do not split into {self.num_beam_groups} equal groups: "
                                    "pick a number of groups that divides the beams.")
            real("diversity_penalty", 0, 10)
        if self.method == "contrastive":
            real("penalty_alpha", 0, 1)
            whole("top_k", 1, MAX_CONTRASTIVE_K)
        return self

    @classmethod
    def from_values(cls, method="beam", num_beams=4, num_beam_groups=1, diversity_penalty=0.0, length_penalty=1.0,
                    penalty_alpha=0.6, top_k=4, max_new_tokens=20) -> DecodingSettings:
        """Loosely typed input (UI, CLI, JSON) -> validated settings, or one sentence."""
        def num(name, v, default, kind=float):
            return parse_number(v, name.replace("_", " "), default, kind)
        d = cls()
        return cls(method=str(method or "beam"), num_beams=num("num_beams", num_beams, d.num_beams, int),
                   num_beam_groups=num("num_beam_groups", num_beam_groups, d.num_beam_groups, int),
                   diversity_penalty=num("diversity_penalty", diversity_penalty, d.diversity_penalty),
                   length_penalty=num("length_penalty", length_penalty, d.length_penalty),
                   penalty_alpha=num("penalty_alpha", penalty_alpha, d.penalty_alpha),
                   top_k=num("top_k", top_k, d.top_k, int),
                   max_new_tokens=num("max_new_tokens", max_new_tokens, d.max_new_tokens, int)).validated()


# ---------------------------------------------------------------------------------------------
# results

@dataclass
class Beam:
    token_ids: list[int]  # generated tokens (an EOS that ended the beam included)
    score: float  # what the search ranks by: search_logprob / length ** length_penalty
    search_logprob: float  # sum of the per-token search scores (diverse: log p minus diversity penalties)
    logprob: float  # the model's own sum of log p over the generated tokens
    step_logprobs: list[float]  # the model's log p of each generated token
    step_scores: list[float]  # the running search score after each token
    group: int = 0
    eos: bool = False
    repetition: float = 0.0  # share of repeated REPEAT_N-grams
    teacher_forced_logprob: float | None = None  # the same text scored by one plain forward pass

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class Decoding:
    method: str
    settings: DecodingSettings
    prompt_ids: list[int]
    beams: list[Beam]  # best first
    candidates: list[list[dict]] = field(default_factory=list)  # contrastive: per step, the top-k re-ranked
    greedy: Beam | None = None  # the greedy text of the same length, for comparison
    seconds: float = 0.0
    reference: str = ""  # which implementation produced the beams
    transformers_scores: list[float] | None = None  # beam search: generate's own sequences_scores

    @property
    def best(self) -> Beam:
        return self.beams[0]


# ---------------------------------------------------------------------------------------------
# helpers

def repetition(ids, n: int = REPEAT_N) -> float:
    """Share of the n-grams of `ids` that already occurred earlier in `ids` (0 when shorter than n)."""
    ids = list(ids)
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def repeated_ngrams(ids, n: int = REPEAT_N) -> list[tuple[int, ...]]:
    """The n-grams that occur more than once, in order of first occurrence."""
    ids = list(ids)
    counts: dict[tuple, int] = {}
    for i in range(len(ids) - n + 1):
        g = tuple(ids[i:i + n])
        counts[g] = counts.get(g, 0) + 1
    return [g for g, c in counts.items() if c > 1]


def _eos(lm) -> list[int]:
    from model_core.serving.generate import eos_ids

    return eos_ids(lm)


def _pad(lm, eos: list[int]) -> int:
    pad = getattr(getattr(lm.model, "generation_config", None), "pad_token_id", None)
    if pad is None:
        pad = getattr(lm.tokenizer, "pad_token_id", None)
    return int(pad if pad is not None else (eos[0] if eos else 0))


def _prompt(lm, prompt, token_ids, chat, max_prompt_tokens):
    from model_core.core.errors import PromptError
    from model_core.interp.trace import encode_prompt

    if token_ids is not None:
        ids = [int(t) for t in (token_ids.tolist() if torch.is_tensor(token_ids) else token_ids)]
        if not ids:
            raise PromptError("The prompt has no tokens.")
    else:
        ids = encode_prompt(lm, prompt, chat=chat, max_tokens=max_prompt_tokens)
    return ids


def _forward(lm, ids: torch.Tensor, cache, hidden: bool = False):
    return lm.model(input_ids=ids, use_cache=True, output_hidden_states=hidden, logits_to_keep=1,
                    **{cache_kwarg(lm.model): cache})


def teacher_forced_logprobs(lm, prompt_ids: list[int], texts: list[list[int]]) -> list[list[float]]:
    """log p of each generated token, from a plain forward of the whole text (no cache, no search).
    Texts of one length share one forward (beams that ran to max_new_tokens are usually all of them):
    rows never see each other and no padding enters, so each row is the text's own forward."""
    out: list[list[float]] = [[] for _ in texts]
    by_len: dict[int, list[int]] = {}
    for i, toks in enumerate(texts):
        if toks:
            by_len.setdefault(len(toks), []).append(i)
    with torch.inference_mode():
        for n, rows in by_len.items():
            toks = torch.tensor([list(texts[i]) for i in rows], device=lm.device)  # [R, n]
            prompt = torch.tensor([list(prompt_ids)], device=lm.device).expand(len(rows), -1)
            # the logits at the n positions that predict the text (the last position predicts nothing)
            logits = lm.model(input_ids=torch.cat([prompt, toks], 1), use_cache=False,
                              logits_to_keep=n + 1).logits[:, :-1].float()  # [R, n, V]
            lp = torch.log_softmax(logits, -1).gather(-1, toks[..., None])[..., 0]  # [R, n]
            for r, i in enumerate(rows):
                out[i] = lp[r].tolist()
    return out


# ---------------------------------------------------------------------------------------------
# beam search: transformers' generate

def _generation_config(lm, s: DecodingSettings, eos, **extra):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=False, num_beams=s.num_beams,
                            num_return_sequences=s.num_beams, length_penalty=s.length_penalty, early_stopping=False,
                            eos_token_id=eos, pad_token_id=_pad(lm, eos), output_scores=True,
                            return_dict_in_generate=True, **extra)


def beam_search(lm, ids: list[int], s: DecodingSettings) -> tuple[list[Beam], list[float]]:
    """transformers' beam search; every beam it returns, with its scores read back from the output."""
    eos = _eos(lm)
    x = torch.tensor([ids], device=lm.device)
    with torch.inference_mode():
        out = lm.model.generate(x, attention_mask=torch.ones_like(x), generation_config=_generation_config(lm, s, eos))
    P = len(ids)
    beams = []
    for b in range(out.sequences.shape[0]):
        bi = out.beam_indices[b].tolist()
        n = sum(1 for v in bi if v >= 0)
        toks = out.sequences[b, P:P + n].tolist()
        lps = [float(out.scores[t][bi[t], toks[t]]) for t in range(n)]
        total = sum(lps)
        run, steps = 0.0, []
        for v in lps:
            run += v
            steps.append(run)
        beams.append(Beam(token_ids=toks, score=total / (n ** s.length_penalty), search_logprob=total, logprob=total,
                          step_logprobs=lps, step_scores=steps, eos=bool(toks and toks[-1] in eos)))
    return beams, [float(v) for v in out.sequences_scores]


# ---------------------------------------------------------------------------------------------
# diverse (group) beam search: transformers 4.55's _group_beam_search, by hand

class _Hypotheses:
    """BeamHypotheses: the best `size` finished texts of one group, by length-normalised score."""

    def __init__(self, size: int, length_penalty: float):
        self.size, self.lp = size, length_penalty
        self.beams: list[tuple[float, dict]] = []
        self.worst = 1e9

    def add(self, entry: dict, sum_logprobs: float, generated_len: int) -> None:
        score = sum_logprobs / (generated_len ** self.lp)
        if len(self.beams) < self.size or score > self.worst:
            self.beams.append((score, entry))
            if len(self.beams) > self.size:
                ranked = sorted([(sc, i) for i, (sc, _) in enumerate(self.beams)])
                del self.beams[ranked[0][1]]
                self.worst = ranked[1][0]
            else:
                self.worst = min(score, self.worst)

    def is_done(self, best_sum_logprobs: float, cur_len: int, prompt_len: int) -> bool:
        # early_stopping=False: done when no running beam can still beat the worst finished one
        if len(self.beams) < self.size:
            return False
        return self.worst >= best_sum_logprobs / (cur_len - prompt_len) ** self.lp


def group_beam_search(lm, ids: list[int], s: DecodingSettings) -> list[Beam]:
    """Diverse beam search (Vijayakumar et al. 2016) as transformers 4.55 ran it: the beams split into
    groups that take turns at every step; group g's log-probs are lowered by diversity_penalty for
    every time an earlier group picked the same token at this step (Hamming diversity)."""
    eos = _eos(lm)
    eos_t = set(eos)
    pad = _pad(lm, eos)
    B, G = s.num_beams, s.num_beam_groups
    S = B // G
    P = len(ids)
    max_len = P + s.max_new_tokens
    dev = lm.device
    cache = new_cache(lm)
    scores = torch.full((B,), -1e9, device=dev)
    scores[::S] = 0.0  # every group starts from one beam
    # per running beam: tokens, the model's log p and the running search score per step
    runs = [{"toks": [], "lps": [], "steps": [], "search": 0.0} for _ in range(B)]
    hyps = [_Hypotheses(S, s.length_penalty) for _ in range(G)]
    done = [False] * G
    n_keep = max(2, 1 + len(eos)) * S
    with torch.inference_mode():
        # every beam starts from the prompt: one row's prefill, its cache repeated for the B beams
        # (transformers prefills B identical rows: B times the work for the same keys and values)
        out = _forward(lm, torch.tensor([ids], device=dev), cache)
        cache.batch_repeat_interleave(B)
        logits = out.logits[:, -1, :].float().expand(B, -1)  # [B, V]
        cur_len = P
        while True:
            V = logits.shape[-1]
            current = torch.zeros(B, dtype=torch.long, device=dev)
            reorder = torch.zeros(B, dtype=torch.long, device=dev)
            new_runs = [None] * B
            for g in range(G):
                lo = g * S
                logp = torch.log_softmax(logits[lo:lo + S], -1)
                processed = logp
                if g > 0 and s.diversity_penalty:
                    freq = torch.bincount(current[:lo], minlength=V).to(logp.dtype)
                    processed = logp - s.diversity_penalty * freq
                cand = (processed + scores[lo:lo + S, None]).view(-1)
                top_s, top_i = torch.topk(cand, n_keep, largest=True, sorted=True)
                parents, tokens = (top_i // V).tolist(), (top_i % V).tolist()
                top_s_l = top_s.tolist()
                if done[g]:  # a finished group keeps padding its beams
                    for j in range(S):
                        scores[lo + j] = 0.0
                        current[lo + j] = pad
                        reorder[lo + j] = lo
                        new_runs[lo + j] = runs[lo]
                    continue
                k = 0
                for rank, (tok, sc, par) in enumerate(zip(tokens, top_s_l, parents)):
                    r = runs[lo + par]
                    step_lp = float(logp[par, tok])
                    if tok in eos_t:
                        if rank >= S:
                            continue
                        hyps[g].add({"toks": r["toks"] + [tok], "lps": r["lps"] + [step_lp],
                                     "steps": r["steps"] + [sc], "search": sc, "group": g},
                                    sc, cur_len + 1 - P)
                    else:
                        scores[lo + k] = sc
                        current[lo + k] = tok
                        reorder[lo + k] = lo + par
                        new_runs[lo + k] = {"toks": r["toks"] + [tok], "lps": r["lps"] + [step_lp],
                                            "steps": r["steps"] + [sc], "search": sc}
                        k += 1
                    if k == S:
                        break
                if k < S:  # only possible with more EOS ids than the candidates allow for
                    raise SettingsError("Too many end-of-text candidates for the beams; use more beams.")
                done[g] = done[g] or hyps[g].is_done(top_s_l[0], cur_len + 1, P)
            runs = new_runs
            cur_len += 1
            cache.reorder_cache(reorder)
            if all(done) or cur_len >= max_len:
                break
            logits = _forward(lm, current[:, None], cache).logits[:, -1, :].float()
    # finalize: unfinished groups add their running beams, then the best of all groups, best first
    for g in range(G):
        if done[g]:
            continue
        for j in range(S):
            r = runs[g * S + j]
            hyps[g].add({**r, "search": float(scores[g * S + j]), "group": g}, float(scores[g * S + j]),
                        len(r["toks"]))
    ranked = sorted([b for h in hyps for b in h.beams], key=lambda t: t[0])
    beams = []
    while ranked:
        score, e = ranked.pop()
        beams.append(Beam(token_ids=e["toks"], score=score, search_logprob=e["search"], logprob=sum(e["lps"]),
                          step_logprobs=e["lps"], step_scores=e["steps"], group=e["group"],
                          eos=bool(e["toks"] and e["toks"][-1] in eos_t)))
    return beams


# ---------------------------------------------------------------------------------------------
# contrastive search: transformers 4.55's _contrastive_search, by hand

def contrastive_search(lm, ids: list[int], s: DecodingSettings) -> tuple[Beam, list[list[dict]]]:
    """Contrastive search (Su et al. 2022) as transformers 4.55 ran it: at each step the top_k most
    likely tokens are each run through the model; a candidate's score is
    (1 - alpha) * p(token) - alpha * max cosine similarity between its last hidden state and every
    earlier position's (the degeneration penalty); the best score wins."""
    eos = set(_eos(lm))
    k, a = s.top_k, s.penalty_alpha
    cache = new_cache(lm)
    toks, lps, steps, cands = [], [], [], []
    with torch.inference_mode():
        out = _forward(lm, torch.tensor([ids], device=lm.device), cache, hidden=True)
        context = out.hidden_states[-1]  # [1, T, d]
        next_logits = out.logits[:, -1, :].float()
        for _ in range(s.max_new_tokens):
            probs = torch.softmax(next_logits, -1)
            logp = torch.log_softmax(next_logits, -1)
            top_p, top_ids = torch.topk(probs, dim=-1, k=k)
            cache.batch_repeat_interleave(k)
            o = _forward(lm, top_ids.view(-1, 1), cache, hidden=True)
            hidden = o.hidden_states[-1]  # [k, 1, d]
            logits = o.logits[:, -1, :].float()
            ctx = context.repeat_interleave(k, dim=0)
            cos = torch.matmul(ctx / ctx.norm(dim=2, keepdim=True),
                               (hidden / hidden.norm(dim=2, keepdim=True)).transpose(1, 2)).squeeze(-1)  # [k, T]
            penalty, where = torch.max(cos, dim=-1)
            score = (1.0 - a) * top_p.view(-1) - a * penalty
            _, sel = score.view(1, k).max(dim=-1)
            j = int(sel[0])
            tok = int(top_ids[0, j])
            cands.append([{"id": int(top_ids[0, i]), "prob": float(top_p[0, i]), "max_cos": float(penalty[i]),
                           "most_similar_position": int(where[i]), "score": float(score[i]), "chosen": i == j}
                          for i in range(k)])
            toks.append(tok)
            lps.append(float(logp[0, tok]))
            steps.append(sum(lps))
            context = torch.cat([context, hidden[j:j + 1]], dim=1)
            cache.batch_select_indices(torch.tensor([j], device=lm.device))
            next_logits = logits[j:j + 1]
            if tok in eos:
                break
    total = sum(lps)
    beam = Beam(token_ids=toks, score=total / (len(toks) ** s.length_penalty), search_logprob=total, logprob=total,
                step_logprobs=lps, step_scores=steps, eos=bool(toks and toks[-1] in eos))
    return beam, cands


def greedy(lm, ids: list[int], max_new_tokens: int) -> Beam:
    """transformers' greedy generate, for comparison."""
    from transformers import GenerationConfig

    eos = _eos(lm)
    x = torch.tensor([ids], device=lm.device)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos,
                           pad_token_id=_pad(lm, eos), output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        out = lm.model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    toks = out.sequences[0, len(ids):].tolist()
    lps = [float(torch.log_softmax(sc[0].float(), -1)[t]) for sc, t in zip(out.scores, toks)]
    steps = [sum(lps[:i + 1]) for i in range(len(lps))]
    return Beam(token_ids=toks, score=sum(lps) / max(1, len(toks)), search_logprob=sum(lps), logprob=sum(lps),
                step_logprobs=lps, step_scores=steps, eos=bool(toks and toks[-1] in eos),
                repetition=repetition(toks))


# ---------------------------------------------------------------------------------------------
# entry point

def decode(lm, prompt: str | None = None, settings: DecodingSettings | None = None, *, token_ids=None,
           chat: bool = False, max_prompt_tokens: int | None = 1024, with_greedy: bool = True,
           check: bool = True) -> Decoding:
    """Run one search method and return every beam with its scores, its repetition and (check=True) its
    log-probability scored again by a plain forward pass."""
    s = (settings or DecodingSettings()).validated()
    ids = _prompt(lm, prompt, token_ids, chat, max_prompt_tokens)
    if len(ids) + s.max_new_tokens > lm.shape.context_length:
        from model_core.core.errors import PromptError

        raise PromptError(f"The prompt and {s.max_new_tokens} new tokens do not fit the model's context "
                          f"({lm.shape.context_length} tokens).")
    t0 = time.perf_counter()
    cands: list[list[dict]] = []
    hf_scores = None
    if s.method == "beam":
        beams, hf_scores = beam_search(lm, ids, s)
        ref = "transformers generate(num_beams)"
    elif s.method == "diverse":
        beams = group_beam_search(lm, ids, s)
        ref = "lmscope, after transformers 4.55 _group_beam_search"
    else:
        beam, cands = contrastive_search(lm, ids, s)
        beams = [beam]
        ref = "lmscope, after transformers 4.55 _contrastive_search"
    seconds = time.perf_counter() - t0
    for b in beams:
        b.repetition = repetition(b.token_ids)
    if check:
        for b, lp in zip(beams, teacher_forced_logprobs(lm, ids, [b.token_ids for b in beams])):
            b.teacher_forced_logprob = float(sum(lp))
    g = greedy(lm, ids, s.max_new_tokens) if with_greedy else None
    return Decoding(method=s.method, settings=s, prompt_ids=ids, beams=beams, candidates=cands, greedy=g,
                    seconds=seconds, reference=ref, transformers_scores=hf_scores)


def _display(lm, i: int) -> str:
    from model_core.core.tokenization import token_display

    return token_display(lm.tokenizer, i)


def beam_to_json(lm, b: Beam, rank: int | None = None) -> dict:
    d = asdict(b)
    d.update(rank=rank, length=b.length, text=lm.tokenizer.decode(b.token_ids, skip_special_tokens=False),
             tokens=[_display(lm, t) for t in b.token_ids],
             repeated_ngrams=[[_display(lm, t) for t in g] for g in repeated_ngrams(b.token_ids)])
    return d


def decoding_to_json(lm, d: Decoding) -> dict:
    best = d.best
    return {
        "model": lm.name, "method": d.method, "settings": asdict(d.settings), "reference": d.reference,
        "prompt_token_ids": d.prompt_ids,
        "token_ids": best.token_ids, "text": lm.tokenizer.decode(best.token_ids, skip_special_tokens=True),
        "score": best.score, "beams": [beam_to_json(lm, b, r) for r, b in enumerate(d.beams)],
        "transformers_sequences_scores": d.transformers_scores,
        "candidates": [[{**c, "token": _display(lm, c["id"])} for c in step] for step in d.candidates],
        "greedy": beam_to_json(lm, d.greedy) if d.greedy is not None else None,
        "repetition_n": REPEAT_N, "seconds": round(d.seconds, 4),
        "tokens_per_second": round(sum(b.length for b in d.beams) / d.seconds, 3) if d.seconds > 0 else None,
    }
