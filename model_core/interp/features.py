"""Sparse-autoencoder features (issue 19): a TopK sparse autoencoder trained on one hook point's
activations, its quality on held-out text, and what each feature reads and writes.

The autoencoder is EleutherAI's `SparseCoder` (package eai-sparsify, import `sparsify`): encoder
z = TopK_k(ReLU(W_enc (x - b_dec) + b_enc)), decoder x_hat = z W_dec + b_dec with unit-norm decoder
rows, its loss FVU = sum ||x - x_hat||^2 / sum ||x - mean(x)||^2 (over the batch) plus its AuxK loss,
and its initialisation (b_dec = the first batch's mean; gradients parallel to the decoder rows
removed). Optimiser: Adam (lr 1e-3) by default; `optimizer="signum"` is the library's default
(sign-SGD under a schedule-free wrapper, lr 5e-3 / sqrt(latents / 2^14)), made for batches of ~65k
tokens: at our ~1k-token steps it drifts (layer 6 of SmolLM2, 60k tokens cached and seen twice:
held-out FVU 0.19 after one pass, 0.32 after two).
sparsify's own `Trainer` is not used: it hooks module outputs by module path (not our hook names), reads
a Hugging Face `datasets` table of whole sequences, has no progress or stop callback, prints, and
writes optimiser and rank state; the loop here streams activations through lmscope's own hooks.

Hook points (model_core.core.hook_names; the activation the autoencoder reads, and where the
reconstruction is spliced back in with a `Recorder` edit):
  resid_pre   blocks.{l}.hook_resid_pre   (the edit point itself)
  resid_post  blocks.{l}.hook_resid_post  (= blocks.{l+1}.hook_resid_pre, edited there; not the last layer)
  attn_out    blocks.{l}.hook_attn_out, mlp_out  blocks.{l}.hook_mlp_out  (edit points)

Streaming and memory: the corpus (its documents in a seeded random order) is tokenized text by text
into windows of `context` tokens; each forward pass runs `batch_size` windows and STOPS at the hook
point (the blocks above it never run), so at most batch_size x context activation vectors of width
d_model exist at once (plus the encoder's batch_size x context x latents pre-activations during a
step). `ActivationBuffer` counts
what it held (`peak_rows`, never above `limit_rows`). Position 0 of every window is left out of
training and of every metric (the attention sink: its residual norm is several times the others'),
and the splices below leave it clean.

Quality on held-out windows (the built-in corpus's held-out split):
  FVU over all held-out activations (one mean for them all), explained = 1 - FVU;
  CE loss (transformers' `labels=` loss, every next-token prediction of each window) clean, with the
  reconstruction spliced in at the hook, and with the hook zero-ablated (positions >= 1 each time);
  CE recovered = (CE_zero - CE_sae) / (CE_zero - CE_clean).

Reading features: `feature_activations` (per position, the features that fire), `context_index` /
`top_contexts` (the largest activations of every feature over a bounded token stream, and every
activation binned on a log scale: `density`, how often each feature fires),
`promoted_tokens` (the decoder row through the final norm's gain and the unembedding, as
model_core.interp.neurons reads a neuron), `label` (most frequent n-grams ending at the top contexts'
activating token, and the top promoted tokens).

Saved as <data dir>/features/<name>/: sae.safetensors + cfg.json (sparsify's own format:
`SparseCoder.load_from_disk` reads it), features.json (settings, memory bound, metrics, history),
contexts.safetensors and labels.json; written into data/features-staging/ and renamed when complete,
so a failed or cancelled run leaves nothing.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_core.core import checkpoints, paths
from model_core.core.errors import SettingsError
from model_core.core.hook_names import UnknownHookName, act_name, parse
from model_core.core.hooks import Recorder, instrument, recording

HOOK_KINDS = ("resid_pre", "resid_post", "attn_out", "mlp_out")
OPTIMIZERS = ("adam", "signum")
FORMAT = "lmscope-features"
DEFAULT_CONTEXT = 128
DEFAULT_BATCH = 8
DEFAULT_TOKENS = 100_000
MAX_TOKENS = 50_000_000
DEFAULT_EVAL_TOKENS = 4096  # three full forwards each (clean, spliced, zero-ablated): ~1/3 of 100k training tokens on a CPU
DEFAULT_CONTEXT_TOKENS = 16_384  # tokens scanned for every feature's top contexts
TOP_K = 12  # contexts kept per feature

ProgressFn = Callable[[int, int, dict], None]


class FeatureError(SettingsError):
    """A bad layer, hook, width or setting of a feature run: one sentence."""


class FeaturesCancelled(Exception):
    """should_stop() asked the run to stop; nothing was saved."""


def _sparsify():
    """The sparsify package (imported on first use: ~10 s; its import prints which decoder it uses)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import sparsify
    return sparsify


# --- the built-in corpus ------------------------------------------------------------------------
# The same text and files as tasks/corpus.py's builtin (the standard library's docstrings; every
# 10th file held out; the jsonl files it caches under <cache dir>/corpus/), readable from model_core.

BUILTIN_VERSION = "stdlib-docstrings-v2"
_BUILTIN_MAX_BYTES = 4 * 1024 * 1024


def builtin_texts(split: str = "train") -> list[str]:
    """The built-in corpus's documents ('train' or 'heldout'), extracted once per Python version."""
    if split not in ("train", "heldout"):
        raise FeatureError("The built-in corpus has the splits 'train' and 'heldout'.")
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    dest = paths.cache_dir() / "corpus" / f"{BUILTIN_VERSION}-py{v}"
    if not ((dest / "train.jsonl").exists() and (dest / "heldout.jsonl").exists()):
        _extract_builtin(dest)
    lines = (dest / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines if line]


def _extract_builtin(dest: Path) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test", "__pycache__")
    files = sorted(p for p in stdlib.rglob("*.py") if not any(s in skip for s in p.relative_to(stdlib).parts))
    seen: set[str] = set()
    split: dict[str, list[str]] = {"train": [], "heldout": []}
    total = 0
    for i, f in enumerate(files):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
            continue
        docs = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node, clean=True)
                if d and len(d) >= 40 and d.strip() not in seen:
                    seen.add(d.strip())
                    docs.append(d.strip())
        split["heldout" if i % 10 == 0 else "train"].extend(docs)
        total += sum(len(d.encode()) + 2 for d in docs)
        if total >= _BUILTIN_MAX_BYTES:
            break
    dest.mkdir(parents=True, exist_ok=True)
    for name, docs in split.items():
        tmp = dest / f"{name}.jsonl.tmp{os.getpid()}"
        tmp.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        os.replace(tmp, dest / f"{name}.jsonl")


def dataset_texts(dataset, split: str) -> list[str]:
    """'builtin' -> the built-in corpus's split; a list of texts -> every 10th for 'heldout', the
    rest for 'train' (all of them for both when fewer than 10)."""
    if dataset == "builtin":
        return builtin_texts(split)
    if isinstance(dataset, (list, tuple)) and dataset and all(isinstance(t, str) for t in dataset):
        texts = [t for t in dataset if t.strip()]
        if len(texts) < 10:
            return texts
        return [t for i, t in enumerate(texts) if (i % 10 == 9) == (split == "heldout")]
    raise FeatureError("The dataset must be 'builtin' or a list of texts.")


# --- hook points and streaming ------------------------------------------------------------------

@dataclass(frozen=True)
class HookPoint:
    kind: str  # one of HOOK_KINDS
    layer: int
    name: str  # the activation's name, e.g. blocks.6.hook_resid_post
    edit_name: str  # the hook where it is read and replaced, e.g. blocks.7.hook_resid_pre


def hook_point(lm, layer, hook: str = "resid_post") -> HookPoint:
    """Check (layer, hook) against the model; `hook` is a kind of HOOK_KINDS or a full hook name."""
    n = lm.shape.n_layers
    if isinstance(hook, str) and hook.startswith("blocks."):
        try:
            hook, named_layer = parse(hook)
        except UnknownHookName:
            raise FeatureError(f"Unknown hook name {hook!r}; use one of: {', '.join(HOOK_KINDS)}.") from None
        if layer is not None and layer != named_layer:
            raise FeatureError(f"The hook name says layer {named_layer} but the layer given is {layer}.")
        layer = named_layer
    if hook not in HOOK_KINDS:
        raise FeatureError(f"Features can be trained on {', '.join(HOOK_KINDS)}; not on {hook!r}.")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
        raise FeatureError(f"The layer must be a whole number from 0 to {n - 1} for {lm.name}.")
    if hook == "resid_post":
        if layer == n - 1:
            raise FeatureError(f"resid_post of the last layer ({layer}) has no edit point to splice features "
                               f"into; use resid_pre, attn_out or mlp_out of layer {layer}, or an earlier layer.")
        edit = act_name("resid_pre", layer + 1)
    else:
        edit = act_name(hook, layer)
    return HookPoint(hook, layer, act_name(hook, layer), edit)


class _Reached(Exception):
    """Raised by the capture edit: the forward pass has reached the hook point and stops there."""


class ActivationBuffer:
    """The activations of one forward batch, [B, T, d] at most batch_size x context rows; counts the
    largest it held so the bound can be checked (`peak_rows` <= `limit_rows`)."""

    def __init__(self, batch_size: int, context: int, d: int):
        self.limit_rows = int(batch_size) * int(context)
        self.d = int(d)
        self.peak_rows = 0
        self.batches = 0

    @property
    def limit_bytes(self) -> int:
        return self.limit_rows * self.d * 4

    def hold(self, x: torch.Tensor) -> torch.Tensor:
        rows = int(x.shape[0] * x.shape[1])
        if rows > self.limit_rows:
            raise RuntimeError(f"activation batch of {rows} rows over the buffer's {self.limit_rows}")
        self.peak_rows = max(self.peak_rows, rows)
        self.batches += 1
        return x

    def describe(self) -> dict:
        return {"limit_rows": self.limit_rows, "peak_rows": self.peak_rows, "d": self.d,
                "limit_mb": round(self.limit_bytes / 2**20, 2),
                "statement": f"at most {self.limit_rows} activations (batch x context) of width {self.d} "
                             f"in memory at once ({self.limit_bytes / 2**20:.1f} MB as float32)"}


def capture(lm, hp: HookPoint, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> the activation at the hook point [B, T, d] (model dtype, model device); the
    forward pass stops there."""
    instrument(lm.adapter)
    got: list[torch.Tensor] = []

    def grab(name, x):
        got.append(x)
        raise _Reached()

    with torch.inference_mode(), recording(Recorder(capture=False, edits={hp.edit_name: grab})):
        try:
            lm.model(input_ids=ids.to(lm.device), use_cache=False)
        except _Reached:
            pass
    if not got:
        raise FeatureError(f"The forward pass never reached {hp.name}.")
    return got[0]


def window_batches(tokenizer, texts: Iterable[str], n_tokens: int, context: int,
                   batch_size: int) -> Iterator[torch.Tensor]:
    """[<=batch_size, context] int64 batches: the texts tokenized one after another (each followed
    by a blank line, no special tokens) and cut into whole windows, n_tokens at most in all. Holds
    one text's tokens and one batch at a time."""
    if context < 2:
        raise FeatureError("The context must be at least 2 tokens.")
    ids: list[int] = []
    rows: list[list[int]] = []
    left = int(n_tokens) // context
    for t in texts:
        if left <= 0:
            break
        ids += tokenizer(t + "\n\n", add_special_tokens=False)["input_ids"]
        while len(ids) >= context and left > 0:
            rows.append(ids[:context])
            ids = ids[context:]
            left -= 1
            if len(rows) == batch_size:
                yield torch.tensor(rows, dtype=torch.int64)
                rows = []
    if rows:
        yield torch.tensor(rows, dtype=torch.int64)


def eval_windows(tokenizer, dataset, eval_tokens: int = DEFAULT_EVAL_TOKENS,
                 context: int = DEFAULT_CONTEXT) -> torch.Tensor:
    """[N, context]: the held-out windows every evaluation reads (the first eval_tokens tokens)."""
    batches = list(window_batches(tokenizer, dataset_texts(dataset, "heldout"), eval_tokens, context, 1 << 30))
    if not batches:
        raise FeatureError(f"The held-out text has fewer than {context} tokens; nothing to evaluate on.")
    return batches[0]


# --- the autoencoder ----------------------------------------------------------------------------

@dataclass
class Features:
    """A trained autoencoder and where it reads: model, hook kind and layer, its record."""

    sae: object  # sparsify.SparseCoder
    model: str
    layer: int
    hook: str
    name: str = ""
    record: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def num_latents(self) -> int:
        return int(self.sae.num_latents)

    def point(self, lm) -> HookPoint:
        hp = hook_point(lm, self.layer, self.hook)
        check_width(lm, self.sae, hp)
        return hp


def check_width(lm, sae, hp: HookPoint) -> None:
    d = lm.shape.d_model
    if int(sae.d_in) != d:
        raise FeatureError(f"These features read activations of width {sae.d_in}; {hp.name} of {lm.name} "
                           f"has width {d}.")


def new_sae(d_in: int, *, expansion_factor: int = 8, num_latents: int = 0, k: int = 32, seed: int = 0,
            device="cpu"):
    sp = _sparsify()
    torch.manual_seed(int(seed))
    cfg = sp.SparseCoderConfig(expansion_factor=int(expansion_factor), num_latents=int(num_latents), k=int(k))
    return sp.SparseCoder(d_in, cfg, device=device, dtype=torch.float32)


def _encode(sae, x: torch.Tensor):
    """[..., d] -> (top_acts [rows, k] float32, top_indices [rows, k]) on the autoencoder's device."""
    with torch.no_grad():
        enc = sae.encode(x.reshape(-1, x.shape[-1]).to(sae.device, torch.float32))
    return enc.top_acts.float(), enc.top_indices


def _decode(sae, acts: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return sae.decode(acts, idx).float()


def reconstruct(sae, x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> the autoencoder's reconstruction [..., d] (float32; = its forward's sae_out)."""
    return _decode(sae, *_encode(sae, x)).reshape(x.shape)


# --- training -----------------------------------------------------------------------------------

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


def features_dir() -> Path:
    p = paths.data_dir() / "features"
    p.mkdir(parents=True, exist_ok=True)
    return p


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
    sp = _sparsify()
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


def load_features(name: str, device="cpu") -> Features:
    """A saved feature set by name (folder under <data dir>/features)."""
    if not checkpoints.valid_output_name(name):
        raise FeatureError(f"{name!r} is not a feature set name.")
    path = features_dir() / name
    if not (path / "features.json").is_file():
        raise FeatureError(f"There is no feature set named '{name}'.")
    record = json.loads((path / "features.json").read_text(encoding="utf-8"))
    sae = _sparsify().SparseCoder.load_from_disk(path, device=device)
    sae.requires_grad_(False)
    return Features(sae=sae, model=record["model"], layer=record["layer"], hook=record["hook"], name=name,
                    record=record, path=path)


def list_features() -> list[str]:
    return sorted(p.name for p in features_dir().iterdir() if (p / "features.json").is_file())


# --- quality on held-out text -------------------------------------------------------------------

def ce_loss(lm, ids: torch.Tensor, edits: dict | None = None) -> float:
    """transformers' labels= loss (mean over every next-token prediction of the batch), edits active."""
    instrument(lm.adapter)
    ids = ids.to(lm.device)
    with torch.inference_mode(), recording(Recorder(capture=False, edits=dict(edits or {}))):
        return float(lm.model(input_ids=ids, labels=ids, use_cache=False).loss)


def splice_edit(fn: Callable[[torch.Tensor], torch.Tensor]):
    """An edit replacing positions >= 1 of the activation with fn(x[:, 1:]) (position 0 stays clean)."""
    def edit(name, x):
        out = x.clone()
        out[:, 1:] = fn(x[:, 1:]).to(x.dtype)
        return out
    return edit


def evaluate(lm, feats: Features, windows: torch.Tensor, *, batch_size: int = DEFAULT_BATCH,
             should_stop: Callable[[], bool] | None = None) -> dict:
    """FVU and CE recovered on `windows` [N, T] (positions >= 1): three forwards per batch (clean,
    reconstruction spliced in, zero-ablated)."""
    hp = feats.point(lm)
    sae = feats.sae
    n = 0
    sx = torch.zeros(lm.shape.d_model, dtype=torch.float64)
    sxx = see = 0.0
    ce = {"clean": 0.0, "sae": 0.0, "zero": 0.0}
    preds = 0
    fired = torch.zeros(sae.num_latents, dtype=torch.bool)
    l0 = 0.0

    def spliced(v):  # v [B, T-1, d]: reconstruct, and keep the sums FVU needs
        nonlocal n, sxx, see, l0
        xs = v.reshape(-1, v.shape[-1]).float()
        acts, idx = _encode(sae, xs)
        xh = _decode(sae, acts, idx).to(xs.device)
        sx.add_(xs.double().sum(0).cpu())
        sxx += float(xs.double().pow(2).sum())
        see += float((xs - xh).double().pow(2).sum())
        n += xs.shape[0]
        fired[idx[acts > 0].cpu()] = True
        l0 += float((acts > 0).sum())
        return xh.reshape(v.shape)

    for b0 in range(0, windows.shape[0], batch_size):
        if should_stop is not None and should_stop():
            raise FeaturesCancelled()
        ids = windows[b0:b0 + batch_size]
        p = ids.shape[0] * (ids.shape[1] - 1)
        ce["clean"] += ce_loss(lm, ids) * p
        ce["sae"] += ce_loss(lm, ids, {hp.edit_name: splice_edit(spliced)}) * p
        ce["zero"] += ce_loss(lm, ids, {hp.edit_name: splice_edit(torch.zeros_like)}) * p
        preds += p
    total_var = sxx - float(sx.pow(2).sum()) / n
    fvu = see / total_var
    c = {k: v / preds for k, v in ce.items()}
    denom = c["zero"] - c["clean"]
    return {"fvu": fvu, "explained": 1 - fvu, "ce_clean": c["clean"], "ce_sae": c["sae"], "ce_zero": c["zero"],
            "ce_recovered": (c["zero"] - c["sae"]) / denom if denom != 0 else float("nan"),
            "ce_increase": c["sae"] - c["clean"], "l0": l0 / n, "alive_share": float(fired.float().mean()),
            "windows": int(windows.shape[0]), "context": int(windows.shape[1]), "activations": n,
            "predictions": preds}


# --- reading features ---------------------------------------------------------------------------

def feature_activations(lm, feats: Features, prompt, *, top: int = 5, chat: bool = False) -> dict:
    """The prompt's tokens and, per position, the `top` features that fire (feature, activation),
    largest first. Position 0 is included (the autoencoder never trained on it: read it with care)."""
    from model_core.core.prompts import prompt_ids
    from model_core.core.tokenization import describe_tokens

    hp = feats.point(lm)
    ids = prompt_ids(lm, prompt, chat=chat)
    x = capture(lm, hp, torch.tensor([ids]))[0]  # [T, d]
    acts, idx = _encode(feats.sae, x)
    top = max(1, min(int(top), acts.shape[1]))
    order = torch.argsort(acts, dim=1, descending=True)[:, :top]
    rows = describe_tokens(lm.tokenizer, ids)
    positions = []
    for p in range(len(ids)):
        fs = [{"feature": int(idx[p, j]), "activation": float(acts[p, j])} for j in order[p].tolist()
              if float(acts[p, j]) > 0]
        positions.append({"position": p, "token": rows[p]["display"], "features": fs})
    return {"hook": hp.name, "tokens": [r["display"] for r in rows], "positions": positions}


@dataclass
class FeatureContexts:
    """The k largest activations of every feature over `tokens` ([N, W] windows), each with its place
    as a flat index w * W + p (position 0 of each window skipped)."""

    tokens: torch.Tensor  # [N, W] int64
    vals: torch.Tensor  # [M, K] float32, largest first (-inf: no context)
    idx: torch.Tensor  # [M, K] int64 (-1: none)
    # every activation of the scan, binned: [M, HIST_BINS] counts over log10(activation) in
    # HIST_LOG10 (values beyond fall in the end bins); None in sets saved before it was kept
    hist: torch.Tensor | None = None

    @property
    def window(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def scanned(self) -> int:
        """Tokens the scan read (position 0 of each window skipped)."""
        return int(self.tokens.shape[0]) * (self.window - 1)

    def save(self, path) -> Path:
        from safetensors.torch import save_file

        t = {"tokens": self.tokens.contiguous(), "vals": self.vals.contiguous(), "idx": self.idx.contiguous()}
        if self.hist is not None:
            t["hist"] = self.hist.contiguous()
        save_file(t, str(path), metadata={"format": FORMAT + "-contexts"})
        return Path(path)

    @classmethod
    def load(cls, path) -> FeatureContexts:
        from safetensors.torch import load_file

        return cls(**load_file(str(path)))


HIST_BINS = 48
HIST_LOG10 = (-3.0, 3.0)  # activations from 0.001 to 1000, 8 bins a decade


def hist_edges() -> list[float]:
    """The HIST_BINS + 1 bin edges of FeatureContexts.hist, as activations."""
    lo, hi = HIST_LOG10
    return [10 ** (lo + (hi - lo) * i / HIST_BINS) for i in range(HIST_BINS + 1)]


def _hist_bins(acts: torch.Tensor) -> torch.Tensor:
    """Bin numbers of positive activations (log10 bins of HIST_LOG10, the ends open)."""
    lo, hi = HIST_LOG10
    b = ((torch.log10(acts) - lo) * (HIST_BINS / (hi - lo))).floor()
    return b.clamp(0, HIST_BINS - 1).long()


def density(index: FeatureContexts, feature: int) -> dict:
    """How often a feature fired over the scan: {fired, scanned, density, counts [HIST_BINS], edges},
    or {} for a set saved without the histogram."""
    if index.hist is None:
        return {}
    counts = index.hist[feature]
    fired = int(counts.sum())
    return {"fired": fired, "scanned": index.scanned, "density": fired / max(index.scanned, 1),
            "counts": counts.tolist(), "edges": hist_edges()}


def context_index(lm, feats: Features, windows: torch.Tensor, *, k: int = TOP_K, batch_size: int = DEFAULT_BATCH,
                  should_stop: Callable[[], bool] | None = None) -> FeatureContexts:
    """One pass over `windows` (each batch stops at the hook point) keeping every feature's k
    largest activations and their places. Memory: [M, k + batch x window] values at once."""
    hp = feats.point(lm)
    N, W = windows.shape
    M = feats.num_latents
    k = max(1, min(int(k), N * (W - 1)))
    vals = torch.full((M, k), float("-inf"))
    idx = torch.full((M, k), -1, dtype=torch.int64)
    hist = torch.zeros(M * HIST_BINS, dtype=torch.int64)  # [M * HIST_BINS], viewed [M, HIST_BINS] at the end
    for b0 in range(0, N, batch_size):
        if should_stop is not None and should_stop():
            raise FeaturesCancelled()
        ids = windows[b0:b0 + batch_size]
        B = ids.shape[0]
        acts, top_i = _encode(feats.sae, capture(lm, hp, ids))  # [B*W, kk]
        acts, top_i = acts.cpu(), top_i.cpu()
        fired = acts.view(B, W, -1)[:, 1:] > 0  # [B, W-1, kk]: position 0 skipped, as in the contexts
        a, f = acts.view(B, W, -1)[:, 1:][fired], top_i.view(B, W, -1)[:, 1:][fired]  # [n] each
        hist.index_add_(0, f * HIST_BINS + _hist_bins(a), torch.ones_like(f))
        dense = torch.zeros(B * W, M).scatter_(1, top_i, acts)
        dense.view(B, W, M)[:, 0] = float("-inf")
        dense[dense <= 0] = float("-inf")
        places = b0 * W + torch.arange(B * W)
        v = torch.cat([vals, dense.T], 1)
        i = torch.cat([idx, places.expand(M, -1)], 1)
        t = torch.topk(v, k, dim=1)
        vals, idx = t.values, torch.gather(i, 1, t.indices)
    idx[~torch.isfinite(vals)] = -1
    return FeatureContexts(tokens=windows.cpu(), vals=vals, idx=idx, hist=hist.view(M, HIST_BINS))


def top_contexts(index: FeatureContexts, tokenizer, feature: int, *, before: int = 16, after: int = 4) -> list[dict]:
    """A feature's top contexts: value, window, position, the tokens around it (byte-safe) and `at`,
    the activating token's place among them."""
    from model_core.core.tokenization import describe_tokens

    M = index.vals.shape[0]
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < M:
        raise FeatureError(f"Feature {feature} is outside this set (0-{M - 1}).")
    out = []
    for v, flat in zip(index.vals[feature].tolist(), index.idx[feature].tolist()):
        if flat < 0 or not math.isfinite(v):
            continue
        w, p = divmod(int(flat), index.window)
        lo, hi = max(0, p - before), min(index.window, p + after + 1)
        ids = index.tokens[w, lo:hi].tolist()
        out.append({"value": float(v), "window": w, "position": p, "at": p - lo, "ids": ids,
                    "tokens": [r["display"] for r in describe_tokens(tokenizer, ids)]})
    return out


def decoder_directions(feats: Features) -> torch.Tensor:
    """[M, d]: what one unit of each feature's activation adds at the hook point (unit norm)."""
    return feats.sae.W_dec.detach().float()


def promoted_tokens(lm, feats: Features, feature: int, k: int = 10) -> dict:
    """{"promoted": [...], "suppressed": [...]}: the feature's decoder row through the final norm's
    gain and the unembedding (model_core.interp.neurons.unembed_direction), the tokens whose logits it
    raises and lowers most per unit of activation (direct effect, before the final norm's scale)."""
    from model_core.interp.neurons import top_tokens, unembed_direction

    feats.point(lm)
    M = feats.num_latents
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < M:
        raise FeatureError(f"Feature {feature} is outside this set (0-{M - 1}).")
    with torch.no_grad():
        logits = unembed_direction(lm, decoder_directions(feats)[feature])
    return top_tokens(lm, logits, k)


def _ngrams(index: FeatureContexts, feature: int, n_max: int = 3) -> Counter:
    """n-grams (1..n_max tokens) ending at the activating token of each top context."""
    c: Counter = Counter()
    for flat in index.idx[feature].tolist():
        if flat < 0:
            continue
        w, p = divmod(int(flat), index.window)
        for n in range(1, n_max + 1):
            if p - n + 1 >= 0:
                c[tuple(index.tokens[w, p - n + 1:p + 1].tolist())] += 1
    return c


def label(lm, feats: Features, index: FeatureContexts, feature: int, promoted: list[int] | None = None) -> dict:
    """An automatic label: the most frequent n-grams ending at the activating token of the top
    contexts (a longer one kept when it is as frequent), and the top promoted tokens."""
    from model_core.core.tokenization import byte_safe_decode, display_bytes, token_bytes

    c = _ngrams(index, feature)

    def dec(ids):  # a context cut inside a character shows its stray bytes as <0xNN>, not "�"
        return byte_safe_decode(lm.tokenizer, ids)

    grams = sorted(c.items(), key=lambda kv: (-kv[1], -len(kv[0])))
    picked: list[tuple] = []
    for g, cnt in grams:
        if cnt < 2 and picked:
            break
        if any(g == q[-len(g):] or q == g[-len(q):] for q, _ in picked):
            continue
        picked.append((g, cnt))
        if len(picked) == 2:
            break
    if promoted is None:
        promoted = [r["id"] for r in promoted_tokens(lm, feats, feature, 3)["promoted"]]
    n_ctx = int((index.idx[feature] >= 0).sum())
    reads = [{"text": dec(list(g)), "count": cnt} for g, cnt in picked]
    writes = [dec([i]) for i in promoted]

    def shown(ids) -> str:  # as every view shows tokens: ␣ for a space, ↵ for a newline, <0xNN> for a stray byte
        return "“" + display_bytes(b"".join(token_bytes(lm.tokenizer, t) for t in ids)) + "”"

    text = ((" / ".join(shown(g) for g, _ in picked) or "(never fires)") + " → "
            + ", ".join(shown([i]) for i in promoted))
    return {"feature": feature, "label": text, "reads": reads, "promotes": writes, "contexts": n_ctx}


def label_all(lm, feats: Features, index: FeatureContexts, chunk: int = 512) -> list[dict]:
    """label() of every feature, the promoted tokens computed in chunks of decoder rows."""
    from model_core.interp.neurons import unembed_direction

    W = decoder_directions(feats)
    out = []
    for c0 in range(0, W.shape[0], chunk):
        with torch.no_grad():
            logits = unembed_direction(lm, W[c0:c0 + chunk].to(lm.device))
            top = torch.topk(logits, 3, dim=1).indices.cpu().tolist()
        for j, ids in enumerate(top):
            out.append(label(lm, feats, index, c0 + j, promoted=ids))
    return out
