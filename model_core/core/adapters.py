"""One small adapter per model family: where the hooks go and how to recompute a layer's
attention pattern / MLP activation from that layer's captured residual input.

Everything above this file (Trace, views, lens) sees the same shapes whatever the family:
  resid [T, d_model]; pattern [heads, T, T]; mlp hidden [T, d_mlp].
The residual stream is captured as "what each block adds" (attn_out, mlp_out) so resid_pre,
resid_mid and resid_post are re-derived with the exact additions the model performs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from operator import attrgetter

import torch
from torch import nn

from model_core.core.errors import ModelLoadError


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer of any family (LayerNorm, RMSNorm, LlamaRMSNorm, Gemma3RMSNorm, ...)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    vocab_size: int
    context_length: int


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, d_head]; cos/sin [T, d_head] (the same rotate-half convention as HF Llama)."""
    return (x * cos) + (_rotate_half(x) * sin)


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, n_tokens: int = 1,
                   bytes_per_value: int = 2) -> int:
    """The KV-cache formula: 2 (K and V) x layers x kv_heads x head_dim x tokens x bytes per value."""
    return 2 * n_layers * n_kv_heads * head_dim * n_tokens * bytes_per_value


@dataclass(frozen=True)
class Attention:
    """One layer's attention (Adapter.attend): q [H, Q, dh] of the query rows; k [H, T, dh] repeated
    per query head; v [H_kv, T, dh] as projected; raw and scaled scores [H, Q, T]; mask [Q, T]
    (True = may attend); probs [H, Q, T], the softmax in float32."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    raw_scores: torch.Tensor
    scaled_scores: torch.Tensor
    mask: torch.Tensor
    probs: torch.Tensor

    @property
    def pattern(self) -> torch.Tensor:
        """The softmax in the model's dtype (what the model's own attention multiplies v by)."""
        return self.probs.to(self.q.dtype)


@dataclass(frozen=True)
class ModulePaths:
    """Where a family keeps its modules, as dotted attribute paths: `layers`, `final_norm` and
    `embed` from the model, the rest from one decoder layer."""
    layers: str
    final_norm: str
    embed: str
    attn_out: str  # its output (first element) is exactly what attention adds to the residual
    mlp_out: str
    attn_norm: str
    mlp_norm: str
    attn_z: str  # the output projection; its input holds every head's result side by side
    mlp_post: str  # the MLP's down projection; its input is the neuron activation (mlp.hook_post)


class _Located:
    """An adapter attribute read from its family's ModulePaths field: in_layer, a function
    (layer) -> the module at that path in one decoder layer; else the model's module itself."""

    def __init__(self, field: str, in_layer: bool = True):
        self.field, self.in_layer = field, in_layer

    def __get__(self, adapter, owner=None):
        if adapter is None:
            return self
        get = attrgetter(getattr(adapter.paths, self.field))
        return get if self.in_layer else get(adapter.model)


class Adapter:
    """Base: subclasses name the modules; shared math lives here."""

    family = "base"
    uses_rope = True

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config

    # --- where things are (each family's ModulePaths) -----------------------
    paths: ModulePaths
    attn_out_module = _Located("attn_out")  # (layer) -> its output (first element) is what attention adds
    mlp_out_module = _Located("mlp_out")
    attn_norm = _Located("attn_norm")
    mlp_norm = _Located("mlp_norm")
    attn_z_module = _Located("attn_z")  # its input holds every head's result side by side (attn.hook_z)
    mlp_post_module = _Located("mlp_post")  # its input is the neuron activation (edit hook mlp.hook_post)
    final_norm = _Located("final_norm", in_layer=False)
    embed_tokens = _Located("embed", in_layer=False)

    @property
    def layers(self) -> list[nn.Module]:
        return list(attrgetter(self.paths.layers)(self.model))

    @property
    def unembed(self) -> nn.Module:
        return self.model.lm_head

    def shape(self) -> ModelShape:
        raise NotImplementedError

    # --- recomputation from captured inputs --------------------------------
    def qkv(self, layer_idx: int, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: normalised residual [T, d]. Returns q [H, T, dh], k and v [H_kv, T, dh] (after RoPE)."""
        raise NotImplementedError

    def attention_scale(self, layer_idx: int) -> float:
        raise NotImplementedError

    def sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer `layer_idx`'s attention, or None. Families with `layer_types` (Gemma,
        Qwen2/3, ...) slide only on their "sliding_attention" layers; families without (Mistral)
        pass `config.sliding_window` to every layer's attention, as transformers' masks do."""
        window = getattr(self.config, "sliding_window", None)
        types = getattr(self.config, "layer_types", None)
        if types is not None:
            return window if types[layer_idx] == "sliding_attention" else None
        if getattr(self.config, "use_sliding_window", True) is False:
            return None
        return window or None

    def attn_logit_softcap(self) -> float | None:
        return None

    def mlp_hidden(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """x: normalised residual [T, d] -> the activation that feeds the MLP's down projection."""
        raise NotImplementedError

    def logits_from_normed(self, normed: torch.Tensor) -> torch.Tensor:
        return self.unembed(normed)

    def logits_slice(self, normed: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
        """logits_from_normed(normed)[:, v0:v1] without computing the rest of the vocabulary."""
        u = self.unembed
        bias = None if u.bias is None else u.bias[v0:v1]
        return self._cap_logits(torch.nn.functional.linear(normed, u.weight[v0:v1], bias))

    def logits_at(self, normed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """normed [R, d], ids [R, 1] -> [R, 1]: each row's logit for its own token id."""
        u = self.unembed
        w = u.weight[ids[:, 0]].to(normed.dtype)
        out = (normed * w).sum(-1, keepdim=True)
        if u.bias is not None:
            out = out + u.bias[ids[:, 0]][:, None]
        return self._cap_logits(out)

    def final_logit_softcap(self) -> float | None:
        """Gemma's final logit softcapping (logits -> tanh(logits / cap) * cap), or None."""
        return None

    def _cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.final_logit_softcap()
        return torch.tanh(logits / cap) * cap if cap else logits

    def logits_from_resid(self, resid: torch.Tensor) -> torch.Tensor:
        """Logit lens: the residual stream through the model's own final norm and unembedding."""
        return self.logits_from_normed(self.final_norm(resid))

    def causal_mask(self, layer_idx: int, T: int, device) -> torch.Tensor:
        """Boolean [T, T], True where query i may attend to key j."""
        i = torch.arange(T, device=device)[:, None]
        j = torch.arange(T, device=device)[None, :]
        allowed = j <= i
        window = self.sliding_window(layer_idx)
        if window is not None:
            allowed = allowed & (j > i - window)
        return allowed

    def attend(self, layer_idx: int, x: torch.Tensor, rope, queries: torch.Tensor | None = None) -> Attention:
        """The one computation of a layer's attention, from its normalised input x [T, d]: q, k and v
        by the model's own projections, the scores of the query rows (every position, or the
        positions in `queries`) over every key, scaled and soft-capped as the model does, the causal
        (and sliding-window) mask, and the softmax in float32. The pattern, the Anatomy steps and
        Generate's attention rows are all read from this."""
        q, k, v = self.qkv(layer_idx, x, rope)
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        mask = self.causal_mask(layer_idx, x.shape[0], x.device)
        if queries is not None:
            q, mask = q[:, queries], mask[queries]
        raw = torch.matmul(q, k.transpose(-1, -2))
        scaled = raw * self.attention_scale(layer_idx)
        cap = self.attn_logit_softcap()
        if cap:
            scaled = torch.tanh(scaled / cap) * cap
        probs = torch.softmax(scaled.masked_fill(~mask, float("-inf")).float(), dim=-1)
        return Attention(q=q, k=k, v=v, raw_scores=raw, scaled_scores=scaled, mask=mask, probs=probs)

    def attention(self, layer_idx: int, resid_pre: torch.Tensor, rope, queries: torch.Tensor | None = None
                  ) -> Attention:
        """attend() from the layer's residual input [T, d] (through the layer's own attention norm)."""
        return self.attend(layer_idx, self.attn_norm(self.layers[layer_idx])(resid_pre), rope, queries)

    def attention_pattern(self, layer_idx: int, resid_pre: torch.Tensor, rope) -> torch.Tensor:
        """[heads, T, T] in the model's dtype: row i is where query i attends."""
        return self.attention(layer_idx, resid_pre, rope).pattern

    def attention_scores(self, layer_idx: int, resid_pre: torch.Tensor, rope) -> dict[str, torch.Tensor]:
        """Every step of one layer's attention for one sequence (the anatomy view). resid_pre: [T, d]."""
        layer = self.layers[layer_idx]
        return self.attention_from_normed(layer_idx, self.attn_norm(layer)(resid_pre), rope)

    def attention_from_normed(self, layer_idx: int, x: torch.Tensor, rope) -> dict[str, torch.Tensor]:
        """attention_scores from the already normalised input x [T, d] (the Anatomy norm check
        feeds its hand-normalised vectors through the rest of the layer's attention)."""
        a = self.attend(layer_idx, x, rope)
        pattern = a.pattern
        v = a.v.repeat_interleave(a.q.shape[0] // a.v.shape[0], dim=0)
        return {"x_normed": x, "q": a.q, "k": a.k, "v": v, "raw_scores": a.raw_scores,
                "scaled_scores": a.scaled_scores, "mask": a.mask, "pattern": pattern, "z": torch.matmul(pattern, v)}


class LlamaAdapter(Adapter):
    """Llama family: SmolLM2, Llama 2/3, Mistral, Qwen2, Qwen3 (RMSNorm, RoPE, GQA, SwiGLU)."""

    family = "llama"
    paths = ModulePaths(layers="model.layers", final_norm="model.norm", embed="model.embed_tokens",
                        attn_out="self_attn", mlp_out="mlp", attn_norm="input_layernorm",
                        mlp_norm="post_attention_layernorm", attn_z="self_attn.o_proj", mlp_post="mlp.down_proj")

    def shape(self):
        c = self.config
        d_head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return ModelShape(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                          c.num_key_value_heads or c.num_attention_heads, d_head,
                          c.intermediate_size, c.vocab_size, c.max_position_embeddings)

    def qkv(self, layer_idx, x, rope):
        attn = self.layers[layer_idx].self_attn
        dh = attn.head_dim
        T = x.shape[0]
        q = attn.q_proj(x).view(T, -1, dh)
        k = attn.k_proj(x).view(T, -1, dh)
        v = attn.v_proj(x).view(T, -1, dh).transpose(0, 1)
        if hasattr(attn, "q_norm"):  # Qwen3 / Gemma 3 style QK-norm, per head
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        cos, sin = rope
        cos, sin = cos[0], sin[0]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attention_scale(self, layer_idx):
        return self.layers[layer_idx].self_attn.scaling

    def mlp_hidden(self, layer_idx, x):
        mlp = self.layers[layer_idx].mlp
        return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


class Gemma3Adapter(LlamaAdapter):
    """Gemma 3 text: extra post-attention / post-MLP norms (their outputs are what joins the
    residual), QK-norm, scaled embeddings, sliding-window layers with their own RoPE base."""

    family = "gemma3"
    paths = replace(LlamaAdapter.paths, attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm",
                    mlp_norm="pre_feedforward_layernorm")

    def attn_logit_softcap(self):
        return getattr(self.config, "attn_logit_softcapping", None)

    def logits_from_normed(self, normed):
        return self._cap_logits(self.unembed(normed))

    def final_logit_softcap(self):
        return getattr(self.config, "final_logit_softcapping", None) or None


class GPT2Adapter(Adapter):
    """GPT-2: LayerNorm, learned absolute positions, multi-head attention, GELU MLP."""

    family = "gpt2"
    uses_rope = False
    paths = ModulePaths(layers="transformer.h", final_norm="transformer.ln_f", embed="transformer.wte",
                        attn_out="attn", mlp_out="mlp", attn_norm="ln_1", mlp_norm="ln_2", attn_z="attn.c_proj",
                        mlp_post="mlp.c_proj")

    def shape(self):
        c = self.config
        return ModelShape(c.n_layer, c.n_embd, c.n_head, c.n_head, c.n_embd // c.n_head,
                          c.n_inner or 4 * c.n_embd, c.vocab_size, c.n_positions)

    def qkv(self, layer_idx, x, rope):
        attn = self.layers[layer_idx].attn
        T = x.shape[0]
        q, k, v = attn.c_attn(x).split(attn.split_size, dim=-1)
        shape = (T, attn.num_heads, attn.head_dim)
        return (q.view(shape).transpose(0, 1), k.view(shape).transpose(0, 1), v.view(shape).transpose(0, 1))

    def attention_scale(self, layer_idx):
        attn = self.layers[layer_idx].attn
        scale = getattr(attn, "scaling", None)
        if scale is None:
            scale = 1.0 / math.sqrt(attn.head_dim) if attn.scale_attn_weights else 1.0
            if attn.scale_attn_by_inverse_layer_idx:
                scale /= float(layer_idx + 1)
        return scale

    def mlp_hidden(self, layer_idx, x):
        mlp = self.layers[layer_idx].mlp
        return mlp.act(mlp.c_fc(x))


# model_type -> adapter. Families that share Llama's module names reuse its adapter.
ADAPTERS: dict[str, type[Adapter]] = {
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "qwen3": LlamaAdapter,
    "gemma3_text": Gemma3Adapter,
    "gpt2": GPT2Adapter,
}


# The adapter of every family without a hand one (model_core.core.generic_adapter registers it when
# imported, as the registry does: it builds on this module, so this module cannot import it).
_FALLBACK: list = []


def register_fallback(make) -> None:
    """make(model) -> Adapter for model types without a hand adapter (raises ModelLoadError when it cannot)."""
    _FALLBACK[:] = [make]


def adapter_for(model: nn.Module) -> Adapter:
    """The hand adapter of the model's family, else the registered generic one that reads the model;
    ModelLoadError with one sentence where neither fits."""
    model_type = getattr(model.config, "model_type", "?")
    cls = ADAPTERS.get(model_type)
    if cls is not None:
        return cls(model)
    if not _FALLBACK:
        raise ModelLoadError(f"Architecture '{model_type}' is not supported yet; lmscope supports "
                             f"{', '.join(sorted(ADAPTERS))}.")
    return _FALLBACK[0](model)
