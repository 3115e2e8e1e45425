"""The sparse autoencoder and where it reads: the hook point (checked against the model), the
forward pass that stops there (`capture`, its batch counted by `ActivationBuffer`), the trained
autoencoder with its record (`Features`), and its encode / decode.

The autoencoder is EleutherAI's `SparseCoder` (package eai-sparsify, import `sparsify`); the
overview of the whole feature pipeline is model_core.interp.features.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_core.core.errors import SettingsError
from model_core.core.hook_names import UnknownHookName, act_name, parse
from model_core.core.hooks import Recorder, instrument, recording

HOOK_KINDS = ("resid_pre", "resid_post", "attn_out", "mlp_out")
FORMAT = "lmscope-features"
DEFAULT_CONTEXT = 128
DEFAULT_BATCH = 8


class FeatureError(SettingsError):
    """A bad layer, hook, width or setting of a feature run: one sentence."""


class FeaturesCancelled(Exception):
    """should_stop() asked the run to stop; nothing was saved."""


def import_sparsify():
    """The sparsify package (imported on first use: ~10 s; its import prints which decoder it uses)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import sparsify
    return sparsify


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
    sp = import_sparsify()
    torch.manual_seed(int(seed))
    cfg = sp.SparseCoderConfig(expansion_factor=int(expansion_factor), num_latents=int(num_latents), k=int(k))
    return sp.SparseCoder(d_in, cfg, device=device, dtype=torch.float32)


def sae_encode(sae, x: torch.Tensor):
    """[..., d] -> (top_acts [rows, k] float32, top_indices [rows, k]) on the autoencoder's device."""
    with torch.no_grad():
        enc = sae.encode(x.reshape(-1, x.shape[-1]).to(sae.device, torch.float32))
    return enc.top_acts.float(), enc.top_indices


def sae_decode(sae, acts: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(top_acts, top_indices) of sae_encode -> the reconstruction [rows, d] (float32)."""
    with torch.no_grad():
        return sae.decode(acts, idx).float()


def reconstruct(sae, x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> the autoencoder's reconstruction [..., d] (float32; = its forward's sae_out)."""
    return sae_decode(sae, *sae_encode(sae, x)).reshape(x.shape)
