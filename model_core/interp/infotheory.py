"""Entropy, cross-entropy and KL divergence on the model's real distributions, and model FLOPs
utilisation (MFU) from a measured tokens/s.

- `entropy_of(logits)`: H(P) = -sum p log p of the next-token distribution, in nats and bits, with
  the tokens that contribute most.
- `prompt_cross_entropy(lm, ids)`: the surprisal -log p(x_t | x_<t) of every actual next token of
  the prompt and their mean, the cross-entropy = the model's language-modelling loss; checked
  against transformers' own loss (`labels=`).
- `kl_divergence(p_logits, q_logits)`: KL(P||Q) = sum p (log p - log q) and the reverse, with the
  identity CE(P, Q) = H(P) + KL(P||Q); checked against torch.nn.functional.kl_div.
- `compare_distributions(...)`: P = the model at temperature 1 after the prompt, Q = the same logits
  at temperature T, or another model with the same vocabulary (a fine-tuned model vs its base).
- `mfu(...)`: FLOPs per token 6N (training: forward 2N + backward 4N) or 2N (inference forward),
  achieved FLOP/s = that x tokens/s, MFU = achieved / peak.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from model_core.core.errors import SettingsError

LN2 = math.log(2)
# dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s, no sparsity)
PEAKS = {
    "NVIDIA H100 SXM / H200, bf16 dense (989 TFLOP/s)": 989e12,
    "NVIDIA H100 PCIe, bf16 dense (756 TFLOP/s)": 756e12,
    "NVIDIA A100, bf16 dense (312 TFLOP/s)": 312e12,
    "NVIDIA L4, bf16 dense (121 TFLOP/s)": 121e12,
}
DEFAULT_PEAK = next(iter(PEAKS))


def entropy_of(logits: torch.Tensor, k: int = 10) -> dict:
    """Entropy of softmax(logits) [V]: nats, bits, and the k tokens contributing most (-p log p)."""
    logits = logits.detach().double().reshape(-1)  # float64: a 49k-term fp32 sum drifts ~1e-5 nats
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    terms = -(p * logp).nan_to_num(0.0)  # 0 log 0 = 0
    h = float(terms.sum())
    top = torch.topk(terms, min(k, terms.numel()))
    return {"nats": h, "bits": h / LN2, "perplexity": math.exp(h), "vocab": int(logits.numel()),
            "max_nats": math.log(logits.numel()),
            "top": [{"id": int(i), "p": float(p[i]), "term": float(t)} for t, i in zip(top.values, top.indices)]}


def prompt_cross_entropy(lm, ids: list[int]) -> dict:
    """Per-token surprisal of the prompt's own next tokens and their mean (the loss), by hand from
    the logits, next to transformers' loss from the same forward with labels=input_ids."""
    if len(ids) < 2:
        raise SettingsError("The cross-entropy needs a prompt of at least two tokens (one to predict).")
    x = torch.tensor([ids], device=lm.device)
    with torch.inference_mode():
        out = lm.model(input_ids=x, labels=x, use_cache=False)
    logp = torch.log_softmax(out.logits[0, :-1].float(), -1)
    target = x[0, 1:]
    surprisal = -logp.gather(-1, target[:, None])[:, 0]
    ce = float(surprisal.mean())
    return {"surprisal": surprisal.tolist(), "targets": target.tolist(), "sum": float(surprisal.sum()),
            "n": int(target.numel()), "nats": ce, "bits": ce / LN2, "perplexity": math.exp(ce),
            "transformers_loss": float(out.loss)}


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict:
    """KL(P||Q), KL(Q||P), H(P), CE(P,Q) for P = softmax(p_logits), Q = softmax(q_logits) [V], by
    hand, with torch's kl_div of the same pair as the reference."""
    # float64 for the same reason as entropy_of: the sums run over the whole vocabulary
    lp = torch.log_softmax(p_logits.detach().double().reshape(-1), -1)
    lq = torch.log_softmax(q_logits.detach().double().reshape(-1), -1)
    if lp.numel() != lq.numel():
        raise SettingsError(f"The two distributions have different vocabularies ({lp.numel():,} vs {lq.numel():,} "
                            "tokens); KL needs the same tokens on both sides.")
    p, q = lp.exp(), lq.exp()
    kl_pq = float((p * (lp - lq)).nan_to_num(0.0).sum())
    kl_qp = float((q * (lq - lp)).nan_to_num(0.0).sum())
    h_p = float(-(p * lp).nan_to_num(0.0).sum())
    ce_pq = float(-(p * lq).nan_to_num(0.0).sum())
    terms = (p * (lp - lq)).nan_to_num(0.0)
    top = torch.topk(terms.abs() + 1e-12 * p, 10).indices  # P = Q: every term is 0, show P's likeliest tokens
    return {"kl_pq": kl_pq, "kl_qp": kl_qp, "h_p": h_p, "h_q": float(-(q * lq).nan_to_num(0.0).sum()),
            "ce_pq": ce_pq,
            "torch_kl_pq": float(F.kl_div(lq, lp, log_target=True, reduction="sum")),
            "torch_kl_qp": float(F.kl_div(lp, lq, log_target=True, reduction="sum")),
            "top": [{"id": int(i), "p": float(p[i]), "q": float(q[i]), "term": float(terms[i])} for i in top]}


def check_temperature(t) -> float:
    try:
        f = float(t)
    except (TypeError, ValueError):
        raise SettingsError(f"The temperature must be a number, got {t!r}.") from None
    if isinstance(t, bool) or not math.isfinite(f) or not 0.05 <= f <= 10:
        raise SettingsError(f"The temperature must be between 0.05 and 10, got {t!r}.")
    return f


def next_logits(lm, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(input_ids=torch.tensor([ids], device=lm.device), use_cache=False,
                        logits_to_keep=1).logits[0, -1].float()


def compare_distributions(lm, ids: list[int], temperature: float = 2.0, other=None) -> dict:
    """P = the model's next-token distribution at temperature 1; Q = the same logits / temperature,
    or (other given) another loaded model's distribution after the same tokens."""
    p_logits = next_logits(lm, ids)
    if other is None:
        t = check_temperature(temperature)
        q_logits, q_name = p_logits / t, f"{lm.name} at temperature {t:g}"
    else:
        q_logits, q_name = next_logits(other, ids), f"{other.name} at temperature 1"
    out = kl_divergence(p_logits, q_logits)
    out.update(p_name=f"{lm.name} at temperature 1", q_name=q_name,
               p_entropy=entropy_of(p_logits), q_entropy=entropy_of(q_logits))
    return out


def mfu(n_params: float, tokens_per_s: float, peak_flops: float, mode: str = "training") -> dict:
    """MFU = k N tokens/s / peak, k = 6 (training) or 2 (inference, forward only)."""
    for name, v in (("parameters", n_params), ("tokens/s", tokens_per_s), ("peak FLOP/s", peak_flops)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise SettingsError(f"The {name} must be a positive number, got {v!r}.")
    if mode not in ("training", "inference"):
        raise SettingsError(f"The mode must be training or inference, got {mode!r}.")
    k = 6 if mode == "training" else 2
    achieved = k * float(n_params) * float(tokens_per_s)
    return {"mode": mode, "k": k, "flops_per_token": k * float(n_params), "achieved_flops": achieved,
            "peak_flops": float(peak_flops), "mfu": achieved / float(peak_flops), "n_params": float(n_params),
            "tokens_per_s": float(tokens_per_s)}


def job_throughputs(records: list[dict]) -> list[dict]:
    """Measured training tokens/s of finished or running jobs (SFT and others that record metrics):
    [{job, label, tokens_per_s, n_params}] where N = training_flops / (6 tokens_seen) as the job
    recorded it."""
    out = []
    for rec in records:
        kind = rec.get("kind")
        body = rec.get(kind) if isinstance(rec.get(kind), dict) else {}
        m = body.get("metrics") or {}
        hist = body.get("history") or []
        tps = m.get("tokens_per_s") or next((h.get("tokens_per_s") for h in reversed(hist) if h.get("tokens_per_s")),
                                            None)
        if not tps:
            continue
        n = None
        if m.get("training_flops") and m.get("tokens_seen"):
            n = float(m["training_flops"]) / (6 * float(m["tokens_seen"]))
        out.append({"job": rec.get("id"), "label": f"{kind} job {str(rec.get('id'))[:8]} "
                    f"({(rec.get('params') or {}).get('model', '?')}, {rec.get('state', '')}): {float(tps):,.0f} tokens/s",
                    "tokens_per_s": float(tps), "n_params": n, "model": (rec.get("params") or {}).get("model")})
    return out
