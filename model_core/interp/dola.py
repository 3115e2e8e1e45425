"""DoLa, decoding by contrasting layers (Chuang et al. 2023, arXiv 2309.03883): at each step the
final layer's next-token distribution is contrasted with an earlier ("premature") layer's, the one
whose distribution differs most from the final one, and greedy decoding takes the argmax of the
contrast. Tokens the final layer finds implausible are masked out first.

The arithmetic is transformers 4.x's (`GenerationMixin._dola_decoding`, `_dola_select_contrast`,
`_relative_top_filter`; 4.55.4 was the last release with them in core `generate`, transformers 5
moved DoLa to a Hub repository), itself the published code's (github.com/voidism/DoLa):

- candidates (`candidate_layers`): hidden state l is the residual stream entering block l (0 = the
  embeddings). 'low' = range(start, N // 2, 2) and 'high' = range(N // 2, N, 2) for N <= 40 layers,
  range(start, 20, 2) and range(N - 20, N, 2) above; start = 2 when the unembedding is tied to the
  embedding (the embedding layer read through its own transpose says little), else 0.
- a candidate's logits are lm_head(hidden state), WITHOUT the final norm: the published code and
  transformers 4.x read the raw residual stream, so these are not the logit lens's distributions
  (lens.py normalises first). `premature_norm=True` reads them through the final norm instead,
  the logit lens's way; it is not what the references run.
- the divergence (`js_divergence`) is the code's, not the textbook JSD: with M = (P + Q) / 2 it is
  0.5 * (KL(M || P) + KL(M || Q)) / V (torch's kl_div(log p, m) is m (log m - log p), averaged over
  the vocabulary). The paper writes JSD(P || Q) = 0.5 * (KL(P || M) + KL(Q || M)); both are zero
  exactly when P = Q, but they can rank candidates differently. The premature layer is the argmax.
- the contrast (`contrast`): log_softmax(final) - log_softmax(premature) on the tokens whose
  final-layer probability is at least relative_top (0.1) times the largest; -inf elsewhere.
- a repetition penalty, when asked for, is transformers' processor applied to the contrast (the
  4.x docs recommended 1.2 with DoLa; nothing here adds it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model_core.core.cache_api import cache_kwarg, new_cache
from model_core.core.errors import SettingsError
from model_core.core.sampling import repetition_penalty as apply_repetition_penalty
from model_core.core.tokenization import token_display

LAYER_CHOICES = ("low", "high")
RELATIVE_TOP = 0.1
BASE_FILTER_VALUE = -1e-3  # the premature layer's log-prob on masked tokens (4.x's base_filter_value)
TOP_K = 5


def check_layers(which) -> str:
    if which not in LAYER_CHOICES:
        raise SettingsError(f"DoLa layers are 'low' or 'high', not {which!r}.")
    return which


def candidate_layers(n_layers: int, which: str, tied: bool) -> list[int]:
    """The premature layers DoLa chooses among (hidden-state indices, 0 = the embeddings)."""
    check_layers(which)
    N = int(n_layers)
    # the embedding read through its own transpose is close to the identity: skipped when tied;
    # a model of 2 layers or fewer keeps layer 1 if it is not the final one
    start = 0 if not tied else 2 if N > 2 else 1 if N == 2 else 0
    if which == "low":
        if start == N // 2:
            return [start]
        return list(range(start, N // 2, 2)) if N <= 40 else list(range(start, 20, 2))
    return list(range(N // 2, N, 2)) if N <= 40 else list(range(N - 20, N, 2))


def js_divergence(final_logits: torch.Tensor, premature_logits: torch.Tensor) -> torch.Tensor:
    """final_logits [V], premature_logits [C, V] -> [C]: DoLa's divergence of each candidate from the
    final layer, 0.5 * (KL(M || P) + KL(M || Q)) / V with M = (P + Q) / 2 (see the module docstring)."""
    p = F.softmax(final_logits, dim=-1)
    q = F.softmax(premature_logits, dim=-1)
    m = 0.5 * (p[None, :] + q)
    kl1 = F.kl_div(F.log_softmax(final_logits, dim=-1)[None, :], m, reduction="none").mean(-1)
    kl2 = F.kl_div(F.log_softmax(premature_logits, dim=-1), m, reduction="none").mean(-1)
    return 0.5 * (kl1 + kl2)


def contrast(final_logits: torch.Tensor, premature_logits: torch.Tensor,
             relative_top: float = RELATIVE_TOP) -> torch.Tensor:
    """[V], [V] -> [V]: log p_final - log p_premature where p_final >= relative_top * max p_final,
    -inf elsewhere (the adaptive plausibility constraint)."""
    final = final_logits.log_softmax(dim=-1)
    base = premature_logits.log_softmax(dim=-1)
    # 4.x: min(the largest log-prob, max + log(relative_top)), so the top token always stays
    thresh = torch.minimum(final.max(), final.max() + math.log(relative_top))
    dropped = final < thresh
    final = final.masked_fill(dropped, float("-inf"))
    base = base.masked_fill(dropped, BASE_FILTER_VALUE)
    return final - base


def select_premature(candidates: list[int], final_logits: torch.Tensor,
                     premature_logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The candidate with the largest divergence from the final layer, and every candidate's divergence.
    premature_logits [C, V] in the order of `candidates`. With one candidate there is nothing to choose."""
    js = js_divergence(final_logits, premature_logits)
    return (candidates[0] if len(candidates) == 1 else candidates[int(js.argmax())]), js


@dataclass
class DolaStep:
    token_id: int
    premature_layer: int
    js: dict[int, float]  # every candidate's divergence from the final layer
    final_top: list[tuple[int, float]]  # the final layer's top tokens, (id, p)
    premature_top: list[tuple[int, float]]  # the premature layer's top tokens, (id, p)
    contrast_top: list[tuple[int, float]]  # after the contrast (and the penalty), (id, score)


@dataclass
class DolaGeneration:
    prompt_ids: list[int]
    token_ids: list[int]
    layers: str
    candidates: list[int]
    finish_reason: str  # "eos" or "length"
    seconds: float
    repetition_penalty: float = 1.0
    premature_norm: bool = False
    steps: list[DolaStep] = field(default_factory=list)

    def to_json(self, tokenizer=None) -> dict:
        def tops(pairs, key):
            return [{"id": i, key: v, **({"token": _show(tokenizer, i)} if tokenizer is not None else {})}
                    for i, v in pairs]

        out = {"prompt_token_ids": self.prompt_ids, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "seconds": self.seconds,
               "dola": {"layers": self.layers, "candidates": self.candidates, "relative_top": RELATIVE_TOP,
                        "repetition_penalty": self.repetition_penalty, "premature_norm": self.premature_norm,
                        "steps": [{"token_id": s.token_id, "premature_layer": s.premature_layer,
                                   "js": {str(k): v for k, v in s.js.items()},
                                   "final_top": tops(s.final_top, "p"), "premature_top": tops(s.premature_top, "p"),
                                   "contrast_top": tops(s.contrast_top, "score")} for s in self.steps]}}
        if tokenizer is not None:
            out["text"] = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return out


def _show(tokenizer, token_id: int) -> str:
    return token_display(tokenizer, token_id)


def _top(values: torch.Tensor, k: int) -> list[tuple[int, float]]:
    t = torch.topk(values.float(), k)
    # masked tokens (-inf after the contrast) are not candidates: left out (JSON has no infinity)
    return [(i, v) for i, v in zip(t.indices.tolist(), t.values.tolist()) if math.isfinite(v)]


def _stop_ids(lm) -> set[int]:
    """The generation config's EOS id(s), what transformers' generate stops on."""
    eos = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(lm.tokenizer, "eos_token_id", None)
    return set() if eos is None else {int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos])}


@torch.inference_mode()
def dola_greedy(lm, prompt_ids: list[int], max_new_tokens: int, layers: str = "low", *,
                repetition_penalty: float = 1.0, premature_norm: bool = False, eos_ids=None,
                top_k: int = TOP_K) -> DolaGeneration:
    """Greedy DoLa decoding of up to max_new_tokens after prompt_ids, every step recorded."""
    check_layers(layers)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SettingsError("max_new_tokens must be a whole number of at least 1.")
    model = lm.model
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    candidates = candidate_layers(config.num_hidden_layers, layers,
                                  bool(getattr(config, "tie_word_embeddings", False)))
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise SettingsError(f"Model '{lm.name}' has no output embedding for DoLa to read its layers through.")
    stop = set(eos_ids) if eos_ids is not None else _stop_ids(lm)
    device = lm.device
    context = torch.tensor([list(prompt_ids)], device=device)
    cache, ids = new_cache(lm), context
    generated: list[int] = []
    steps: list[DolaStep] = []
    reason = "length"
    t0 = time.perf_counter()
    while len(generated) < max_new_tokens:
        out = model(input_ids=ids, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                    **{cache_kwarg(model): cache})
        final = out.logits[0, -1].float()
        # a model split over GPUs keeps each layer's states on its own device: gathered where they are read
        norm_device = lm.adapter.final_norm.weight.device if premature_norm else lm_head.weight.device
        hidden = torch.stack([out.hidden_states[layer][0, -1].to(norm_device) for layer in candidates])  # [C, d]
        if premature_norm:
            hidden = lm.adapter.final_norm(hidden).to(lm_head.weight.device)
        # kept in the head's dtype, as 4.x kept them (its final logits alone are cast to float32)
        premature = lm_head(hidden).to(final.device)  # [C, V]
        layer, js = select_premature(candidates, final, premature)
        chosen = premature[candidates.index(layer)]
        scores = contrast(final, chosen)
        scores = apply_repetition_penalty(scores, context[0], repetition_penalty)
        token = int(scores.argmax())
        steps.append(DolaStep(token_id=token, premature_layer=layer,
                              js=dict(zip(candidates, js.float().tolist())),
                              final_top=_top(final.softmax(-1), top_k),
                              premature_top=_top(chosen.float().softmax(-1), top_k),
                              contrast_top=_top(scores, top_k)))
        generated.append(token)
        ids = torch.tensor([[token]], device=device)
        context = torch.cat([context, ids], dim=-1)
        if token in stop:
            reason = "eos"
            break
    return DolaGeneration(prompt_ids=list(prompt_ids), token_ids=generated, layers=layers, candidates=candidates,
                          finish_reason=reason, seconds=time.perf_counter() - t0,
                          repetition_penalty=float(repetition_penalty), premature_norm=premature_norm, steps=steps)
