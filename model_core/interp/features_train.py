"""Training a TopK sparse autoencoder on one hook point's activations, streamed through lmscope's
own hooks (each forward stops at the hook point), then evaluating it, scanning its top contexts,
labelling every feature and saving the set (staged, renamed when complete).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model_core.core import checkpoints
from model_core.interp.features_corpus import (
    BUILTIN_VERSION,
    DEFAULT_EVAL_TOKENS,
    dataset_texts,
    eval_windows,
    window_batches,
)
from model_core.interp.features_quality import evaluate
from model_core.interp.features_reading import context_index, label_all
from model_core.interp.features_sae import (
    DEFAULT_BATCH,
    DEFAULT_CONTEXT,
    FORMAT,
    ActivationBuffer,
    FeatureError,
    Features,
    FeaturesCancelled,
    capture,
    hook_point,
    import_sparsify,
    new_sae,
)
from model_core.interp.features_store import features_dir

OPTIMIZERS = ("adam", "signum")
DEFAULT_TOKENS = 100_000
MAX_TOKENS = 50_000_000
DEFAULT_CONTEXT_TOKENS = 16_384  # tokens scanned for every feature's top contexts

ProgressFn = Callable[[int, int, dict], None]


@dataclass(frozen=True)
class FeatureSettings:
    model: str
    layer: int
    hook: str = "resid_post"
    dataset: str = "builtin"
    max_tokens: int = DEFAULT_TOKENS
    expansion_factor: int = 8
    num_latents: int = 0  # 0: expansion_factor x d_model
    k: int = 32
    batch_size: int = DEFAULT_BATCH  # windows per forward pass (= per optimiser step)
    context: int = DEFAULT_CONTEXT
    lr: float | None = None  # None: 1e-3 for Adam; sparsify's rule for sign-SGD, 5e-3 / sqrt(latents / 2^14)
    auxk_alpha: float = 1 / 32  # weight of the AuxK loss that revives dead latents (0: off)
    optimizer: str = "adam"  # or "signum" (sparsify's own default, for large batches)
    dead_tokens: int = 0  # a latent silent for this many training tokens is dead (0: a tenth of max_tokens)
    seed: int = 0
    eval_tokens: int = DEFAULT_EVAL_TOKENS
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    name: str | None = None


def _int(v, key: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or not lo <= int(v) <= hi:
        raise FeatureError(f"'{key}' must be a whole number from {lo:,} to {hi:,}.")
    return int(v)


def validate_settings(s: FeatureSettings, d_model: int | None = None) -> FeatureSettings:
    """The same settings with each number checked (FeatureError, one sentence, for the first bad one)."""
    vals = {}
    vals["max_tokens"] = _int(s.max_tokens, "max_tokens", 256, MAX_TOKENS)
    vals["expansion_factor"] = _int(s.expansion_factor, "expansion_factor", 1, 256)
    vals["num_latents"] = _int(s.num_latents, "num_latents", 0, 1 << 20)
    vals["batch_size"] = _int(s.batch_size, "batch_size", 1, 1024)
    vals["context"] = _int(s.context, "context", 8, 8192)
    vals["seed"] = _int(s.seed, "seed", 0, 2**31 - 1)
    vals["eval_tokens"] = _int(s.eval_tokens, "eval_tokens", 0, 1 << 22)
    vals["context_tokens"] = _int(s.context_tokens, "context_tokens", 0, 1 << 22)
    vals["dead_tokens"] = _int(s.dead_tokens, "dead_tokens", 0, MAX_TOKENS)
    latents = vals["num_latents"] or vals["expansion_factor"] * (d_model or 1)
    vals["k"] = _int(s.k, "k", 1, max(1, latents if d_model else 4096))
    if s.lr is not None:
        if isinstance(s.lr, bool) or not isinstance(s.lr, (int, float)) or not math.isfinite(s.lr) \
                or not 0 < s.lr <= 1:
            raise FeatureError("'lr' must be a number above 0 and at most 1.")
    if isinstance(s.auxk_alpha, bool) or not isinstance(s.auxk_alpha, (int, float)) \
            or not math.isfinite(s.auxk_alpha) or not 0 <= s.auxk_alpha <= 10:
        raise FeatureError("'auxk_alpha' must be a number from 0 to 10.")
    if s.optimizer not in OPTIMIZERS:
        raise FeatureError(f"'optimizer' must be one of: {', '.join(OPTIMIZERS)}.")
    if s.dataset not in ("builtin", "texts"):
        raise FeatureError("The dataset must be 'builtin' (the standard library's docstrings).")
    if s.name is not None and not checkpoints.valid_output_name(s.name):
        raise FeatureError("A feature set's name is 1-100 letters, digits, '.', '_' or '-', starting with a "
                           "letter or digit.")
    if vals["max_tokens"] < vals["context"] * 2:
        raise FeatureError(f"'max_tokens' ({vals['max_tokens']}) must be at least two windows "
                           f"of {vals['context']} tokens.")
    return FeatureSettings(**{**s.__dict__, **vals})



def default_name(s: FeatureSettings, latents: int) -> str:
    base = f"{s.model}-L{s.layer}-{s.hook}-{latents}x{s.k}"[:90]
    name, i = base, 2
    while (features_dir() / name).exists():
        name, i = f"{base}-{i}", i + 1
    return name


@dataclass
class FeatureRun:
    features: Features
    path: Path  # the saved folder
    record: dict  # features.json
    buffer: ActivationBuffer


def train_features(model_name: str | None = None, layer: int = 6, hook: str = "resid_post", dataset="builtin",
                   max_tokens: int = DEFAULT_TOKENS, *, expansion_factor: int = 8, num_latents: int = 0, k: int = 32,
                   batch_size: int = DEFAULT_BATCH, context: int = DEFAULT_CONTEXT, lr: float | None = None,
                   auxk_alpha: float = 1 / 32, optimizer: str = "adam", dead_tokens: int = 0, seed: int = 0,
                   eval_tokens: int = DEFAULT_EVAL_TOKENS, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                   name: str | None = None, device: str | None = None, progress: ProgressFn | None = None,
                   should_stop: Callable[[], bool] | None = None, save: bool = True,
                   log: Callable[[str], None] | None = None) -> FeatureRun:
    """Train a TopK autoencoder on `hook` of `layer` over max_tokens of the corpus (streamed), evaluate
    it on held-out windows, scan top contexts and label every feature, save it under
    <data dir>/features/<name>/. progress(step, total_steps, {loss, fvu, auxk, dead_share, tokens,
    tokens_per_s, phase}) after each step (phase 'training'), then phases 'evaluating', 'contexts',
    'saving'. should_stop() is polled between steps (FeaturesCancelled; nothing saved)."""
    from model_core import load_model
    from model_core.core.registry import DEFAULT_MODEL

    say = log or (lambda _m: None)
    stop = should_stop or (lambda: False)
    lm = load_model(model_name or DEFAULT_MODEL, device=device, allow_hub=False)
    s = validate_settings(FeatureSettings(
        model=lm.name, layer=layer, hook=hook, dataset=dataset if isinstance(dataset, str) else "texts",
        max_tokens=max_tokens, expansion_factor=expansion_factor, num_latents=num_latents, k=k,
        batch_size=batch_size, context=context, lr=lr, auxk_alpha=auxk_alpha, optimizer=optimizer,
        dead_tokens=dead_tokens, seed=seed,
        eval_tokens=eval_tokens, context_tokens=context_tokens, name=name), lm.shape.d_model)
    hp = hook_point(lm, s.layer, s.hook)
    d = lm.shape.d_model
    sp = import_sparsify()
    from schedulefree import ScheduleFreeWrapper
    from sparsify.sign_sgd import SignSGD

    sae = new_sae(d, expansion_factor=s.expansion_factor, num_latents=s.num_latents, k=s.k, seed=s.seed,
                  device=lm.device)
    M = sae.num_latents
    if s.optimizer == "signum":
        lr_used = s.lr or 5e-3 / (M / 2**14) ** 0.5
        opt = ScheduleFreeWrapper(SignSGD([{"params": sae.parameters(), "lr": lr_used}]), momentum=0.95)
        opt.train()
    else:
        lr_used = s.lr or 1e-3
        opt = torch.optim.Adam(sae.parameters(), lr=lr_used)
    buf = ActivationBuffer(s.batch_size, s.context, d)
    dead_after = s.dead_tokens or max(s.batch_size * (s.context - 1), s.max_tokens // 10)
    since_fired = torch.zeros(M, dtype=torch.long, device=lm.device)
    total_steps = max(1, -(-(s.max_tokens // s.context) // s.batch_size))
    history: list[dict] = []
    # documents in a seeded random order: the corpus is sorted by file, and a run that meets one module's
    # docstrings after another drifts towards the latest (held-out FVU 0.19 after 60k tokens, 0.28
    # after 100k in file order, layer 6 of SmolLM2)
    texts = dataset_texts(dataset, "train")
    random.Random(s.seed).shuffle(texts)
    say(f"training {M} features (k={s.k}) on {hp.name} of {lm.name}: {buf.describe()['statement']}")
    t0 = time.time()
    tokens = corpus_tokens = 0
    step = 0
    forward_s = 0.0
    for ids in window_batches(lm.tokenizer, texts, s.max_tokens, s.context, s.batch_size):
        if stop():
            raise FeaturesCancelled()
        tf = time.time()
        acts = buf.hold(capture(lm, hp, ids))  # [B, T, d]
        forward_s += time.time() - tf
        # position 0 (the attention sink) left out; a copy outside inference mode, for autograd
        x = acts[:, 1:].reshape(-1, d).to(sae.device, torch.float32).clone()
        corpus_tokens += acts.shape[0] * acts.shape[1]
        del acts
        if step == 0:
            with torch.no_grad():
                sae.b_dec.data = x.mean(0).to(sae.b_dec.dtype)
        sae.set_decoder_norm_to_unit_norm()
        dead = since_fired > dead_after
        out = sae(x, dead_mask=dead if s.auxk_alpha > 0 else None)
        loss = out.fvu + s.auxk_alpha * out.auxk_loss
        if not torch.isfinite(loss.detach()):
            raise FeatureError(f"The loss became {float(loss.detach())} at step {step + 1}; try a smaller "
                               f"learning rate.")
        loss.backward()
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            fired = torch.zeros(M, dtype=torch.bool, device=since_fired.device)
            fired[out.latent_indices.flatten()] = True
            since_fired += x.shape[0]
            since_fired[fired] = 0
        tokens += x.shape[0]
        step += 1
        el = time.time() - t0
        row = {"step": step, "tokens": corpus_tokens, "activations": tokens, "loss": round(float(loss.detach()), 6),
               "fvu": round(float(out.fvu.detach()), 6), "auxk": round(float(out.auxk_loss.detach()), 6),
               "dead_share": round(float(dead.float().mean()), 6),
               "tokens_per_s": round(corpus_tokens / max(el, 1e-9), 1)}
        history.append(row)
        if progress is not None:
            progress(step, max(total_steps, step), {**row, "phase": "training"})
        del x, out, loss
    if step == 0:
        raise FeatureError(f"The corpus has fewer than {s.context} tokens; nothing to train on.")
    train_s = time.time() - t0
    if hasattr(opt, "eval"):
        opt.eval()  # schedule-free: the averaged weights are the ones to use
    sae.set_decoder_norm_to_unit_norm()
    sae.requires_grad_(False)
    feats = Features(sae=sae, model=lm.name, layer=s.layer, hook=s.hook)

    if stop():
        raise FeaturesCancelled()
    if progress is not None:
        progress(step, step, {"phase": "evaluating"})
    quality = evaluate(lm, feats, eval_windows(lm.tokenizer, dataset, s.eval_tokens, s.context)
                       if s.eval_tokens >= s.context else None, batch_size=s.batch_size, should_stop=stop) \
        if s.eval_tokens >= s.context else None
    say("evaluated: " + (f"explained {quality['explained']:.3f}, CE recovered {quality['ce_recovered']:.3f}"
                         if quality else "skipped"))

    index = None
    labels: list[dict] = []
    if s.context_tokens >= s.context:
        if progress is not None:
            progress(step, step, {"phase": "contexts"})
        windows = torch.cat(list(window_batches(lm.tokenizer, texts, s.context_tokens, s.context, 1 << 30)))
        index = context_index(lm, feats, windows, batch_size=s.batch_size, should_stop=stop)
        labels = label_all(lm, feats, index)
    if stop():
        raise FeaturesCancelled()

    record = {
        "format": FORMAT, "model": lm.name, "layer": s.layer, "hook": s.hook, "hook_name": hp.name,
        "edit_point": hp.edit_name, "d_in": d, "num_latents": M, "k": s.k, "dataset": s.dataset,
        "corpus": BUILTIN_VERSION if s.dataset == "builtin" else "texts",
        "settings": {**s.__dict__, "lr": lr_used, "dead_tokens": dead_after},
        "library": f"eai-sparsify {getattr(sp, '__version__', '?')} (SparseCoder; optimiser {s.optimizer})",
        "memory": buf.describe(), "steps": step, "tokens": corpus_tokens, "activations": tokens,
        "train_seconds": round(train_s, 2), "forward_seconds": round(forward_s, 2), "tokens_per_s": round(corpus_tokens / max(train_s, 1e-9), 1),
        "device": str(lm.device),
        "dead_share": round(float((since_fired > dead_after).float().mean()), 6),
        "history": history, "quality": quality, "created": time.time(),
        "order": f"training documents shuffled with seed {s.seed}",
        "skipped": "position 0 of each window (attention sink): not trained on, not scored, never spliced",
    }
    feats.record = record
    if not save:
        return FeatureRun(feats, Path(), record, buf)
    if progress is not None:
        progress(step, step, {"phase": "saving"})
    out_name = s.name or default_name(s, M)
    dest = features_dir() / out_name
    if dest.exists():
        raise FeatureError(f"A feature set named '{out_name}' already exists; choose another name.")
    record["name"] = out_name
    checkpoints.sweep_staging("features")
    stage = checkpoints.staging_dir(out_name, "features")
    try:
        sae.save_to_disk(stage)
        if index is not None:
            index.save(stage / "contexts.safetensors")
            (stage / "labels.json").write_text(json.dumps(labels, ensure_ascii=False), encoding="utf-8")
        (stage / "features.json").write_text(json.dumps(record, ensure_ascii=False, indent=1), encoding="utf-8")
        if stop():
            raise FeaturesCancelled()
        stage.rename(dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    feats.name, feats.path = out_name, dest
    say(f"saved {dest}")
    return FeatureRun(feats, dest, record, buf)
