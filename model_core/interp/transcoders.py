"""Per-layer transcoders: for each layer, a sparse coder that reads the MLP's input (the residual
after the MLP's own norm) and predicts what the MLP adds to the residual stream (mlp_out). They
are what an attribution graph (model_core.interp.attribution_graph) replaces the MLPs with.

The coder is EleutherAI's `SparseCoder` with `transcode=True` (package eai-sparsify), the library
that trains transcoders; it is driven here, as for feature sets, because lmscope reads activations
by its own hook names and bounds the memory per batch. One forward per batch yields every layer's
(input, output) pair, and all layers train together on them.

Saved as <data dir>/transcoders/<name>/: one folder per layer named as sparsify's trainer names an
MLP's coder (`layers.<l>.mlp/` with cfg.json + sae.safetensors, so `SparseCoder.load_many` reads
the set), and transcoders.json (model, layers, quality, settings).

Quality on held-out windows (position 0, the attention sink, left out):
  - per layer: the fraction of the MLP output's variance explained;
  - the replacement model (every MLP replaced by its transcoder at once): its CE loss, CE loss
    recovered between the clean model and every MLP zero-ablated, and top-1 agreement with the
    real model's next-token prediction.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_core.core import checkpoints, paths
from model_core.core.hook_names import act_name
from model_core.core.hooks import Recorder, instrument, recording
from model_core.interp.features_corpus import dataset_texts, eval_windows, window_batches
from model_core.interp.features_sae import FeatureError, FeaturesCancelled, import_sparsify
from model_core.interp.transcoder_acts import encode, mlp_pairs, transcode  # noqa: F401  (the set's API)

FORMAT = "lmscope-transcoders"
SUPPORTED_FAMILIES = ("llama", "gpt2")  # sequential pre-norm blocks whose MLP input is mlp_norm(resid_mid)
DEFAULT_TOKENS = 50_000
MAX_TOKENS = 50_000_000

ProgressFn = Callable[[int, int, dict], None]


def hookpoint(layer: int) -> str:
    """sparsify's folder name for layer `layer`'s MLP coder."""
    return f"layers.{layer}.mlp"


def check_family(lm) -> None:
    """Transcoders (and attribution graphs) need blocks whose MLP reads mlp_norm(resid_pre + attn_out)
    and adds its output to the residual: one sentence otherwise."""
    if getattr(lm.adapter, "family", "") not in SUPPORTED_FAMILIES:
        raise FeatureError(f"Transcoders and attribution graphs support the Llama, Mistral, Qwen and GPT-2 "
                           f"families; {lm.name} ({lm.adapter.config.model_type}) is not one of them yet.")


@dataclass(frozen=True)
class TranscoderSettings:
    model: str
    layers: tuple[int, ...]  # () = every layer
    max_tokens: int = DEFAULT_TOKENS
    expansion_factor: int = 4
    k: int = 16
    batch_size: int = 8
    context: int = 128
    lr: float = 4e-3
    auxk_alpha: float = 1 / 32
    skip: bool = True  # a linear skip connection (W_skip, d x d): the MLP's linear part, outside the features
    seed: int = 0
    eval_tokens: int = 2048
    name: str | None = None


def _whole(v, key: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or not lo <= int(v) <= hi:
        raise FeatureError(f"'{key}' must be a whole number from {lo:,} to {hi:,}.")
    return int(v)


def validate_settings(s: TranscoderSettings, n_layers: int | None = None, d_model: int | None = None
                      ) -> TranscoderSettings:
    """The same settings with each value checked (FeatureError, one sentence, for the first bad one)."""
    v = {"max_tokens": _whole(s.max_tokens, "max_tokens", 256, MAX_TOKENS),
         "expansion_factor": _whole(s.expansion_factor, "expansion_factor", 1, 128),
         "batch_size": _whole(s.batch_size, "batch_size", 1, 1024),
         "context": _whole(s.context, "context", 8, 8192),
         "seed": _whole(s.seed, "seed", 0, 2**31 - 1),
         "eval_tokens": _whole(s.eval_tokens, "eval_tokens", 0, 1 << 22)}
    v["k"] = _whole(s.k, "k", 1, v["expansion_factor"] * (d_model or 1 << 20))
    if isinstance(s.lr, bool) or not isinstance(s.lr, (int, float)) or not math.isfinite(s.lr) or not 0 < s.lr <= 1:
        raise FeatureError("'lr' must be a number above 0 and at most 1.")
    if isinstance(s.auxk_alpha, bool) or not isinstance(s.auxk_alpha, (int, float)) \
            or not math.isfinite(s.auxk_alpha) or not 0 <= s.auxk_alpha <= 10:
        raise FeatureError("'auxk_alpha' must be a number from 0 to 10.")
    if not isinstance(s.skip, bool):
        raise FeatureError("'skip' must be true or false.")
    layers = tuple(s.layers)
    if n_layers is not None:
        layers = layers or tuple(range(n_layers))
    for layer in layers:
        _whole(layer, "layers", 0, (n_layers or 100_000) - 1)
    if len(set(layers)) != len(layers):
        raise FeatureError("'layers' names a layer twice.")
    if s.name is not None and not checkpoints.valid_output_name(s.name):
        raise FeatureError("A transcoder set's name is 1-100 letters, digits, '.', '_' or '-', starting with a "
                           "letter or digit.")
    if v["max_tokens"] < v["context"] * 2:
        raise FeatureError(f"'max_tokens' ({v['max_tokens']}) must be at least two windows of {v['context']} tokens.")
    return TranscoderSettings(**{**s.__dict__, **v, "layers": tuple(sorted(int(x) for x in layers))})


def parse_layers(text) -> tuple[int, ...]:
    """'all' / '' / None -> () (every layer); '0,3,5' or [0, 3, 5] -> (0, 3, 5)."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "all")):
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        return tuple(int(str(x).strip()) for x in items)
    except ValueError:
        raise FeatureError("'layers' must be 'all' or whole numbers separated by commas.") from None


@dataclass
class Transcoders:
    """A trained set: layer -> SparseCoder (transcode=True), the model it reads, its record."""

    coders: dict[int, object]
    model: str
    name: str = ""
    record: dict = field(default_factory=dict)
    path: Path | None = None
    # what each feature reads and writes (model_core.interp.transcoder_contexts), where computed:
    labels: dict[int, list[str]] = field(default_factory=dict)  # layer -> one label per feature
    contexts: dict[int, object] = field(default_factory=dict)  # layer -> FeatureContexts (saved, read on demand)

    def feature_label(self, layer: int, feature: int) -> str:
        names = self.labels.get(layer)
        return names[feature] if names is not None and 0 <= feature < len(names) else ""

    def feature_contexts(self, layer: int):
        """The layer's FeatureContexts, or None for a set saved without them."""
        from model_core.interp import transcoder_contexts as TX

        if layer not in self.contexts and self.path is not None:
            self.contexts[layer] = TX.load_contexts(self.path / hookpoint(layer))
        return self.contexts.get(layer)

    @property
    def layers(self) -> list[int]:
        return sorted(self.coders)

    def check_model(self, lm) -> None:
        if self.model != lm.name:
            raise FeatureError(f"The transcoder set '{self.name}' was trained on {self.model}, not {lm.name}.")
        d = lm.shape.d_model
        for layer, c in self.coders.items():
            if int(c.d_in) != d or layer >= lm.shape.n_layers:
                raise FeatureError(f"The transcoder set '{self.name}' reads width {c.d_in} at layer {layer}; "
                                   f"{lm.name} has width {d} and {lm.shape.n_layers} layers.")


def transcoders_dir() -> Path:
    p = paths.data_dir() / "transcoders"
    p.mkdir(parents=True, exist_ok=True)
    return p


def new_transcoder(d: int, expansion_factor: int, k: int, device, skip: bool = True) -> object:
    sp = import_sparsify()
    cfg = sp.SparseCoderConfig(expansion_factor=int(expansion_factor), k=int(k), transcode=True,
                               skip_connection=bool(skip))
    return sp.SparseCoder(d, cfg, device=device, dtype=torch.float32)


@dataclass
class TranscoderRun:
    transcoders: Transcoders
    path: Path
    record: dict


def train_transcoders(model_name: str | None = None, layers=(), max_tokens: int = DEFAULT_TOKENS, *,
                      expansion_factor: int = 4, k: int = 16, batch_size: int = 8, context: int = 128,
                      lr: float = 4e-3, auxk_alpha: float = 1 / 32, skip: bool = True, seed: int = 0,
                      eval_tokens: int = 2048,
                      name: str | None = None, dataset="builtin", device: str | None = None,
                      progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
                      save: bool = True, log: Callable[[str], None] | None = None) -> TranscoderRun:
    """Train a transcoder for each of `layers` (() = all) over max_tokens of the corpus (streamed: one
    batch of windows in memory at a time), measure it on held-out windows, save the set.
    progress(step, total, {...}) after each step (phase 'training'), then 'evaluating', 'saving'."""
    from model_core import load_model
    from model_core.core.registry import DEFAULT_MODEL

    say = log or (lambda _m: None)
    stop = should_stop or (lambda: False)
    lm = load_model(model_name or DEFAULT_MODEL, device=device, allow_hub=False)
    check_family(lm)
    d, n = lm.shape.d_model, lm.shape.n_layers
    s = validate_settings(TranscoderSettings(
        model=lm.name, layers=tuple(layers), max_tokens=max_tokens, expansion_factor=expansion_factor, k=k,
        batch_size=batch_size, context=context, lr=lr, auxk_alpha=auxk_alpha, skip=skip, seed=seed,
        eval_tokens=eval_tokens, name=name), n, d)
    if s.name is not None and (transcoders_dir() / s.name).exists():
        raise FeatureError(f"A transcoder set named '{s.name}' already exists; choose another name.")
    torch.manual_seed(s.seed)
    coders = {layer: new_transcoder(d, s.expansion_factor, s.k, lm.device, s.skip) for layer in s.layers}
    M = next(iter(coders.values())).num_latents
    opt = torch.optim.Adam([p for c in coders.values() for p in c.parameters()], lr=s.lr)
    dead_after = max(s.batch_size * (s.context - 1), s.max_tokens // 10)
    since_fired = {layer: torch.zeros(M, dtype=torch.long, device=lm.device) for layer in coders}
    total_steps = max(1, -(-(s.max_tokens // s.context) // s.batch_size))
    texts = dataset_texts(dataset, "train")
    random.Random(s.seed).shuffle(texts)  # the corpus is sorted by file (see features_train)
    say(f"training {len(coders)} transcoders of {M} latents (k={s.k}) on {lm.name}")
    history: list[dict] = []
    t0 = time.time()
    step = corpus_tokens = 0
    for ids in window_batches(lm.tokenizer, texts, s.max_tokens, s.context, s.batch_size):
        if stop():
            raise FeaturesCancelled()
        pairs = mlp_pairs(lm, ids, coders)
        corpus_tokens += ids.numel()
        loss_sum, fvus = 0.0, {}
        for layer, coder in coders.items():
            x, y = (t[:, 1:].reshape(-1, d).clone() for t in pairs[layer])  # position 0 (the sink) left out
            if step == 0:  # centred pre-activations and output at the start, as sparsify's trainer does
                with torch.no_grad():
                    coder.encoder.bias.data = -x.mean(0) @ coder.encoder.weight.data.T
                    coder.b_dec.data = y.mean(0)
            dead = since_fired[layer] > dead_after
            out = coder(x, y, dead_mask=dead if s.auxk_alpha > 0 else None)
            loss = out.fvu + s.auxk_alpha * out.auxk_loss
            if not torch.isfinite(loss.detach()):
                raise FeatureError(f"The loss of layer {layer} became {float(loss.detach())} at step {step + 1}; "
                                   f"try a smaller learning rate.")
            loss.backward()
            with torch.no_grad():
                fired = torch.zeros(M, dtype=torch.bool, device=lm.device)
                fired[out.latent_indices.flatten()] = True
                since_fired[layer] += x.shape[0]
                since_fired[layer][fired] = 0
            loss_sum += float(loss.detach())
            fvus[layer] = float(out.fvu.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        row = {"step": step, "tokens": corpus_tokens, "loss": round(loss_sum / len(coders), 6),
               "fvu_mean": round(sum(fvus.values()) / len(fvus), 6), "fvu_max": round(max(fvus.values()), 6),
               "tokens_per_s": round(corpus_tokens / max(time.time() - t0, 1e-9), 1)}
        history.append(row)
        if progress is not None:
            progress(step, max(total_steps, step), {**row, "phase": "training"})
    if step == 0:
        raise FeatureError(f"The corpus has fewer than {s.context} tokens; nothing to train on.")
    train_s = time.time() - t0
    for c in coders.values():
        c.requires_grad_(False)
    tc = Transcoders(coders=coders, model=lm.name)
    quality = None
    if s.eval_tokens >= s.context:
        if progress is not None:
            progress(step, step, {"phase": "evaluating"})
        held_out = eval_windows(lm.tokenizer, dataset, s.eval_tokens, s.context)
        quality = evaluate(lm, tc, held_out, batch_size=s.batch_size, should_stop=stop)
        say("evaluated: " + quality_line(quality))
        if save:
            from model_core.interp import transcoder_contexts as TX

            if progress is not None:
                progress(step, step, {"phase": "reading features"})
            t1 = time.time()
            tc.contexts = TX.scan(lm, tc, held_out, batch_size=s.batch_size, should_stop=stop)
            tc.labels = {layer: TX.labels(lm, coders[layer], tc.contexts[layer]) for layer in coders}
            say(f"top contexts and labels of {len(coders) * M:,} features in {time.time() - t1:.1f} s")
    sp = import_sparsify()
    record = {"format": FORMAT, "model": lm.name, "layers": list(s.layers), "d_in": d, "num_latents": M, "k": s.k,
              "hookpoints": {str(layer): hookpoint(layer) for layer in s.layers},
              "reads": "mlp_norm(resid_pre + attn_out) -> mlp_out", "settings": {**s.__dict__, "layers": list(s.layers)},
              "library": f"eai-sparsify {getattr(sp, '__version__', '?')} (SparseCoder, transcode=True; Adam)",
              "memory": f"one batch of {s.batch_size} x {s.context} tokens: {2 * len(coders)} activations of width {d} "
                        f"per token ({s.batch_size * s.context * 2 * len(coders) * d * 4 / 2**20:.1f} MB as float32)",
              "steps": step, "tokens": corpus_tokens, "train_seconds": round(train_s, 2),
              "tokens_per_s": round(corpus_tokens / max(train_s, 1e-9), 1), "device": str(lm.device),
              "dead_share": {str(layer): round(float((f > dead_after).float().mean()), 6)
                             for layer, f in since_fired.items()},
              "history": history, "quality": quality, "created": time.time()}
    tc.record = record
    if not save:
        return TranscoderRun(tc, Path(), record)
    if progress is not None:
        progress(step, step, {"phase": "saving"})
    out_name = s.name or _default_name(lm.name, s, M)
    record["name"] = out_name
    dest = save_transcoders(tc, out_name, stop)
    say(f"saved {dest}")
    return TranscoderRun(tc, dest, record)


def _default_name(model: str, s: TranscoderSettings, latents: int) -> str:
    base = f"{model}-transcoders-{latents}x{s.k}"[:90]
    out, i = base, 2
    while (transcoders_dir() / out).exists():
        out, i = f"{base}-{i}", i + 1
    return out


def save_transcoders(tc: Transcoders, name: str, stop: Callable[[], bool] = lambda: False) -> Path:
    """Write the set under <data dir>/transcoders/<name>/ (staged, renamed when complete)."""
    dest = transcoders_dir() / name
    if dest.exists():
        raise FeatureError(f"A transcoder set named '{name}' already exists; choose another name.")
    checkpoints.sweep_staging("transcoders")
    stage = checkpoints.staging_dir(name, "transcoders")
    try:
        from model_core.interp import transcoder_contexts as TX

        for layer, coder in tc.coders.items():
            coder.save_to_disk(stage / hookpoint(layer))
            if tc.contexts.get(layer) is not None:
                TX.save(stage / hookpoint(layer), tc.contexts[layer], tc.labels.get(layer, []))
        (stage / "transcoders.json").write_text(json.dumps({**tc.record, "name": name}, indent=1), encoding="utf-8")
        if stop():
            raise FeaturesCancelled()
        stage.rename(dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    tc.name, tc.path = name, dest
    return dest


def load_transcoders(name: str, device="cpu") -> Transcoders:
    """A saved set by name; each layer's folder is read by sparsify's own loader."""
    if not isinstance(name, str) or not checkpoints.valid_output_name(name):
        raise FeatureError(f"{name!r} is not a transcoder set name.")
    path = transcoders_dir() / name
    if not (path / "transcoders.json").is_file():
        raise FeatureError(f"There is no transcoder set named '{name}'.")
    record = json.loads((path / "transcoders.json").read_text(encoding="utf-8"))
    from model_core.interp.transcoder_formats import DenseTranscoder, is_dense

    sp = import_sparsify()
    coders = {}
    for layer in record["layers"]:
        folder = path / hookpoint(int(layer))
        coder = (DenseTranscoder.load_from_disk(folder, device=device) if is_dense(folder)  # imported elsewhere's
                 else sp.SparseCoder.load_from_disk(folder, device=device))
        if not coder.cfg.transcode:
            raise FeatureError(f"The coder of layer {layer} in '{name}' is an autoencoder, not a transcoder.")
        coder.requires_grad_(False)
        coders[int(layer)] = coder
    from model_core.interp import transcoder_contexts as TX

    found = {int(layer): TX.load_labels(path / hookpoint(int(layer))) for layer in record["layers"]}
    return Transcoders(coders=coders, model=record["model"], name=name, record=record, path=path,
                       labels={layer: names for layer, names in found.items() if names})


def import_transcoders(src: Path, model: str | None = None, name: str | None = None, fmt: str = "auto") -> Transcoders:
    """A set written by sparsify, SAELens or circuit-tracer (model_core.interp.transcoder_formats),
    saved as an lmscope set for `model` (default: the model its files name)."""
    from model_core.interp.transcoder_formats import read_transcoders

    coders, meta = read_transcoders(Path(src), fmt)
    model = model or meta.get("model")
    if not model:
        raise FeatureError("The files do not name their model: say which with --model.")
    if name is None:
        name = f"{model}-{meta['format']}-{Path(src).name}"[:90]
    if not checkpoints.valid_output_name(name):
        raise FeatureError(f"{name!r} is not a usable set name (letters, digits, . _ -).")
    widths = {int(c.d_in) for c in coders.values()}
    if len(widths) != 1:
        raise FeatureError(f"The layers of {src} read different widths: {sorted(widths)}.")
    first = next(iter(coders.values()))
    record = {"format": FORMAT, "model": model, "layers": sorted(coders), "d_in": int(first.d_in),
              "num_latents": int(first.num_latents), "k": first.cfg.k,
              "hookpoints": {str(layer): hookpoint(layer) for layer in coders},
              "reads": "mlp_norm(resid_pre + attn_out) -> mlp_out", "quality": None,
              "imported_from": {"format": meta["format"], "path": str(src)}, "created": time.time()}
    tc = Transcoders(coders=coders, model=model, record=record)
    save_transcoders(tc, name)
    return tc


def export_transcoders(name: str, dest: Path, fmt: str) -> list[Path]:
    """The saved set `name` written under `dest` in sparsify's, SAELens' or circuit-tracer's format."""
    from model_core.interp.transcoder_formats import write_transcoders

    tc = load_transcoders(name)
    return write_transcoders(tc.coders, Path(dest), fmt, tc.model, name)


def list_transcoders() -> list[str]:
    return sorted(p.name for p in transcoders_dir().iterdir() if (p / "transcoders.json").is_file())


def replacement_edits(lm, tc: Transcoders) -> tuple[Recorder, dict]:
    """Edits that replace every MLP of the set by its transcoder (position 0 kept clean), reading
    each MLP's input from this forward's own stream (the replaced one)."""
    rec = Recorder(layers=frozenset(tc.coders))

    def replace(layer):
        def edit(name, y):
            mid = rec.store[act_name("resid_pre", layer)] + rec.store[act_name("attn_out", layer)]
            x = lm.adapter.mlp_norm(lm.adapter.layers[layer])(mid)
            out = y.clone()
            out[:, 1:] = transcode(tc.coders[layer], x[:, 1:]).to(y.dtype)
            return out
        return edit

    rec.edits = {act_name("mlp_out", layer): replace(layer) for layer in tc.coders}
    return rec, rec.edits


def evaluate(lm, tc: Transcoders, windows: torch.Tensor, *, batch_size: int = 8,
             should_stop: Callable[[], bool] | None = None) -> dict:
    """Per-layer variance explained of the MLP output, and the replacement model's CE loss, CE
    recovered and top-1 agreement, on `windows` [N, T] (positions >= 1)."""
    instrument(lm.adapter)
    d = lm.shape.d_model
    sums = {layer: {"n": 0, "sy": torch.zeros(d, dtype=torch.float64), "syy": 0.0, "see": 0.0} for layer in tc.coders}
    ce = {"clean": 0.0, "replaced": 0.0, "zero": 0.0}
    agree = preds = 0
    for b0 in range(0, windows.shape[0], batch_size):
        if should_stop is not None and should_stop():
            raise FeaturesCancelled()
        ids = windows[b0:b0 + batch_size].to(lm.device)
        for layer, (x, y) in mlp_pairs(lm, ids, tc.coders).items():
            ys, yh = y[:, 1:].reshape(-1, d), transcode(tc.coders[layer], x[:, 1:].reshape(-1, d))
            acc = sums[layer]
            acc["n"] += ys.shape[0]
            acc["sy"] += ys.double().sum(0).cpu()
            acc["syy"] += float(ys.double().pow(2).sum())
            acc["see"] += float((ys - yh).double().pow(2).sum())
        p = ids.shape[0] * (ids.shape[1] - 2)  # the predictions scored (see _next_token_ce)
        with torch.inference_mode():
            clean = lm.model(input_ids=ids, use_cache=False).logits.float()
            rec, _ = replacement_edits(lm, tc)
            with recording(rec):
                replaced = lm.model(input_ids=ids, use_cache=False).logits.float()
            zero = Recorder(capture=False, edits={act_name("mlp_out", layer): _zero_after_first for layer in tc.coders})
            with recording(zero):
                zeroed = lm.model(input_ids=ids, use_cache=False).logits.float()
        for key, logits in (("clean", clean), ("replaced", replaced), ("zero", zeroed)):
            ce[key] += _next_token_ce(logits, ids) * p
        agree += int((clean[:, 1:-1].argmax(-1) == replaced[:, 1:-1].argmax(-1)).sum())
        preds += p
    per_layer = {}
    for layer, acc in sums.items():
        var = acc["syy"] - float(acc["sy"].pow(2).sum()) / max(acc["n"], 1)
        per_layer[str(layer)] = {"explained": round(1 - acc["see"] / var, 6) if var > 0 else None}
    c = {key: v / preds for key, v in ce.items()}
    denom = c["zero"] - c["clean"]
    explained = [v["explained"] for v in per_layer.values() if v["explained"] is not None]
    positions = windows.shape[0] * (windows.shape[1] - 2)
    return {"per_layer": per_layer, "explained_mean": sum(explained) / len(explained) if explained else None,
            "ce_clean": c["clean"], "ce_replaced": c["replaced"], "ce_zero": c["zero"],
            "ce_recovered": (c["zero"] - c["replaced"]) / denom if denom > 0 else None,
            "top1_agreement": agree / max(positions, 1), "tokens": int(windows.numel())}


def quality_line(q: dict) -> str:
    """One line of a set's quality (None values left out)."""
    worst = min((v["explained"] for v in q["per_layer"].values() if v["explained"] is not None), default=None)
    parts = [("mean variance explained", q["explained_mean"]), ("worst layer", worst),
             ("replacement model CE recovered", q["ce_recovered"]), ("top-1 agreement", q["top1_agreement"])]
    return ", ".join(f"{k} {v:.3f}" for k, v in parts if v is not None)


def _zero_after_first(name, y):
    out = y.clone()
    out[:, 1:] = 0
    return out


def _next_token_ce(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean CE of predicting ids[:, t+1] from logits[:, t] for t >= 1 (position 0 predicts from the sink)."""
    lp = torch.log_softmax(logits[:, 1:-1], -1)
    return float(-lp.gather(-1, ids[:, 2:, None].to(lp.device)).mean())
