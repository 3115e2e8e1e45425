"""A crosscoder between a model and its fine-tuned version: one sparse dictionary read from and
written to both models' activations at one hook point (default resid_post), trained on the same
windows of text, so each latent says by its decoder norms whether it is shared, base-only or
tuned-only (model diffing as in Anthropic's "Sparse Crosscoders", 2024).

The crosscoder is acausal and ReLU + L1 (not BatchTopK), dictionary_learning's CrossCoder: for the
two activations a_m at one position (m = base, tuned; each scaled by a constant so its mean norm on
the first batch is 1), f = ReLU(sum_m W_enc[m] a_m + b_enc), a_hat_m = f W_dec[:, m] + b_dec[m],
loss = sum_m ||a_m - a_hat_m||^2 + l1_coeff * sum_j f_j sum_m ||W_dec[j, m]|| (both averaged over
positions; the L1 weight ramps up over the first 5 % of steps, as Anthropic's). The L1 on the *sum*
of decoder norms is what lets a latent drop one model's decoder to zero.

Per latent, r = ||d_tuned|| / (||d_base|| + ||d_tuned||): base-only under 0.1, tuned-only over 0.9,
shared between; a latent that never fires on the held-out windows is dead and in no class. The
result holds the counts, a histogram of r, each model's fraction of variance explained on held-out
windows, and each class's most used latents with their top-activating contexts.

Written in torch here rather than taken from a library: saprmarks' dictionary-learning (the
CrossCoder class) is on PyPI only as 0.1.0, which has no CrossCoder and requires nnsight<0.4,
wandb and umap-learn; `pip install --dry-run dictionary-learning` into this project's venv would
also replace torch 2.13 (cpu) with torch 2.14.1 and the CUDA 13 wheels.

Activations come through lmscope's own hooks (features_sae.capture: each forward stops at the hook
point), one batch of windows of both models in memory at a time; position 0 of each window (the
attention sink) is left out of training and evaluation. The two models must share the tokenizer
(model_diff.shared_vocabulary: a tuned tokenizer that only added tokens is fine, the windows are
the base's) and the width.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from model_core.core.errors import SettingsError
from model_core.interp.features_corpus import DEFAULT_EVAL_TOKENS, dataset_texts, eval_windows, window_batches
from model_core.interp.features_sae import (
    DEFAULT_BATCH,
    DEFAULT_CONTEXT,
    ActivationBuffer,
    FeatureError,
    HookPoint,
    capture,
    hook_point,
)

log = logging.getLogger(__name__)

FORMAT = "lmscope-crosscoder"
MODELS = ("base", "tuned")
BASE_ONLY, TUNED_ONLY = 0.1, 0.9  # r below / above: one model's latent
DEFAULT_TOKENS = 65_536
DEFAULT_L1 = 0.05  # on activations of mean norm 1 (Anthropic's 2 at mean norm sqrt(2304) is ~0.04)
DEFAULT_LR = 1e-3
L1_WARMUP = 0.05  # share of the steps over which the L1 weight ramps up from 0
DEC_INIT_NORM = 0.08
HIST_BINS = 20
TOP_LATENTS = 5  # per class
TOP_CONTEXTS = 5  # per latent
CONTEXT_TOKENS = 8  # tokens of text shown up to and including the activating one
WEIGHTS, CFG = "crosscoder.safetensors", "cfg.json"

ProgressFn = Callable[[int, int, dict], None]


class CrosscoderError(SettingsError):
    """A pair of models, a hook or a setting a crosscoder cannot use: one sentence."""


class CrosscoderCancelled(Exception):
    """should_stop() asked the run to stop; nothing was returned or saved."""


class CrossCoder(torch.nn.Module):
    """W_enc [n_models, d, F], b_enc [F], W_dec [F, n_models, d], b_dec [n_models, d]; `scales`
    [n_models]: what each model's raw activation is multiplied by before encoding."""

    def __init__(self, d: int, num_latents: int, n_models: int = 2, seed: int = 0, device="cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(int(seed))
        w = torch.randn(num_latents, n_models, d, generator=g)  # [F, M, d]
        w = w / w.norm(dim=-1, keepdim=True) * DEC_INIT_NORM  # every (latent, model) decoder at the same norm
        self.W_dec = torch.nn.Parameter(w.to(device))
        self.W_enc = torch.nn.Parameter(w.permute(1, 2, 0).contiguous().to(device))  # [M, d, F] = W_dec^T
        self.b_enc = torch.nn.Parameter(torch.zeros(num_latents, device=device))
        self.b_dec = torch.nn.Parameter(torch.zeros(n_models, d, device=device))
        self.register_buffer("scales", torch.ones(n_models, device=device))

    @property
    def num_latents(self) -> int:
        return int(self.b_enc.shape[0])

    @property
    def d(self) -> int:
        return int(self.b_dec.shape[1])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, M, d] (scaled) -> f [N, F]."""
        return torch.relu(torch.einsum("nmd,mdf->nf", x, self.W_enc) + self.b_enc)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """f [N, F] -> [N, M, d] (scaled)."""
        return torch.einsum("nf,fmd->nmd", f, self.W_dec) + self.b_dec

    def decoder_norms(self) -> torch.Tensor:
        """[F, M] the norm of each latent's decoder vector in each model."""
        return self.W_dec.norm(dim=-1)

    def losses(self, x: torch.Tensor) -> dict:
        """x [N, M, d] (scaled) -> {mse [N] summed over models, l1 [N], f [N, F], x_hat [N, M, d]}."""
        f = self.encode(x)
        x_hat = self.decode(f)
        mse = (x - x_hat).pow(2).sum(-1).sum(-1)  # [N]
        l1 = (f * self.decoder_norms().sum(-1)).sum(-1)  # [N]
        return {"mse": mse, "l1": l1, "f": f, "x_hat": x_hat}


def relative_norms(cc: CrossCoder) -> torch.Tensor:
    """[F] r = ||d_tuned|| / (||d_base|| + ||d_tuned||) (0.5 where both are 0)."""
    with torch.no_grad():
        n = cc.decoder_norms().float().cpu()  # [F, 2]
        total = n.sum(-1)
        return torch.where(total > 0, n[:, 1] / total.clamp_min(1e-30), torch.full_like(total, 0.5))


def classify(r: torch.Tensor) -> torch.Tensor:
    """[F] 0 base-only, 1 shared, 2 tuned-only."""
    return (r >= BASE_ONLY).long() + (r > TUNED_ONLY).long()


CLASSES = ("base_only", "shared", "tuned_only")


def check_pair(base, tuned, layer, hook: str = "resid_post") -> tuple[HookPoint, HookPoint, str]:
    """The hook point in each model and model_diff's vocabulary note; one sentence when the models
    differ in width, tokenizer or depth, or the hook cannot be read."""
    from model_core.interp.model_diff import _check_pair

    if base.shape.d_model != tuned.shape.d_model:
        raise CrosscoderError(f"{base.name} has width {base.shape.d_model} and {tuned.name} "
                              f"{tuned.shape.d_model}; a crosscoder pairs a fine-tuned model with its parent.")
    _, note = _check_pair(base, tuned)
    if hook == "resid_post" and layer == base.shape.n_layers - 1:
        raise CrosscoderError(f"resid_post of the last layer ({layer}) has no hook point to "
                              f"read it at; use resid_pre, attn_out or mlp_out of layer {layer}, or an earlier layer.")
    try:
        return hook_point(base, layer, hook), hook_point(tuned, layer, hook), note
    except FeatureError as e:
        raise CrosscoderError(str(e)) from None


def paired_activations(base, tuned, hps: tuple[HookPoint, HookPoint], ids: torch.Tensor, device=None,
                       bufs: list[ActivationBuffer] | None = None) -> torch.Tensor:
    """ids [B, T] -> [B * (T - 1), 2, d] float32: both models' raw activations at the hook point,
    position 0 of each window left out (each capture counted by its model's buffer when given)."""
    out = []
    for m, (lm, hp) in enumerate(zip((base, tuned), hps)):
        a = capture(lm, hp, ids)  # [B, T, d]
        if bufs is not None:
            bufs[m].hold(a)
        out.append(a[:, 1:].reshape(-1, a.shape[-1]).to(device or base.device, torch.float32))
    return torch.stack(out, dim=1)  # [rows, 2, d]


@dataclass
class CrosscoderResult:
    base: str
    tuned: str
    layer: int
    hook: str
    hook_name: str
    d: int
    num_latents: int
    settings: dict
    tokens: int  # training tokens (corpus windows, position 0 included)
    steps: int
    counts: dict  # {base_only, shared, tuned_only}: live latents per class
    dead: int  # latents that never fired on the held-out windows
    histogram: dict  # {edges [HIST_BINS + 1], counts [HIST_BINS]}: r of the live latents
    fve: dict  # {base, tuned}: fraction of variance explained on held-out windows
    eval_tokens: int  # held-out positions scored
    top: dict  # {class: [{latent, r, norm_base, norm_tuned, cosine, frequency, mass, contexts}]}
    r: list[float]  # [F] per latent
    history: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    vocabulary: str = "same"
    seconds: float = 0.0
    library: str = "torch (model_core.interp.crosscoder)"

    def to_dict(self) -> dict:
        return asdict(self)


def _scales(x: torch.Tensor) -> torch.Tensor:
    """x [N, M, d] raw -> [M] the factor that brings each model's mean activation norm to 1."""
    return 1.0 / x.norm(dim=-1).mean(0).clamp_min(1e-12)


def train_crosscoder(base, tuned, layer: int, hook: str = "resid_post", dataset="builtin",
                     max_tokens: int = DEFAULT_TOKENS, *, expansion_factor: int = 8, num_latents: int = 0,
                     l1_coeff: float = DEFAULT_L1, lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH,
                     context: int = DEFAULT_CONTEXT, seed: int = 0, eval_tokens: int = DEFAULT_EVAL_TOKENS,
                     top_latents: int = TOP_LATENTS, top_contexts: int = TOP_CONTEXTS,
                     progress: ProgressFn | None = None,
                     should_stop: Callable[[], bool] | None = None) -> tuple[CrossCoder, CrosscoderResult]:
    """Train a crosscoder on `hook` of `layer` of base and tuned (LoadedModels) over max_tokens of the
    corpus ('builtin' or a list of texts; train split, documents in a seeded order, streamed), then
    score it on the held-out split. progress(step, total_steps, {loss, mse, l1, l0, fvu_base,
    fvu_tuned, tokens, phase 'training'}) after each step, then phase 'evaluating';
    should_stop() is polled between batches (CrosscoderCancelled)."""
    stop = should_stop or (lambda: False)
    hps = check_pair(base, tuned, layer, hook)
    hp_b, hp_t, note = hps
    d = base.shape.d_model
    F = int(num_latents) or int(expansion_factor) * d
    if F < 1 or batch_size < 1 or context < 8 or max_tokens < 2 * context:
        raise CrosscoderError(f"A crosscoder needs at least one latent, a batch, windows of 8 tokens or more "
                              f"and two windows of tokens; got {F} latents, batch {batch_size}, "
                              f"context {context}, {max_tokens} tokens.")
    if not (l1_coeff >= 0 and 0 < lr <= 1):
        raise CrosscoderError("'l1_coeff' must be 0 or more and 'lr' above 0 and at most 1.")
    dev = base.device
    torch.manual_seed(int(seed))
    cc = CrossCoder(d, F, seed=seed, device=dev)
    opt = torch.optim.Adam(cc.parameters(), lr=lr, betas=(0.9, 0.999))
    bufs = [ActivationBuffer(batch_size, context, d) for _ in MODELS]
    total = max(1, -(-(int(max_tokens) // context) // batch_size))
    warm = max(1, int(L1_WARMUP * total))
    every = max(1, total // 500)  # history rows kept
    texts = dataset_texts(dataset, "train")
    random.Random(seed).shuffle(texts)
    log.info("crosscoder: %d latents on %s of %s and %s", F, hp_b.name, base.name, tuned.name)
    t0 = time.time()
    step = tokens = 0
    history: list[dict] = []
    for ids in window_batches(base.tokenizer, texts, max_tokens, context, batch_size):
        if stop():
            raise CrosscoderCancelled()
        # [rows, 2, d]; a copy outside inference mode, for autograd
        x = paired_activations(base, tuned, (hp_b, hp_t), ids, dev, bufs).clone()
        tokens += ids.numel()
        if step == 0:
            with torch.no_grad():
                cc.scales.copy_(_scales(x))
        x = x * cc.scales[None, :, None]
        out = cc.losses(x)
        lam = l1_coeff * min(1.0, (step + 1) / warm)
        loss = out["mse"].mean() + lam * out["l1"].mean()
        if not torch.isfinite(loss.detach()):
            raise CrosscoderError(f"The loss became {float(loss.detach())} at step {step + 1}; try a smaller "
                                  f"learning rate.")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(cc.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        with torch.no_grad():
            err = (x - out["x_hat"]).pow(2).sum(-1).sum(0)  # [2]
            var = (x - x.mean(0)).pow(2).sum(-1).sum(0).clamp_min(1e-12)  # [2]
            fvu = (err / var).tolist()
            row = {"step": step, "tokens": tokens, "loss": round(float(loss.detach()), 6),
                   "mse": round(float(out["mse"].mean()), 6), "l1": round(float(out["l1"].mean()), 6),
                   "l0": round(float((out["f"] > 0).float().sum(-1).mean()), 3),
                   "fvu_base": round(fvu[0], 6), "fvu_tuned": round(fvu[1], 6)}
        if step % every == 0 or step == total:
            history.append(row)
        if progress is not None:
            progress(step, max(total, step), {**row, "phase": "training"})
        del x, out, loss
    if step == 0:
        raise CrosscoderError(f"The corpus has fewer than {context} tokens; nothing to train on.")
    cc.requires_grad_(False)
    if stop():
        raise CrosscoderCancelled()
    if progress is not None:
        progress(step, step, {"phase": "evaluating"})
    windows = eval_windows(base.tokenizer, dataset, max(int(eval_tokens), context), context)
    ev = evaluate(cc, base, tuned, (hp_b, hp_t), windows, batch_size=batch_size, top_latents=top_latents,
                  top_contexts=top_contexts, should_stop=stop)
    settings = {"expansion_factor": expansion_factor, "num_latents": F, "l1_coeff": l1_coeff, "lr": lr,
                "batch_size": batch_size, "context": context, "seed": seed, "max_tokens": max_tokens,
                "eval_tokens": eval_tokens, "dataset": dataset if isinstance(dataset, str) else "texts",
                "l1_warmup_steps": warm, "activation": "relu", "scales": cc.scales.tolist()}
    mem = bufs[0].describe()
    mem["statement"] = (f"at most {mem['limit_rows']} activations (batch x context) of width {d} per model "
                        f"in memory at once ({2 * mem['limit_mb']:.1f} MB as float32 for both)")
    res = CrosscoderResult(
        base=base.name, tuned=tuned.name, layer=hp_b.layer, hook=hp_b.kind, hook_name=hp_b.name, d=d,
        num_latents=F, settings=settings, tokens=tokens, steps=step, history=history, memory=mem,
        vocabulary=note, seconds=round(time.time() - t0, 2), **ev)
    return cc, res


def evaluate(cc: CrossCoder, base, tuned, hps, windows: torch.Tensor, batch_size: int = DEFAULT_BATCH,
             top_latents: int = TOP_LATENTS, top_contexts: int = TOP_CONTEXTS,
             should_stop: Callable[[], bool] | None = None) -> dict:
    """windows [N, T] held-out token ids -> the result's counts, dead, histogram, fve, eval_tokens,
    top and r (CrosscoderResult's fields)."""
    stop = should_stop or (lambda: False)
    N, T = windows.shape
    F, dev = cc.num_latents, cc.b_enc.device
    sse = torch.zeros(2, dtype=torch.float64)
    s1 = torch.zeros(2, cc.d, dtype=torch.float64)
    s2 = torch.zeros(2, dtype=torch.float64)
    fired = torch.zeros(F, dtype=torch.long)
    mass = torch.zeros(F, dtype=torch.float64)
    k = max(1, int(top_contexts))
    best_v = torch.full((F, k), -1.0)  # [F, k] top activations
    best_i = torch.zeros((F, k), dtype=torch.long)  # [F, k] their window * T + position
    norms = cc.decoder_norms().detach().float()  # [F, 2]
    rows = 0
    with torch.no_grad():
        for w0 in range(0, N, batch_size):
            if stop():
                raise CrosscoderCancelled()
            ids = windows[w0: w0 + batch_size]
            x = paired_activations(base, tuned, hps, ids, dev) * cc.scales[None, :, None]  # [rows, 2, d]
            f = cc.encode(x)  # [rows, F]
            x_hat = cc.decode(f)
            sse += (x - x_hat).double().pow(2).sum((0, 2)).cpu()
            s1 += x.double().sum(0).cpu()
            s2 += x.double().pow(2).sum((0, 2)).cpu()
            rows += x.shape[0]
            fc = f.float().cpu()
            fired += (fc > 0).sum(0)
            mass += (fc * norms.sum(-1).cpu()).double().sum(0)
            b = ids.shape[0]
            pos = (torch.arange(w0, w0 + b)[:, None] * T + torch.arange(1, T)[None, :]).reshape(-1)  # [rows]
            kk = min(k, fc.shape[0])
            v, i = fc.topk(kk, dim=0)  # [kk, F]
            cand_v = torch.cat([best_v, v.T], dim=1)  # [F, k + kk]
            cand_i = torch.cat([best_i, pos[i].T], dim=1)
            best_v, j = cand_v.topk(k, dim=1)
            best_i = cand_i.gather(1, j)
    var = (s2 - s1.pow(2).sum(-1) / max(rows, 1)).clamp_min(1e-30)  # [2] sum of squared deviations
    fve = (1.0 - sse / var).tolist()
    r = relative_norms(cc)
    live = fired > 0
    cls = classify(r)
    counts = {c: int(((cls == i) & live).sum()) for i, c in enumerate(CLASSES)}
    hist = torch.histc(r[live], bins=HIST_BINS, min=0.0, max=1.0) if live.any() else torch.zeros(HIST_BINS)
    n = norms.cpu()
    cos = torch.nn.functional.cosine_similarity(cc.W_dec[:, 0].detach().float(), cc.W_dec[:, 1].detach().float(), dim=-1).cpu()
    flat = windows.reshape(-1)
    top: dict[str, list[dict]] = {}
    for i, c in enumerate(CLASSES):
        idx = ((cls == i) & live).nonzero().flatten()
        order = idx[mass[idx].argsort(descending=True)][: int(top_latents)]
        top[c] = [{"latent": int(j), "r": round(float(r[j]), 4), "norm_base": round(float(n[j, 0]), 5),
                   "norm_tuned": round(float(n[j, 1]), 5), "cosine": round(float(cos[j]), 4),
                   "frequency": round(float(fired[j]) / max(rows, 1), 6), "mass": round(float(mass[j]), 4),
                   "contexts": [_context(base, flat, int(p), T, float(v))
                                for v, p in zip(best_v[j].tolist(), best_i[j].tolist()) if v > 0]}
                  for j in order.tolist()]
    return {"counts": counts, "dead": int((~live).sum()),
            "histogram": {"edges": [round(e / HIST_BINS, 4) for e in range(HIST_BINS + 1)],
                          "counts": [int(v) for v in hist.tolist()]},
            "fve": {"base": fve[0], "tuned": fve[1]}, "eval_tokens": rows, "top": top,
            "r": [round(float(v), 4) for v in r.tolist()]}


def _context(lm, flat: torch.Tensor, p: int, T: int, activation: float) -> dict:
    """One top-activating position p (window * T + position): the text up to it and its token."""
    from model_core.interp.model_diff import _display

    start = max(p - p % T + 1, p - CONTEXT_TOKENS + 1)  # within the window, never position 0
    return {"text": lm.tokenizer.decode(flat[start: p + 1].tolist()), "token": _display(lm, int(flat[p])),
            "activation": round(activation, 4), "window": p // T, "position": p % T}


# ---- saved crosscoders: <folder>/crosscoder.safetensors + cfg.json --------------------------

def save(cc: CrossCoder, folder: Path, cfg: dict) -> Path:
    """Write the weights (safetensors) and cfg.json (cfg plus d, num_latents and format) to folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in cc.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": FORMAT})
    full = {**cfg, "format": FORMAT, "d": cc.d, "num_latents": cc.num_latents, "models": list(MODELS)}
    (folder / CFG).write_text(json.dumps(full, ensure_ascii=False, indent=1), encoding="utf-8")
    return folder


def load(folder: Path, device="cpu") -> tuple[CrossCoder, dict]:
    """(crosscoder, cfg) from a folder written by save."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        cfg = json.loads((folder / CFG).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / WEIGHTS), device=str(device))
    except (OSError, ValueError) as e:
        raise CrosscoderError(f"No crosscoder could be read from {folder} ({e}).") from None
    if cfg.get("format") != FORMAT:
        raise CrosscoderError(f"{folder} does not hold a crosscoder (format {cfg.get('format')!r}).")
    cc = CrossCoder(int(cfg["d"]), int(cfg["num_latents"]), n_models=len(cfg.get("models", MODELS)), device=device)
    cc.load_state_dict(tensors)
    cc.requires_grad_(False)
    return cc, cfg
