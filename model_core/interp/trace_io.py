"""A Trace as one safetensors file, and back (issue 15 item 6).

`save_trace(tr, path, settings)` writes every tensor the Trace captured under its
TransformerLens-style name (model_core.core.hook_names, where each kind's shape is documented), in the
dtype the model computed it in (bit for bit):

    blocks.{l}.hook_resid_pre, blocks.{l}.hook_attn_out, blocks.{l}.hook_mlp_out   each captured layer
    ln_final.hook_normalized
    blocks.{L}.attn.hook_pattern, blocks.{L}.mlp.hook_post   only the layer the view showed (settings["layer"])
    next_logits                  [V]            the model's logits at the last position
    token_logprobs               [T]            log p(token_t | tokens before it); NaN at t = 0
    token_ids                    [T] int64

The safetensors metadata (strings) holds `format` ("lmscope-trace"), `version`, `model`,
`n_layers`, `captured_layers`, `tokens` (each token's id, text, display, bytes, glyph span, as
model_core.core.tokenization.describe_tokens gives them) and `settings` (the view: prompt, layer, head,
query, colour scale, zoom, sampling settings ...), the last three as JSON.

`load_trace(path)` gives a SavedTrace with the same names: trace["blocks.3.hook_resid_mid"] and
"...hook_resid_post" are re-derived with the same additions Trace performs (bit-identical), and
"hook_embed" is blocks.0's input. Patterns and MLP activations of other layers need the model:
trace the prompt again. Torch + safetensors only; no model is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_core.core.errors import LmscopeError
from model_core.core.hook_names import KINDS, TRACE_LAYER_KINDS, act_name, layer_names, parse

FORMAT = "lmscope-trace"
VERSION = "1"
MAX_EXPORT_MB = 256  # a larger trace is refused (a 1,024-token SmolLM2 trace in fp32 is about 215 MB)


class TraceFileError(LmscopeError):
    pass


def trace_tensors(tr, layer: int | None = None) -> dict[str, torch.Tensor]:
    """The tensors save_trace writes (on their own device, not copied): every captured one, plus
    the attention pattern and MLP activation of `layer` when it is a captured layer."""
    out: dict[str, torch.Tensor] = {}
    for l in tr.captured_layers:
        out[act_name("resid_pre", l)] = tr.resid_pre[l]
        out[act_name("attn_out", l)] = tr.attn_out[l]
        out[act_name("mlp_out", l)] = tr.mlp_out[l]
    out[act_name("ln_final")] = tr.ln_final
    out["next_logits"] = tr.next_logits
    out["token_logprobs"] = tr.token_logprobs
    out["token_ids"] = torch.tensor(tr.token_ids, dtype=torch.int64)
    if layer is not None and layer in tr.resid_pre:
        out[act_name("pattern", layer)] = tr.attention_pattern(layer)
        out[act_name("post", layer)] = tr.mlp_post(layer)
    return out


def export_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _cap_sentence(n_bytes: int, max_mb: float) -> str:
    return (f"This trace's tensors are {n_bytes / 2**20:.0f} MB; a tensor export stops at {max_mb:g} MB, so trace "
            f"a shorter prompt to export it.")


def check_size(tr, layer: int | None = None, max_mb: float = MAX_EXPORT_MB) -> int:
    """Bytes of tensor data the export would write, before computing anything; one sentence when
    it is over max_mb."""
    n = export_bytes(trace_tensors(tr, None))
    lm = getattr(tr, "lm", None)
    if layer is not None and layer in tr.resid_pre and lm is not None:  # the view's pattern and MLP activation
        T, s = tr.n_tokens, lm.shape
        n += (s.n_heads * T * T + T * s.d_mlp) * tr.ln_final.element_size()
    if n > max_mb * 2**20:
        raise TraceFileError(_cap_sentence(n, max_mb))
    return n


def save_trace(tr, path, settings: dict | None = None, *, max_mb: float = MAX_EXPORT_MB) -> Path:
    """Write `tr` to `path` (.safetensors); returns the path. settings: the view (JSON-able);
    settings["layer"], when given, also saves that layer's pattern and MLP activation."""
    from safetensors.torch import save_file

    settings = dict(settings or {})
    layer = settings.get("layer")
    layer = int(layer) if isinstance(layer, (int, float)) and not isinstance(layer, bool) else None
    check_size(tr, layer, max_mb)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in trace_tensors(tr, layer).items()}
    n = export_bytes(tensors)
    if n > max_mb * 2**20:
        raise TraceFileError(_cap_sentence(n, max_mb))
    first = next(iter(tr.resid_pre.values()), tr.ln_final)
    meta = {
        "format": FORMAT, "version": VERSION, "model": str(tr.model_name), "n_layers": str(tr.n_layers),
        "captured_layers": json.dumps(list(tr.captured_layers)), "dtype": str(first.dtype).replace("torch.", ""),
        "device": str(first.device), "tokens": json.dumps(tr.tokens, ensure_ascii=False),
        "settings": json.dumps(settings, ensure_ascii=False, default=str),
    }
    path = Path(path)
    # safetensors refuses tensors that share memory: a view of another saved tensor gets its own copy
    seen: set[int] = set()
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen:
            tensors[k] = v.clone()
        seen.add(tensors[k].untyped_storage().data_ptr())
    save_file(tensors, str(path), metadata=meta)
    return path


@dataclass
class SavedTrace:
    """A Trace read back from a file: the captured tensors under their names, the tokens, the
    model id and the view settings. No model is attached."""

    model_name: str
    token_ids: list[int]
    tokens: list[dict]
    n_layers: int
    captured_layers: list[int]
    settings: dict
    tensors: dict[str, torch.Tensor]
    metadata: dict = field(default_factory=dict, repr=False)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def _layer_dict(self, kind: str) -> dict[int, torch.Tensor]:
        return {l: self.tensors[act_name(kind, l)] for l in self.captured_layers}

    @property
    def resid_pre(self) -> dict[int, torch.Tensor]:
        return self._layer_dict("resid_pre")

    @property
    def attn_out(self) -> dict[int, torch.Tensor]:
        return self._layer_dict("attn_out")

    @property
    def mlp_out(self) -> dict[int, torch.Tensor]:
        return self._layer_dict("mlp_out")

    @property
    def ln_final(self) -> torch.Tensor:
        return self.tensors[act_name("ln_final")]

    @property
    def next_logits(self) -> torch.Tensor:
        return self.tensors["next_logits"]

    @property
    def token_logprobs(self) -> torch.Tensor:
        return self.tensors["token_logprobs"]

    def resid_mid(self, layer: int) -> torch.Tensor:  # the additions Trace performs, in its order
        return self.tensors[act_name("resid_pre", layer)] + self.tensors[act_name("attn_out", layer)]

    def resid_post(self, layer: int) -> torch.Tensor:
        return self.resid_mid(layer) + self.tensors[act_name("mlp_out", layer)]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.tensors:
            return self.tensors[name]
        kind, layer = parse(name)  # an unknown name raises here (a KeyError)
        if kind == "embed":
            return self[act_name("resid_pre", 0)]
        if layer in self.captured_layers and kind in ("resid_mid", "resid_post"):
            return self.resid_mid(layer) if kind == "resid_mid" else self.resid_post(layer)
        if not KINDS[kind].in_trace:
            raise KeyError(f"'{name}' is an edit point of the forward pass; no trace keeps it")
        if kind == "logits":
            raise KeyError("'logits' is not in this file (it keeps next_logits, the last position's)")
        raise KeyError(f"'{name}' is not in this file (patterns and MLP activations are saved for the viewed "
                       f"layer only; captured layers: {self.captured_layers})")

    def __contains__(self, name: str) -> bool:
        try:
            self[name]
        except KeyError:
            return False
        return True

    def hook_names(self) -> list[str]:
        names = [act_name("embed")] if 0 in self.captured_layers else []
        names += layer_names(TRACE_LAYER_KINDS, self.captured_layers)
        return [n for n in names if n in self] + [act_name("ln_final"), "next_logits", "token_logprobs"]


def load_trace(path, device: str | torch.device = "cpu") -> SavedTrace:
    """Read a file save_trace wrote (the Explore tab's "Export tensors" download)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") != FORMAT:
                raise TraceFileError(f"{Path(path).name} is not an lmscope trace file (no '{FORMAT}' metadata).")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise TraceFileError(f"Could not read {Path(path).name} as a safetensors file ({e}).") from None
    return SavedTrace(
        model_name=meta.get("model", ""), token_ids=[int(i) for i in tensors["token_ids"].tolist()],
        tokens=json.loads(meta.get("tokens") or "[]"), n_layers=int(meta.get("n_layers") or 0),
        captured_layers=[int(l) for l in json.loads(meta.get("captured_layers") or "[]")],
        settings=json.loads(meta.get("settings") or "{}"), tensors=tensors, metadata=meta)
