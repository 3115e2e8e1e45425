"""The sampling pipeline for a batch of rows, each with its own settings, plus every per-step record.

`model_core.core.sampling` runs the stages on one distribution with Python-level settings; the engine
needs the same arithmetic on [B, V] logits where every row has its own temperature, top-k, top-p,
min-p, repetition penalty, greedy flag and seed, without a Python branch per row (so one captured
CUDA graph serves any mix of settings). A stage that is off for a row is the identity for that row.

Each stage does the same elementwise arithmetic as transformers' logits processor of that name
(tests compare row by row with `model_core.core.sampling` and with transformers itself):

  repetition penalty  gather the seen tokens' logits, x*p if x<0 else x/p   (RepetitionPenaltyLogitsProcessor)
  presence/frequency  x - (presence * (count > 0) + frequency * count), counts over the row's
                      generated tokens (OpenAI's penalties as vLLM applies them; no transformers processor)
  temperature         x / t                                                  (TemperatureLogitsWarper)
  top-k               x < k-th largest -> -inf                               (TopKLogitsWarper)
  top-p               ascending sort, cumsum of softmax <= 1-p -> -inf, keep the last (TopPLogitsWarper)
  min-p               p < min_p * max p -> -inf, keep the top token          (MinPLogitsWarper)
  greedy              everything but the argmax -> -inf

Seeded draws use a counter-based generator: the uniform for (row seed, step, token) is a hash of
those three numbers, so a row draws the same tokens whether it runs alone or in a batch of 32 and
needs no torch.Generator state (which a CUDA graph could not carry per row). The draw is the
Gumbel-max trick: argmax(logits + Gumbel noise) is a sample from softmax(logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_core.core.sampling import penalise_counts

FILTER_VALUE = float("-inf")
STAGE_CODES = {None: 0, "top_k": 1, "top_p": 2, "min_p": 3, "greedy": 4}
HEAD = 15  # values before the per-candidate block of a packed record
_M32 = 0xFFFFFFFF


def packed_width(k: int) -> int:
    """Floats per row of a packed record with k recorded candidates."""
    return HEAD + 5 * k


@dataclass
class RowSettings:
    """Per-row sampling settings as tensors [B] on the device (the engine keeps one per slot)."""

    temperature: torch.Tensor  # float32; greedy rows keep 1.0 here (unused)
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32; 1 = off
    min_p: torch.Tensor  # float32; 0 = off
    repetition_penalty: torch.Tensor  # float32; 1 = off
    presence_penalty: torch.Tensor  # float32; 0 = off
    frequency_penalty: torch.Tensor  # float32; 0 = off
    greedy: torch.Tensor  # bool
    seed: torch.Tensor  # int64
    step: torch.Tensor  # int64: the draw counter (how many tokens this row has drawn)
    # float32 [rows, V]: how often each token occurs among the row's generated tokens (the presence
    # and frequency penalties); the decode step adds each token going in. Set up with vocab=1 (the
    # default) it is a column of zeros that broadcasts: rows without those penalties.
    counts: torch.Tensor

    @classmethod
    def empty(cls, rows: int, device, vocab: int = 1) -> RowSettings:
        f = dict(device=device, dtype=torch.float32)
        return cls(torch.ones(rows, **f), torch.zeros(rows, device=device, dtype=torch.long),
                   torch.ones(rows, **f), torch.zeros(rows, **f), torch.ones(rows, **f),
                   torch.zeros(rows, **f), torch.zeros(rows, **f),
                   torch.ones(rows, device=device, dtype=torch.bool),
                   torch.zeros(rows, device=device, dtype=torch.long), torch.zeros(rows, device=device, dtype=torch.long),
                   torch.zeros(rows, vocab, **f))

    def rows(self, sl: slice) -> RowSettings:
        return RowSettings(*(getattr(self, f)[sl] for f in self.__dataclass_fields__))

    def set_rows(self, idx: torch.Tensor, settings_list, seeds) -> None:
        """Write requests' SamplingSettings into rows idx: one host -> device copy per field; the
        rows' counts start at zero (nothing generated yet)."""
        values = [_row_values(s, seed) for s, seed in zip(settings_list, seeds)]
        for f, column in zip(self.__dataclass_fields__, zip(*values)):  # every field but counts
            t = getattr(self, f)
            t[idx] = torch.tensor(column, dtype=t.dtype).to(t.device, non_blocking=True)
        self.counts[idx] = 0

    def set_row(self, i: int, settings, seed: int) -> None:
        """Write one request's SamplingSettings into row i (host -> device, a few scalars)."""
        for f, v in zip(self.__dataclass_fields__, _row_values(settings, seed)):  # every field but counts
            getattr(self, f)[i] = v
        self.counts[i] = 0

def _row_values(settings, seed: int) -> tuple:
    """One request's row, in RowSettings' field order (counts aside). The penalties apply to greedy
    rows too (they change which token is the argmax)."""
    greedy = bool(settings.greedy)
    return (1.0 if greedy else float(settings.temperature), 0 if greedy else int(settings.top_k),
            1.0 if greedy else float(settings.top_p), 0.0 if greedy else float(settings.min_p),
            float(settings.repetition_penalty), float(settings.presence_penalty),
            float(settings.frequency_penalty), greedy, int(seed), 0)


# ---------------------------------------------------------------------------------------------
# counter-based uniforms

def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2^32.
    Multipliers stay below 2^31 so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _M32
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """seed, step [B] int64 -> uniforms [B, vocab] in (0, 1), a pure function of (seed, step, token)."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    row = _mix32(lo ^ _mix32(hi + 0x5BD1E995))
    row = _mix32(row ^ ((step & _M32) * 0x27D4EB2F & _M32))  # [B]
    tok = torch.arange(vocab, device=seed.device, dtype=torch.long)
    x = _mix32(_mix32(row[:, None] ^ tok[None, :]) + row[:, None])  # [B, V]
    return (x >> 8).float() * (2.0 ** -24) + 2.0 ** -25


# ---------------------------------------------------------------------------------------------
# the stages, batched, one setting per row

def repetition_penalty_rows(x: torch.Tensor, seen: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """x [B, V]; seen [B, V] bool (tokens in the row's context); p [B]."""
    p = p[:, None]
    penalised = torch.where(x < 0, x * p, x / p)
    return torch.where(seen & (p != 1.0), penalised, x)


def presence_frequency_rows(x: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                            frequency: torch.Tensor) -> torch.Tensor:
    """x [B, V]; counts [B, V] (or [B, 1] zeros) of the generated tokens; presence, frequency [B].
    sampling.penalise_counts, the single-request path's expression, so both round alike; a row
    with both at 0 subtracts 0 (the identity)."""
    return penalise_counts(x, counts, presence[:, None], frequency[:, None])


def top_k_rows(x: torch.Tensor, k: torch.Tensor, sorted_asc: torch.Tensor) -> torch.Tensor:
    """k [B] int64 (0 = off); sorted_asc: x sorted ascending along the vocabulary."""
    V = x.shape[-1]
    kk = torch.where(k > 0, k.clamp(max=V), torch.full_like(k, V))
    kth = sorted_asc.gather(-1, (V - kk)[:, None])  # [B, 1], the k-th largest
    return x.masked_fill((x < kth) & (k > 0)[:, None], FILTER_VALUE)


def top_p_rows(x: torch.Tensor, p: torch.Tensor, sorted_x: torch.Tensor | None = None,
               idx: torch.Tensor | None = None) -> torch.Tensor:
    """sorted_x, idx: x sorted ascending, when the caller has it (else sorted here)."""
    if sorted_x is None:
        sorted_x, idx = torch.sort(x, descending=False)
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - p)[:, None]
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, idx, remove_sorted)
    return x.masked_fill(remove & (p < 1.0)[:, None], FILTER_VALUE)


def min_p_rows(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(x, dim=-1)
    remove = probs < m[:, None] * probs.amax(dim=-1, keepdim=True)
    top = torch.topk(probs, 1, dim=-1).indices  # [B, 1]
    # a bool tensor, not the scalar False: TorchScript (cpu_graphs) has no bool Scalar, and inductor
    # turns an int scalar's scatter into an int64 mask
    remove.scatter_(-1, top, torch.zeros_like(top, dtype=torch.bool))
    return x.masked_fill(remove & (m > 0)[:, None], FILTER_VALUE)


def greedy_rows(x: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    keep = torch.zeros_like(x, dtype=torch.bool)
    best = torch.argmax(x, -1, keepdim=True)  # [B, 1]
    keep.scatter_(-1, best, torch.ones_like(best, dtype=torch.bool))  # a bool tensor: see min_p_rows
    return x.masked_fill(~keep & greedy[:, None], FILTER_VALUE)


# ---------------------------------------------------------------------------------------------
# one step for every row: draw + record

ALL_STAGES = frozenset({"repetition_penalty", "presence_frequency", "sampled", "top_k", "top_p", "min_p"})


def stages_in_use(settings_list) -> frozenset:
    """The stages some row needs, from the rows' SamplingSettings (eager callers skip the rest:
    a stage that is off for every row is the identity; a captured graph runs them all)."""
    out = set()
    for s in settings_list:
        if s.repetition_penalty != 1.0:
            out.add("repetition_penalty")
        if s.presence_penalty != 0 or s.frequency_penalty != 0:
            out.add("presence_frequency")  # the decode step also keeps the rows' counts only then
        if not s.greedy:
            out.add("sampled")
            out.update(name for name, on in (("top_k", s.top_k > 0), ("top_p", s.top_p < 1.0),
                                             ("min_p", s.min_p > 0)) if on)
    return frozenset(out)


def sample_rows(logits: torch.Tensor, st: RowSettings, seen: torch.Tensor, k: int,
                stages: frozenset = ALL_STAGES):
    """logits [B, V] float32 -> (chosen [B] int64, packed [B, packed_width(k)] float32, final [B, V]).

    The packed record per row is the layout `model_core.serving.generation_records._unpack` reads:
    chosen id, its rank among the raw logits, its raw and filtered probability, both entropies, the
    number of candidates left, tokens removed and mass kept per filter (top-k, top-p, min-p, greedy),
    then the top-k candidates before the filters with the stage that removed each, and after them.
    `stages`: the stages any row uses (`stages_in_use`); the others are skipped as identities."""
    raw = logits
    x = repetition_penalty_rows(raw, seen, st.repetition_penalty) if "repetition_penalty" in stages else raw
    if "presence_frequency" in stages:
        x = presence_frequency_rows(x, st.counts, st.presence_penalty, st.frequency_penalty)
    sampled = ~st.greedy
    if "sampled" in stages:
        x = torch.where(sampled[:, None], x / st.temperature[:, None], x)
    # chain[j]: the logits after stage j (0: penalty + temperature, 1: top-k, 2: top-p, 3: min-p,
    # 4: greedy); a skipped stage repeats its input, and same[j] says so (its counts are reused,
    # by position: no id() here, which a compiled version would have to guard on)
    chain, same = [x], [False]
    if "top_k" in stages or "top_p" in stages:
        # One sort serves top-k and top-p: top-k removes a prefix of x's ascending order (the values
        # below the k-th largest), so the top-k output sorted ascending is that order with the prefix
        # set to -inf, which is what transformers' top-p sorts (-inf ties carry no probability).
        sorted_x, idx = torch.sort(x, descending=False)
        k_on = torch.where(sampled, st.top_k, torch.zeros_like(st.top_k))
        chain.append(top_k_rows(x, k_on, sorted_x))
        V = x.shape[-1]
        kth = sorted_x.gather(-1, (V - torch.where(k_on > 0, k_on.clamp(max=V), torch.full_like(k_on, V)))[:, None])
        sorted_k = sorted_x.masked_fill((sorted_x < kth) & (k_on > 0)[:, None], FILTER_VALUE)
        chain.append(top_p_rows(chain[-1], torch.where(sampled, st.top_p, torch.ones_like(st.top_p)), sorted_k, idx))
        same += [False, False]
    else:
        chain += [x, x]
        same += [True, True]
    if "min_p" in stages:
        chain.append(min_p_rows(chain[-1], torch.where(sampled, st.min_p, torch.zeros_like(st.min_p))))
        same.append(False)
    else:
        chain.append(chain[-1])
        same.append(True)
    chain.append(greedy_rows(chain[-1], st.greedy))
    same.append(False)
    cur = chain[-1]
    probs = torch.softmax(cur, -1)

    if "sampled" in stages:
        gumbel = -torch.log(-torch.log(counter_uniform(st.seed, st.step, cur.shape[-1])))
        drawn = torch.argmax(cur + gumbel, -1)
        chosen = torch.where(st.greedy, torch.argmax(cur, -1), drawn)  # [B]
    else:
        chosen = torch.argmax(cur, -1)

    base = torch.softmax(raw, -1)
    k = min(k, raw.shape[-1])
    top_p_, top_i = torch.topk(base, k)
    aft_p, aft_i = torch.topk(probs, k)
    removed_by = torch.zeros_like(top_p_)
    for code in (4, 3, 2, 1):  # stage j+1 of the chain has code j+1; the earliest remover wins
        before, after = chain[code - 1], chain[code]
        gone = torch.isneginf(after.gather(-1, top_i)) & ~torch.isneginf(before.gather(-1, top_i))
        removed_by = torch.where(gone, torch.full_like(removed_by, float(code)), removed_by)
    finite, lses = [], []
    for t, repeat in zip(chain, same):  # a skipped stage's counts are its input's
        finite.append(finite[-1] if repeat else (t > FILTER_VALUE).float().sum(-1))
        lses.append(lses[-1] if repeat else torch.logsumexp(t, -1))
    n_removed = [finite[j] - finite[j + 1] for j in range(4)]
    kept = [torch.exp(lses[j + 1] - lses[j]) for j in range(4)]
    c = chosen[:, None]
    raw_c = raw.gather(-1, c)
    rank = (raw > raw_c).float().sum(-1) + 1
    head = torch.stack([
        chosen.float(), rank, base.gather(-1, c)[:, 0], probs.gather(-1, c)[:, 0],
        # entropy H = logsumexp(x) - sum(p * x)
        torch.logsumexp(raw, -1) - (base * raw).sum(-1),
        lses[-1] - (probs * cur.nan_to_num(neginf=0.0)).sum(-1),
        (probs > 0).float().sum(-1), *n_removed, *kept,
    ], -1)  # [B, HEAD]
    packed = torch.cat([head, top_i.float(), top_p_, removed_by, aft_i.float(), aft_p], -1)
    return chosen, packed, cur
