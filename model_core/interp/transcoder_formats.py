"""Transcoder sets in the formats the ecosystem reads, so a set trained elsewhere opens in lmscope
and one trained here opens elsewhere.

  sparsify        EleutherAI's trainer layout: `layers.<l>.mlp/{cfg.json, sae.safetensors}` (cfg with
                  "transcode": true). lmscope's own sets are this layout (TopK coders).
  saelens         SAELens: one folder per layer with cfg.json (architecture transcoder, skip_transcoder,
                  jumprelu_transcoder or jumprelu_skip_transcoder) and sae_weights.safetensors holding
                  W_enc [d_in, d_sae], b_enc, W_dec [d_sae, d_out], b_dec, and W_skip [d_out, d_in],
                  threshold [d_sae] where the architecture has them. SAELens has no TopK transcoder.
  circuit-tracer  Anthropic's circuit-tracer: `layer_<l>.safetensors` with W_enc [d_sae, d_model],
                  W_dec [d_sae, d_model], b_enc, b_dec, and optionally W_skip [d_model, d_model] and
                  activation_function.threshold (JumpReLU); config.yaml names the model, the hooks
                  (mlp.hook_in -> mlp.hook_out), the files and the activation (relu, or topk with k).

A coder read from SAELens or circuit-tracer becomes a `DenseTranscoder`: the surface lmscope uses
from sparsify's SparseCoder (encoder, W_dec, b_dec, W_skip, encode, decode), with the library's own
activation. Imported sets are saved as lmscope sets (model_core.interp.transcoders), each layer in
circuit-tracer's tensor layout beside a cfg.json that names the activation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from model_core.interp.features_sae import FeatureError

SPARSIFY, SAELENS, CIRCUIT_TRACER = "sparsify", "saelens", "circuit-tracer"
FORMATS = (SPARSIFY, SAELENS, CIRCUIT_TRACER)
# topk: circuit-tracer's (the k largest pre-activations, signed); relu_topk: sparsify's (ReLU, then the k largest)
ACTIVATIONS = ("relu", "jumprelu", "topk", "relu_topk")
DENSE_MARK = "lmscope_dense_transcoder"  # in a layer's cfg.json: read by DenseTranscoder, not sparsify
SAELENS_ARCHS = {"transcoder": ("relu", False), "skip_transcoder": ("relu", True),
                 "jumprelu_transcoder": ("jumprelu", False), "jumprelu_skip_transcoder": ("jumprelu", True)}


class Encoded(NamedTuple):
    top_acts: torch.Tensor  # [rows, n] the active features' activations (zeros pad short rows)
    top_indices: torch.Tensor  # [rows, n]
    pre_acts: torch.Tensor  # [rows, F]


class DenseTranscoder(nn.Module):
    """acts = activation(x W_enc^T + b_enc); out = acts W_dec + b_dec (+ x W_skip^T). The activation
    is ReLU, JumpReLU (x * (x > threshold), circuit-tracer's form) or TopK."""

    def __init__(self, W_enc: torch.Tensor, b_enc: torch.Tensor, W_dec: torch.Tensor, b_dec: torch.Tensor, *,
                 W_skip: torch.Tensor | None = None, threshold: torch.Tensor | None = None,
                 activation: str = "relu", k: int | None = None):
        super().__init__()
        F_, d = W_enc.shape
        if activation not in ACTIVATIONS:
            raise FeatureError(f"A transcoder's activation must be one of {', '.join(ACTIVATIONS)}, not {activation!r}.")
        if tuple(W_dec.shape) != (F_, d) or tuple(b_enc.shape) != (F_,) or tuple(b_dec.shape) != (d,):
            raise FeatureError(f"The transcoder's weights disagree in shape: W_enc {tuple(W_enc.shape)}, W_dec "
                               f"{tuple(W_dec.shape)}, b_enc {tuple(b_enc.shape)}, b_dec {tuple(b_dec.shape)} "
                               "(lmscope reads transcoders whose output is as wide as their input).")
        if W_skip is not None and tuple(W_skip.shape) != (d, d):
            raise FeatureError(f"The skip connection is {tuple(W_skip.shape)}, not {(d, d)}.")
        if activation == "jumprelu" and (threshold is None or tuple(threshold.shape) != (F_,)):
            raise FeatureError(f"A JumpReLU transcoder needs a threshold per feature ({F_}).")
        if activation in ("topk", "relu_topk") and not (isinstance(k, int) and 0 < k <= F_):
            raise FeatureError(f"A TopK transcoder needs k between 1 and {F_}.")
        self.encoder = nn.Linear(d, F_)
        with torch.no_grad():
            self.encoder.weight.copy_(W_enc.float())  # [F, d], as sparsify's encoder
            self.encoder.bias.copy_(b_enc.float())
        self.W_dec = nn.Parameter(W_dec.float().clone())
        self.b_dec = nn.Parameter(b_dec.float().clone())
        self.W_skip = nn.Parameter(W_skip.float().clone()) if W_skip is not None else None
        self.register_buffer("threshold", threshold.float().clone() if threshold is not None else None)
        self.activation, self.k = activation, k if activation in ("topk", "relu_topk") else None
        self.cfg = SimpleNamespace(transcode=True, k=self.k, activation=activation, skip_connection=W_skip is not None)

    @property
    def d_in(self) -> int:
        return self.encoder.in_features

    @property
    def num_latents(self) -> int:
        return self.encoder.out_features

    @property
    def device(self) -> torch.device:
        return self.W_dec.device

    @property
    def dtype(self) -> torch.dtype:
        return self.W_dec.dtype

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        if self.activation == "relu":
            return torch.relu(pre)
        if self.activation == "jumprelu":
            return pre * (pre > self.threshold)
        x = torch.relu(pre) if self.activation == "relu_topk" else pre
        top = x.topk(self.k, dim=-1)
        return torch.zeros_like(pre).scatter_(-1, top.indices, top.values)

    def encode(self, x: torch.Tensor) -> Encoded:
        """x [rows, d] -> the active features of each row, as many columns as the busiest row has."""
        pre = self.encoder(x.to(self.dtype))
        acts = self.activate(pre)
        n = max(1, int((acts != 0).sum(-1).max())) if acts.numel() else 1
        idx = acts.abs().topk(n, dim=-1, sorted=False).indices  # by magnitude: TopK and JumpReLU can be negative
        return Encoded(acts.gather(-1, idx), idx, pre)

    def decode(self, top_acts: torch.Tensor, top_indices: torch.Tensor) -> torch.Tensor:
        dense = torch.zeros(*top_acts.shape[:-1], self.num_latents, dtype=self.dtype, device=self.device)
        dense.scatter_(-1, top_indices, top_acts.to(self.dtype))
        return dense @ self.W_dec + self.b_dec

    def tensors(self) -> dict[str, torch.Tensor]:
        """circuit-tracer's keys and shapes."""
        out = {"W_enc": self.encoder.weight, "b_enc": self.encoder.bias, "W_dec": self.W_dec, "b_dec": self.b_dec}
        if self.W_skip is not None:
            out["W_skip"] = self.W_skip
        if self.threshold is not None:
            out["activation_function.threshold"] = self.threshold
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}

    def save_to_disk(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors(), str(path / "weights.safetensors"))
        (path / "cfg.json").write_text(json.dumps({DENSE_MARK: 1, "activation": self.activation, "k": self.k,
                                                   "d_in": self.d_in, "num_latents": self.num_latents}),
                                       encoding="utf-8")

    @classmethod
    def load_from_disk(cls, path: Path, device="cpu") -> DenseTranscoder:
        cfg = json.loads((Path(path) / "cfg.json").read_text(encoding="utf-8"))
        return from_circuit_tracer_tensors(load_file(str(Path(path) / "weights.safetensors")),
                                           cfg["activation"], cfg.get("k")).to(device)


def is_dense(path: Path) -> bool:
    try:
        return bool(json.loads((Path(path) / "cfg.json").read_text(encoding="utf-8")).get(DENSE_MARK))
    except (OSError, ValueError, AttributeError):
        return False


def from_circuit_tracer_tensors(t: dict, activation: str | None = None, k: int | None = None) -> DenseTranscoder:
    missing = [key for key in ("W_enc", "W_dec", "b_enc", "b_dec") if key not in t]
    if missing:
        raise FeatureError(f"The transcoder file has no {', '.join(missing)}: not circuit-tracer's layout.")
    thr = t.get("activation_function.threshold", t.get("threshold"))
    if "k" in t and k is None:
        k = int(t["k"])
    activation = activation or ("topk" if k else "jumprelu" if thr is not None else "relu")
    return DenseTranscoder(t["W_enc"], t["b_enc"], t["W_dec"], t["b_dec"], W_skip=t.get("W_skip"),
                           threshold=thr if activation == "jumprelu" else None, activation=activation, k=k)


# --- reading -------------------------------------------------------------------------------------

_LAYER = re.compile(r"(?:blocks|layers?)[._](\d+)")


def detect_format(src: Path) -> str:
    src = Path(src)
    if not src.is_dir():
        raise FeatureError(f"{src} is not a folder of transcoders.")
    if (src / "config.yaml").is_file() or any(src.glob("layer_*.safetensors")):
        return CIRCUIT_TRACER
    if any(src.glob("layers.*/sae.safetensors")) or (src / "sae.safetensors").is_file():
        return SPARSIFY
    if (src / "sae_weights.safetensors").is_file() or any(src.glob("*/sae_weights.safetensors")):
        return SAELENS
    raise FeatureError(f"{src} holds no transcoder lmscope can read (sparsify's layers.<l>.mlp/, SAELens' "
                       "cfg.json + sae_weights.safetensors, or circuit-tracer's layer_<l>.safetensors).")


def read_transcoders(src: Path, fmt: str = "auto", device="cpu") -> tuple[dict[int, nn.Module], dict]:
    """A folder in one of FORMATS -> ({layer: coder}, what the files say: model name, format)."""
    src = Path(src)
    fmt = detect_format(src) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise FeatureError(f"The format must be one of auto, {', '.join(FORMATS)}; not {fmt!r}.")
    reader = {SPARSIFY: _read_sparsify, SAELENS: _read_saelens, CIRCUIT_TRACER: _read_circuit_tracer}[fmt]
    try:
        coders, meta = reader(src)
    except FeatureError:
        raise
    except Exception as e:  # a missing key, a file that is not safetensors, a config of the wrong shape
        raise FeatureError(f"{src} could not be read as a {fmt} transcoder set ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'}).") from None
    if not coders:
        raise FeatureError(f"No transcoder was found in {src} in {fmt}'s layout.")
    return {layer: c.to(device).requires_grad_(False) for layer, c in coders.items()}, {**meta, "format": fmt}


def _layer_of(name: str, fallback: int | None = None) -> int:
    m = _LAYER.search(name)
    if m:
        return int(m.group(1))
    if fallback is not None:
        return fallback
    raise FeatureError(f"Cannot tell which layer {name!r} belongs to (expected a name like blocks.5 or layer_5).")


def _read_sparsify(src: Path):
    from model_core.interp.features_sae import import_sparsify

    sp = import_sparsify()
    folders = [src] if (src / "sae.safetensors").is_file() else sorted(src.glob("layers.*"))
    coders = {}
    for f in folders:
        if not (f / "sae.safetensors").is_file():
            continue
        c = sp.SparseCoder.load_from_disk(f, device="cpu")
        if not c.cfg.transcode:
            raise FeatureError(f"{f.name} is a sparse autoencoder, not a transcoder (its cfg.json has transcode false).")
        coders[_layer_of(f.name, 0 if f == src else None)] = c
    return coders, {}


def _read_saelens(src: Path):
    folders = [src] if (src / "sae_weights.safetensors").is_file() else sorted(
        p.parent for p in src.glob("*/sae_weights.safetensors"))
    coders, model = {}, None
    for f in folders:
        try:
            cfg = json.loads((f / "cfg.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise FeatureError(f"{f.name}/cfg.json is missing or not JSON.") from None
        arch = cfg.get("architecture", "standard")
        if arch not in SAELENS_ARCHS:
            raise FeatureError(f"{f.name} is a SAELens '{arch}', not a transcoder ({', '.join(SAELENS_ARCHS)}).")
        if cfg.get("normalize_activations", "none") not in (None, "none"):
            raise FeatureError(f"{f.name} normalizes its input ({cfg['normalize_activations']}); lmscope reads "
                               "transcoders on the raw MLP input only.")
        meta = cfg.get("metadata") or {}
        hook = meta.get("hook_name") or cfg.get("hook_name") or ""
        layer = cfg["hook_layer"] if isinstance(cfg.get("hook_layer"), int) else _layer_of(hook or f.name)
        model = model or meta.get("model_name") or cfg.get("model_name")
        activation, skip = SAELENS_ARCHS[arch]
        t = load_file(str(f / "sae_weights.safetensors"))
        if skip and "W_skip" not in t:
            raise FeatureError(f"{f.name} is a '{arch}' without W_skip.")
        thr = t.get("threshold")
        if activation == "jumprelu":
            if thr is None:
                raise FeatureError(f"{f.name} is a '{arch}' without its threshold.")
            thr = thr.clamp(min=0)  # SAELens: relu(pre) * (pre > t) == pre * (pre > max(t, 0))
        coders[layer] = DenseTranscoder(t["W_enc"].mT, t["b_enc"], t["W_dec"], t["b_dec"], W_skip=t.get("W_skip"),
                                        threshold=thr, activation=activation)
    return coders, {"model": model}


def _read_circuit_tracer(src: Path):
    cfg = {}
    if (src / "config.yaml").is_file():
        import yaml

        try:
            cfg = yaml.safe_load((src / "config.yaml").read_text(encoding="utf-8")) or {}
        except yaml.YAMLError:
            raise FeatureError("config.yaml is not YAML.") from None
    if not isinstance(cfg, dict):
        raise FeatureError("config.yaml is not a mapping of settings.")
    if cfg.get("model_kind", "transcoder_set") != "transcoder_set":
        raise FeatureError(f"config.yaml describes a {cfg['model_kind']}; lmscope reads per-layer transcoder sets.")
    if "transcoders" in cfg:
        paths = {}
        for i, p in enumerate(cfg["transcoders"]):
            if str(p).startswith("hf://"):
                raise FeatureError(f"config.yaml points at {p}: download the files next to it first "
                                   "(lmscope reads local files only).")
            q = Path(p) if Path(p).is_absolute() else src / p
            paths[_layer_of(q.name, i)] = q  # circuit-tracer numbers them by place; a layer_<l> name says it
    else:
        paths = {_layer_of(p.name): p for p in src.glob("layer_*.safetensors")}
    coders = {}
    for layer, p in sorted(paths.items()):
        if not p.is_file():
            raise FeatureError(f"{p.name}, named in config.yaml, is not in {src}.")
        coders[layer] = from_circuit_tracer_tensors(load_file(str(p)), cfg.get("activation"), cfg.get("k"))
    return coders, {"model": cfg.get("model_name")}


# --- writing -------------------------------------------------------------------------------------

def as_dense(coder) -> DenseTranscoder:
    """Any coder lmscope holds, as a DenseTranscoder (a sparsify coder: ReLU, then its k largest)."""
    if isinstance(coder, DenseTranscoder):
        return coder
    return DenseTranscoder(coder.encoder.weight.detach(), coder.encoder.bias.detach(), coder.W_dec.detach(),
                           coder.b_dec.detach(), W_skip=None if coder.W_skip is None else coder.W_skip.detach(),
                           activation="relu_topk", k=int(coder.cfg.k))


def write_transcoders(coders: dict[int, nn.Module], dest: Path, fmt: str, model: str, name: str = "") -> list[Path]:
    """Write the set under `dest` (which must not exist yet) in `fmt`; the files written."""
    dest = Path(dest)
    if fmt not in FORMATS:
        raise FeatureError(f"The format must be one of {', '.join(FORMATS)}; not {fmt!r}.")
    dense = {layer: as_dense(c) for layer, c in coders.items()}
    if fmt == SAELENS and any(c.activation in ("topk", "relu_topk") for c in dense.values()):
        raise FeatureError("SAELens has no TopK transcoder, and this set is TopK: export it as "
                           "circuit-tracer or sparsify, which read TopK.")
    if fmt == CIRCUIT_TRACER:
        if sorted(coders) != list(range(len(coders))):
            raise FeatureError(f"circuit-tracer reads a transcoder for every layer from 0 on; this set has layers "
                               f"{sorted(coders)}. Train one with --layers all to export it there.")
        if len({c.activation for c in dense.values()}) > 1:
            raise FeatureError("circuit-tracer reads one activation per set; this one mixes "
                               f"{sorted({c.activation for c in dense.values()})}.")
    if dest.exists() and any(dest.iterdir()):
        raise FeatureError(f"{dest} already exists and is not empty; choose a new folder.")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    if fmt == SPARSIFY:
        for layer, c in sorted(coders.items()):
            if isinstance(c, DenseTranscoder):
                raise FeatureError("sparsify's layout holds TopK coders trained by sparsify; this set came from "
                                   f"another library ({c.activation}): export it as saelens or circuit-tracer.")
            c.save_to_disk(dest / f"layers.{layer}.mlp")
            written.append(dest / f"layers.{layer}.mlp")
    elif fmt == SAELENS:
        for layer, c in sorted(dense.items()):
            written.append(_write_saelens_layer(c, dest / f"layer_{layer}", layer, model, name))
    else:
        files = []
        for layer, c in sorted(dense.items()):
            save_file(c.tensors(), str(dest / f"layer_{layer}.safetensors"))
            files.append(f"layer_{layer}.safetensors")
        acts = {c.activation for c in dense.values()}
        ks = {c.k for c in dense.values()}
        cfg = {"model_name": model, "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
               "feature_output_hook": "mlp.hook_out", "scan": name or model,
               "transcoders": files}  # relative to this folder: pass them to load_transcoder_set from here
        if acts & {"topk", "relu_topk"}:  # sparsify's ReLU-then-TopK is circuit-tracer's TopK wherever a row
            cfg.update(activation="topk", k=int(next(iter(ks))))  # has k positive pre-activations (README)
        elif acts == {"relu"}:
            cfg["activation"] = "relu"
        import yaml

        (dest / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        written += [dest / f for f in files] + [dest / "config.yaml"]
    return written


def _write_saelens_layer(c: DenseTranscoder, folder: Path, layer: int, model: str, name: str) -> Path:
    folder.mkdir(parents=True)
    skip = c.W_skip is not None
    arch = {("relu", False): "transcoder", ("relu", True): "skip_transcoder", ("jumprelu", False): "jumprelu_transcoder",
            ("jumprelu", True): "jumprelu_skip_transcoder"}[(c.activation, skip)]
    t = {"W_enc": c.encoder.weight.detach().mT, "b_enc": c.encoder.bias.detach(), "W_dec": c.W_dec.detach(),
         "b_dec": c.b_dec.detach()}
    if skip:
        t["W_skip"] = c.W_skip.detach()
    if c.activation == "jumprelu":
        t["threshold"] = c.threshold
    save_file({k: v.cpu().float().contiguous() for k, v in t.items()}, str(folder / "sae_weights.safetensors"))
    cfg = {"architecture": arch, "d_in": c.d_in, "d_sae": c.num_latents, "d_out": c.d_in, "dtype": "float32",
           "device": "cpu", "apply_b_dec_to_input": False, "normalize_activations": "none",
           "reshape_activations": "none",
           "metadata": {"model_name": model, "hook_name": f"blocks.{layer}.ln2.hook_normalized",
                        "hook_name_out": f"blocks.{layer}.hook_mlp_out", "sae_lens_training_version": None,
                        "exported_by": "lmscope", "set": name}}
    (folder / "cfg.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    return folder
