"""Sampling as a visible pipeline: the distribution after every stage, which tokens each filter
removed and how much probability mass survived, then a seeded draw.

Stage order and arithmetic follow transformers' generate(): repetition penalty, temperature,
top-k, top-p, min-p, then (explainer only) epsilon and eta (tests check each stage against the
matching transformers logits processor). Presence and frequency penalties (OpenAI's, as vLLM
applies them; transformers has no processor for them) come right after the repetition penalty,
before temperature.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from model_core.core.errors import SettingsError

FILTER_VALUE = float("-inf")


def parse_number(v, name: str, default, kind: type = float):
    """A loosely typed setting (UI, CLI, JSON: 3, "0.7", None) -> a float, or an int for kind=int;
    None or "" gives `default`. Anything else: one sentence naming the setting (a number, a finite
    number, a whole number)."""
    if v is None or v == "":
        return default
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise SettingsError(f"{name} must be a number, got {v!r}.") from None
    if not math.isfinite(f):
        raise SettingsError(f"{name} must be a finite number, got {v!r}.")
    if kind is int:
        if f != int(f):
            raise SettingsError(f"{name} must be a whole number, got {v!r}.")
        return int(f)
    return f


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0  # <= 0 means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    # OpenAI's presence / frequency penalties over the tokens generated so far (not the prompt,
    # unlike the repetition penalty): logit -= presence * (count > 0) + frequency * count
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def validated(self) -> SamplingSettings:
        """Returns self, or raises SettingsError saying which setting is out of range and why."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise SettingsError(f"{name} must be a finite number, got {v!r}.")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise SettingsError(f"top_k must be a whole number, got {self.top_k!r}.")
        if self.temperature > 100:
            raise SettingsError("temperature must be at most 100 (0 or less means greedy).")
        if self.top_k < 0:
            raise SettingsError("top_k must be 0 (off) or a positive number of tokens.")
        if not (0 < self.top_p <= 1):
            raise SettingsError("top_p must be in (0, 1]; 1 turns it off.")
        if not (0 <= self.min_p <= 1):
            raise SettingsError("min_p must be in [0, 1]; 0 turns it off.")
        if not (0 < self.repetition_penalty <= 10):
            raise SettingsError("repetition_penalty must be in (0, 10]; 1 turns it off.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # OpenAI's documented range
                raise SettingsError(f"{name} must be in [-2, 2]; 0 turns it off.")
        return self

    @property
    def penalises_generated(self) -> bool:
        """Whether the presence or frequency penalty is on (they need the generated tokens' counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @classmethod
    def from_values(cls, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, *,
                    presence_penalty=0.0, frequency_penalty=0.0):
        """Coerce loosely-typed input (UI, JSON, CLI) and validate."""
        def num(name, v, kind=float):
            return parse_number(v, name, getattr(cls, name), kind)
        return cls(temperature=num("temperature", temperature), top_k=num("top_k", top_k, int),
                   top_p=num("top_p", top_p), min_p=num("min_p", min_p),
                   repetition_penalty=num("repetition_penalty", repetition_penalty),
                   presence_penalty=num("presence_penalty", presence_penalty),
                   frequency_penalty=num("frequency_penalty", frequency_penalty)).validated()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Stage:
    name: str
    logits: torch.Tensor  # [V] after this stage (-inf where removed)
    removed: torch.Tensor  # [V] bool, removed by this stage
    kept_mass: float  # probability mass (under the stage's input distribution) that survived

    @property
    def n_removed(self) -> int:
        return int(self.removed.sum())


@dataclass
class SamplingResult:
    settings: SamplingSettings
    base_probs: torch.Tensor  # softmax of the raw logits
    stages: list[Stage] = field(default_factory=list)
    probs: torch.Tensor | None = None  # final distribution the token is drawn from
    eta_threshold: float | None = None  # eta's cutoff probability, when the eta stage ran

    @property
    def final_logits(self) -> torch.Tensor:
        return self.stages[-1].logits

    def sample(self, seed: int | None = None, generator: torch.Generator | None = None) -> int:
        if self.settings.greedy:
            return int(torch.argmax(self.final_logits))
        if generator is None:
            generator = torch.Generator(device=self.probs.device)
            generator.manual_seed(0 if seed is None else int(seed))
        return int(torch.multinomial(self.probs, 1, generator=generator))


# --- each stage: exactly the arithmetic of the transformers processor of the same name -------

def repetition_penalty(logits: torch.Tensor, context_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    if penalty == 1.0 or context_ids is None or context_ids.numel() == 0:
        return logits
    score = logits.gather(-1, context_ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(-1, context_ids, score)


def generated_counts(generated_ids, vocab: int, device=None) -> torch.Tensor:
    """How often each token occurs among the generated ids: float32 [vocab] (what the engine keeps
    per row, updated a token at a time)."""
    ids = torch.as_tensor(generated_ids, dtype=torch.long, device=device).reshape(-1)
    counts = torch.zeros(vocab, dtype=torch.float32, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))


def penalise_counts(logits: torch.Tensor, counts: torch.Tensor, presence, frequency) -> torch.Tensor:
    """logit -= presence * (count > 0) + frequency * count. presence, frequency: numbers, or
    tensors that broadcast against logits (the engine's per-row [B, 1]); one expression for the
    single-request and the batched path so both round alike."""
    return logits - (presence * (counts > 0) + frequency * counts)


def presence_frequency_penalty(logits: torch.Tensor, generated_ids, presence: float,
                               frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties as vLLM applies them, over the tokens generated so
    far in this request (not the prompt): logits [V]; generated_ids: those tokens' ids."""
    if (presence == 0 and frequency == 0) or generated_ids is None or len(generated_ids) == 0:
        return logits
    return penalise_counts(logits, generated_counts(generated_ids, logits.shape[-1], logits.device),
                           presence, frequency)


def temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    return logits if t == 1.0 else logits / t


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0:
        return logits
    k = min(k, logits.size(-1))
    return logits.masked_fill(logits < torch.topk(logits, k)[0][..., -1, None], FILTER_VALUE)


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, FILTER_VALUE)


def min_p(logits: torch.Tensor, m: float) -> torch.Tensor:
    if m <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    remove = probs < m * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return logits.masked_fill(remove, FILTER_VALUE)


def epsilon_cut(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Epsilon sampling (Hewitt et al. 2022): drop tokens whose probability is below epsilon (the most
    likely token always stays). transformers' EpsilonLogitsWarper."""
    if epsilon <= 0:
        return logits
    remove = torch.softmax(logits, dim=-1) < epsilon
    remove = remove & (logits < torch.topk(logits, 1)[0][..., -1, None])
    return logits.masked_fill(remove, FILTER_VALUE)


def eta_threshold(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Eta sampling's cutoff: min(epsilon, sqrt(epsilon) * exp(-H)), H the entropy (nats) of the
    distribution entering the stage."""
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    eps = torch.tensor(float(epsilon), device=logits.device)
    return torch.min(eps, torch.sqrt(eps) * torch.exp(-entropy))


def eta_cut(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Eta sampling (Hewitt et al. 2022): an entropy-dependent epsilon cut. transformers' EtaLogitsWarper."""
    if epsilon <= 0:
        return logits
    remove = torch.softmax(logits, dim=-1) < eta_threshold(logits, epsilon)[..., None]
    remove = remove & (logits < torch.topk(logits, 1)[0][..., -1, None])
    return logits.masked_fill(remove, FILTER_VALUE)


def check_cutoff(name: str, v) -> float:
    """epsilon / eta: 0 (off) or a probability in (0, 1); one sentence otherwise."""
    try:
        f = float(0.0 if v is None or v == "" else v)
    except (TypeError, ValueError):
        raise SettingsError(f"{name} must be a number, got {v!r}.") from None
    if isinstance(v, bool) or not math.isfinite(f) or not 0 <= f < 1:
        raise SettingsError(f"{name} must be 0 (off) or a probability below 1, got {v!r}.")
    return f


def apply_sampling(logits: torch.Tensor, settings: SamplingSettings, context_ids=None, *, epsilon: float = 0.0,
                   eta: float = 0.0, generated_ids=None) -> SamplingResult:
    """logits [V] (one position). context_ids: tokens seen so far, prompt and generated (for the
    repetition penalty). generated_ids: the tokens this request generated so far (for the presence
    and frequency penalties; their stage, "presence_frequency_penalty", is listed when either is on).
    epsilon / eta: the explainer's truncation cutoffs after min-p, in transformers' order (0 = off);
    they are not generation settings (the generation engine does not apply them)."""
    settings = settings.validated()
    epsilon, eta = check_cutoff("epsilon", epsilon), check_cutoff("eta", eta)
    logits = logits.detach().float()
    if context_ids is not None and not torch.is_tensor(context_ids):
        context_ids = torch.tensor(list(context_ids), dtype=torch.long)
    if context_ids is not None:
        context_ids = context_ids.to(logits.device).long().reshape(-1)
    res = SamplingResult(settings=settings, base_probs=torch.softmax(logits, -1))
    current = logits
    res.stages.append(Stage("raw", current, torch.zeros_like(current, dtype=torch.bool), 1.0))

    def step(name, new):
        nonlocal current
        removed = torch.isinf(new) & (new < 0) & ~(torch.isinf(current) & (current < 0))
        before = torch.softmax(current, -1)
        kept = float(before[~removed].sum()) if removed.any() else 1.0
        res.stages.append(Stage(name, new, removed, kept))
        current = new

    step("repetition_penalty", repetition_penalty(current, context_ids, settings.repetition_penalty))
    if settings.penalises_generated:
        if generated_ids is not None and not torch.is_tensor(generated_ids):
            generated_ids = list(generated_ids)
        step("presence_frequency_penalty", presence_frequency_penalty(
            current, generated_ids, settings.presence_penalty, settings.frequency_penalty))
    if settings.greedy:
        # Greedy: the argmax survives alone (what generate(do_sample=False) picks).
        keep = torch.zeros_like(current, dtype=torch.bool)
        keep[torch.argmax(current)] = True
        step("greedy", current.masked_fill(~keep, FILTER_VALUE))
    else:
        step("temperature", temperature(current, settings.temperature))
        step("top_k", top_k(current, settings.top_k))
        step("top_p", top_p(current, settings.top_p))
        step("min_p", min_p(current, settings.min_p))
        if epsilon > 0:
            step("epsilon", epsilon_cut(current, epsilon))
        if eta > 0:
            res.eta_threshold = float(eta_threshold(current, eta))
            step("eta", eta_cut(current, eta))
    res.probs = torch.softmax(current, -1)
    return res
