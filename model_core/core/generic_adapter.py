"""The adapter for every decoder-only family without a hand-written one: it reads the model.

Where things are is found from the module tree, not a table: the decoder layers are the largest
nn.ModuleList of identical blocks; in each layer the attention is the child named *attn* /
*attention*, the MLP the child named mlp / feed_forward / ffn / *moe* (or, for OPT-style layers with
the MLP inline, its last linear fc2); the final norm is the last norm outside the layers. Families
whose post-norms' outputs join the residual (Gemma 2/3, OLMo 2: post_attention_layernorm with a
post_feedforward_layernorm) hook those norms instead of the sublayers.

Places are read per layer: hybrids (Jamba, Bamba, Nemotron-H, Qwen3-Next, LFM2, OLMo hybrid, ...)
mix softmax-attention layers with Mamba / convolution / linear-attention ones. Every layer has its
residual stream, attn_out (whatever adds in attention's place) and mlp_out; a layer without softmax
attention refuses a pattern in one sentence (no_attention). Sublayer outputs scaled by a residual
multiplier (Granite, MiniCPM3) are recorded scaled (hooks). A layer with no norm of its own is
read through the blocks nested in it (Zamba's hybrid layers: a shared transformer whose output feeds
the Mamba block beside it; the Mamba block's output is attn_out, the shared attention the pattern).

The attention pattern is not recomputed by hand either: the model runs with attn_implementation
"lmscope" (model_core.core.attention_capture), and a pattern is read by re-running that one decoder
layer on its captured input, with the very arguments the traced forward gave it (hooks.LayerCall:
mask, positions, rotary, ALiBi, ...), and a Recorder asking for it; the attention function keeps
the exact q, k, v, scores and softmax the model computed. Families that compute attention in their
own code (BLOOM, GPT-Neo, XGLM) give the pattern their layer returns with output_attentions.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from operator import attrgetter

import torch
from torch import nn

from model_core.core.adapters import Adapter, Attention, ModelShape, is_norm, register_fallback
from model_core.core.errors import ModelLoadError, PromptError
from model_core.core.hooks import LayerCall, Recorder, recording

log = logging.getLogger(__name__)

_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")
_OUT_PROJ = ("o_proj", "out_proj", "dense", "c_proj", "wo", "o")
_DOWN_PROJ = ("down_proj", "c_proj", "fc2", "fc_out", "w2", "dense_4h_to_h", "wo")


def _has_norm(layer: nn.Module) -> bool:
    """A norm among the layer's children, or among those of a block nested in it (Zamba's hybrid
    layers keep theirs in the Mamba block and the shared transformer they hold)."""
    return any(is_norm(c) or any(is_norm(g) for g in c.children()) for c in layer.children())


def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder blocks: the largest nn.ModuleList whose items each have a norm of their own
    (hybrids mix block classes: Jamba's attention and Mamba layers), else of one class."""
    best, best_key = None, None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or not len(mod):
            continue
        normed = all(_has_norm(m) for m in mod)
        if not normed and len({type(m) for m in mod}) != 1:
            continue
        key = (normed, len(mod))
        if best_key is None or key > best_key:
            best, best_key = (name, mod), key
    if best is None:
        raise ModelLoadError(f"Architecture '{model.config.model_type}' is not supported yet: lmscope "
                             f"found no list of decoder layers in it.")
    return best


def _module(layer: nn.Module, name: str | None) -> nn.Module | None:
    """The module at a dotted path inside a layer ("self_attn", "mamba_decoder.mamba"); None: none."""
    return attrgetter(name)(layer) if name else None


def _children(layer: nn.Module) -> tuple[list[tuple[str, nn.Module]], bool]:
    """The layer's children by dotted name, and whether they came from blocks nested in it: a layer
    with no norm of its own (Zamba's hybrid layer: a shared transformer block, a linear and a Mamba
    block) is read through those blocks' children ("shared_transf.self_attn", ...)."""
    children = list(layer.named_children())
    if any(is_norm(m) for _, m in children):
        return children, False
    out, nested = [], False
    for n, m in children:
        inner = list(m.named_children())
        # A nested block: a norm and a sublayer (a module of its own, not a leaf such as the conv1d
        # inside a linear-attention mixer) named like attention, an MLP or a mixer.
        if any(is_norm(c) for _, c in inner) and any(_role_name(c) and any(True for _ in cm.children())
                                                     for c, cm in inner):
            out += [(f"{n}.{c}", cm) for c, cm in inner]
            nested = True
        else:
            out.append((n, m))
    return out, nested


def _role_name(name: str) -> bool:
    return any(k in name for k in ("attn", "attention", *_MLP_NAMES, *_MIXER_NAMES))


def _child(module: nn.Module, names) -> tuple[str, nn.Module] | None:
    """The first direct child whose name is one of `names`."""
    children = dict(module.named_children())
    for n in names:
        if n in children:
            return n, children[n]
    return None


# Children that mix positions without a softmax (state-space, convolution, linear attention).
_MIXER_NAMES = ("mamba", "mixer", "linear_attn", "conv", "ssm", "temporal_block")
_LINEAR_TYPES = ("linear", "mamba", "conv", "recurrent", "ssm", "mlp", "moe")


@dataclass
class _Places:
    """One decoder layer's children by role (names; None where the layer has none)."""

    attn: str | None  # the softmax attention (its pattern can be read)
    mixer: str | None  # what adds to the residual in attention's place (the attention, or a Mamba / conv block)
    mixer_kind: str  # for the one-sentence error of a layer without a pattern
    mlp: str | None
    mlp_inline: bool
    attn_out: str | None
    mlp_out: str | None
    attn_norm: str | None
    mlp_norm: str | None
    mlp_remainder: bool = False  # several MLP children summed (experts + a shared MLP beside them)
    beside: str | None = None  # a Mamba block run beside the attention, both outputs summed (Falcon-H1)


def _places(mt: str, layer: nn.Module, layer_type: str | None) -> _Places:
    children, nested = _children(layer)
    names = ", ".join(n for n, _ in children)
    norms = [(n, m) for n, m in children if is_norm(m)]
    # Only children with weights: GPT-NeoX's post_attention_dropout is no attention module.
    blocks = [(n, m) for n, m in children if not is_norm(m) and any(True for _ in m.parameters())]
    attn = [n for n, m in blocks if "attn" in n or "attention" in n]
    mixers = [n for n, m in blocks if any(k in n for k in _MIXER_NAMES) and n not in attn]
    mlp = [n for n, m in blocks if any(k in n for k in _MLP_NAMES) and n not in attn]
    if nested and attn and mixers and attn[0].split(".")[0] != mixers[0].split(".")[0]:
        # Zamba: the attention sits in one nested block (the shared transformer, its MLP after it),
        # the Mamba block beside it takes that block's output into its own input and alone adds to
        # the residual. So attn_out is the Mamba mixer's output; the attention gives the pattern; the
        # shared MLP reads the attention's output, not the residual, so the layer has no mlp_out.
        return _Places(attn[0], mixers[0], "attention", None, False, mixers[0], None, None, None)
    lists = [n for n, m in blocks if n in attn and isinstance(m, nn.ModuleList)]
    if lists:  # LongCat-Flash: two attention + MLP sublayers and a MoE beside them in every layer
        raise ModelLoadError(f"Architecture '{mt}' is not supported yet: each decoder layer runs "
                             f"{len(dict(children)[lists[0]])} attention blocks ({lists[0]}), and lmscope "
                             f"places one per layer.")
    mlp_inline = False
    linear = bool(layer_type) and any(k in layer_type for k in _LINEAR_TYPES)
    mixer, kind = (attn[0], "attention") if attn else (mixers[0], mixers[0]) if mixers else (None, "")
    if mixer is not None and mixer == "mixer":  # Nemotron-H: one mixer per block, by its class
        cls = type(dict(children)[mixer]).__name__
        if any(k in cls for k in ("MLP", "MoE", "Expert")):
            mlp, mixer = [mixer], None
        elif "Attention" in cls and not linear:
            attn, kind = [mixer], "attention"
        kind = cls
    softmax = bool(attn) and mixer == attn[0] and not (linear or "linear" in mixer)
    if mixer is not None and not softmax and kind == "attention":
        kind = f"linear attention ({mixer})"
    if not mlp and _child(layer, ("fc2",)):  # OPT-style: fc1 / activation / fc2 inline in the layer
        mlp, mlp_inline = ["fc2"], True
    if mixer is None and not mlp:
        raise ModelLoadError(f"Architecture '{mt}' is not supported yet: its decoder layer has no child "
                             f"named like an attention or MLP module (children: {names}).")
    mlp_name = mlp[0] if mlp else None
    post_mlp = [n for n, _ in norms if n.startswith("post_") and any(k in n for k in ("feedforward", "mlp", "ffn"))]
    post_attn = [n for n, _ in norms if n.startswith("post_") and any(k in n for k in ("attn", "attention",
                                                                                         "operator"))]
    # GLM-4 has both: post_self_attn_layernorm on the attention's output, post_attention_layernorm
    # before the MLP (as in Llama).
    post_attn.sort(key=lambda n: "self_attn" not in n)
    # A post-MLP norm means the post-attention norm is a post-norm too (in Llama the same name
    # is the pre-MLP norm): their outputs are what joins the residual.
    numbered = sorted(n for n, _ in norms if n.startswith("post_norm") and n[9:].isdigit())
    if len(numbered) == 2:  # HyperCLOVA X: post_norm1 after attention, post_norm2 after the MLP
        post_attn, post_mlp = numbered[:1], numbered[1:]
    post = bool(post_mlp and post_attn)
    attn_out = post_attn[0] if post and mixer else mixer
    mlp_out = post_mlp[0] if post and mlp_name else mlp_name
    pre = [n for n, _ in norms if n not in (attn_out, mlp_out)]
    attn_norm = pre[0] if pre and mixer else None
    mlp_norm = (pre[1] if len(pre) > 1 else pre[0] if pre and not mixer else None) if mlp_name else None
    return _Places(attn[0] if softmax else None, mixer, kind, mlp_name, mlp_inline, attn_out, mlp_out,
                   attn_norm, mlp_norm, mlp_remainder=len(mlp) > 1 and not post,
                   beside=next((n for n in mixers if softmax and n != attn[0]), None))


class GenericAdapter(Adapter):
    """Any decoder-only family: module places read from the model, patterns from its own attention call."""

    family = "generic"
    captures_layer_calls = True  # the trace keeps each layer's call (hooks.LayerCall) to re-run it

    def __init__(self, model: nn.Module):
        super().__init__(model)
        mt = getattr(model.config, "model_type", "?")
        self.layers_path, layer_list = _find_layers(model)
        self._layers = list(layer_list)
        types = getattr(model.config, "layer_types", None) or getattr(model.config, "layers_block_type", None)
        types = list(types) if isinstance(types, (list, tuple)) and len(types) >= len(self._layers) else None
        self.places = [_places(mt, layer, types[i] if types else None) for i, layer in enumerate(self._layers)]
        self._by_id = {id(layer): p for layer, p in zip(self._layers, self.places)}
        self._eager_only: set[int] = set()  # layers whose pattern came from the family's eager weights
        self.attention_layers = [i for i, p in enumerate(self.places) if p.attn is not None]
        if not self.attention_layers:
            raise ModelLoadError(f"Architecture '{mt}' is not supported yet: none of its decoder layers has a "
                                 f"softmax attention to trace (they are {self.places[0].mixer_kind or 'MLP'} "
                                 f"blocks).")
        first = self.places[self.attention_layers[0]]
        self.attn_name = first.attn  # the first attention layer's names (shape, missing hooks)
        self.final_norm_module = self._final_norm()
        self.parallel = self._is_parallel()
        # Granite, HyperCLOVA X, MiniCPM3: each sublayer's output joins the residual times a
        # multiplier (hooks scale what they record): the layer's own attribute, else the config's.
        layer0 = self._layers[0]
        scale = next((v for v in (getattr(layer0, "residual_multiplier", None), getattr(layer0, "residual_scale", None),
                                  getattr(model.config, "residual_multiplier", None))
                      if isinstance(v, (int, float)) and not isinstance(v, bool)), 1.0)
        self.residual_scale = float(scale)

    # --- places -----------------------------------------------------------------------------
    @property
    def layers(self) -> list[nn.Module]:
        return self._layers

    @property
    def unembed(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return self.final_norm_module

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def _final_norm(self) -> nn.Module:
        """The last norm registered outside the decoder layers (model.norm, transformer.ln_f, ...)."""
        inside = {id(m) for layer in self._layers for m in layer.modules()}
        found = [m for _, m in self.model.named_modules() if is_norm(m) and id(m) not in inside]
        if not found:
            raise ModelLoadError(f"Architecture '{self.config.model_type}' is not supported yet: lmscope found no "
                                 f"final norm outside its decoder layers.")
        return found[-1]

    def _is_parallel(self) -> bool:
        """Attention and MLP read the same input (GPT-J, NeoX with use_parallel_residual, Phi, Cohere)."""
        c = self.config
        if getattr(c, "use_parallel_residual", None) is not None:
            return bool(c.use_parallel_residual)
        return getattr(c, "parallel_attn", False) or c.model_type in ("gptj", "codegen", "phi", "cohere", "cohere2")

    def _at(self, layer) -> _Places:
        return self._by_id[id(layer)]

    def _get(self, layer, name):
        return _module(layer, name)

    def attn_out_module(self, layer):
        """What joins the residual in attention's place (None: nothing, the hooks record zeros)."""
        return self._get(layer, self._at(layer).attn_out)

    def mlp_out_module(self, layer):
        return self._get(layer, self._at(layer).mlp_out)

    def beside_attention(self, layer):
        """(block, its output multiplier, the attention's) where a block runs beside the attention."""
        name = self._at(layer).beside
        return name and (_module(layer, name), float(getattr(layer, "ssm_out_multiplier", 1.0)),
                         float(getattr(layer, "attn_out_multiplier", 1.0)))

    def mlp_remainder(self, layer) -> bool:
        """True where mlp_out is the layer's output less its input and attention (hooks._mlp_rest)."""
        return self._at(layer).mlp_remainder

    def attn_norm(self, layer):
        return self._get(layer, self._at(layer).attn_norm) or nn.Identity()

    def mlp_norm(self, layer):
        if self.parallel:  # the MLP reads the attention's normalised input
            return self.attn_norm(layer)
        return self._get(layer, self._at(layer).mlp_norm) or nn.Identity()

    def attn_z_module(self, layer):
        p = self._at(layer)
        found = _child(_module(layer, p.attn), _OUT_PROJ) if p.attn else None
        return found[1] if found and hasattr(found[1], "weight") else None

    def mlp_post_module(self, layer):
        p = self._at(layer)
        if p.mlp_inline:
            return layer.fc2
        found = _child(_module(layer, p.mlp), _DOWN_PROJ) if p.mlp else None
        return found[1] if found and hasattr(found[1], "weight") else None

    def no_attention(self, layer_idx: int) -> str | None:
        """Why layer `layer_idx` has no attention pattern, in one sentence (None: it has one)."""
        p = self.places[layer_idx]
        if p.attn is not None:
            return None
        what = f"a {p.mixer_kind} block" if p.mixer else "an MLP-only block"
        return (f"Layer {layer_idx} of this {self.config.model_type} model is {what} with no softmax attention, so "
                f"it has no attention pattern (layers with one: {', '.join(map(str, self.attention_layers))}).")

    def missing(self) -> list[str]:
        """One phrase per hook the generic path cannot place (empty: all of them)."""
        layer = self._layers[self.attention_layers[0]]
        out = []
        if self.attn_z_module(layer) is None:
            out.append("no single attention output projection (attn.hook_z)")
        if self.places[self.attention_layers[0]].mlp is None:
            out.append("no MLP on the residual stream in its attention layers (no mlp.hook_post)")
        elif self.mlp_post_module(layer) is None:
            out.append("no single MLP down projection (mlp.hook_post; mixture-of-experts MLPs have one per expert)")
        if len(self.attention_layers) < len(self._layers):
            out.append(f"{len(self._layers) - len(self.attention_layers)} of {len(self._layers)} layers have no "
                       f"softmax attention (no pattern there)")
        return out

    def shape(self) -> ModelShape:
        c = self.config
        attn = _module(self._layers[self.attention_layers[0]], self.attn_name)
        d = self.embed_tokens.weight.shape[1]
        n_heads = next((v for v in (getattr(c, k, None) for k in ("num_attention_heads", "n_head", "num_heads",
                                                                   "n_heads")) if v), None)
        n_heads = n_heads or getattr(attn, "num_heads", None) or 1
        kv = getattr(c, "num_key_value_heads", None) or getattr(c, "num_kv_heads", None)
        if kv is None and getattr(c, "multi_query", False):
            kv = 1
        d_head = getattr(attn, "head_dim", None) or getattr(c, "head_dim", None) or d // n_heads
        d_mlp = next((v for v in (getattr(c, k, None) for k in ("intermediate_size", "n_inner", "ffn_dim",
                                                                 "ffn_hidden_size", "d_ff")) if v), 4 * d)
        ctx = next((v for v in (getattr(c, k, None) for k in ("max_position_embeddings", "n_positions",
                                                               "max_seq_len", "seq_length")) if v), 2048)
        return ModelShape(len(self._layers), d, n_heads, kv or n_heads, d_head, d_mlp,
                          self.unembed.weight.shape[0], ctx)

    def sliding_window(self, layer_idx: int) -> int | None:
        name = self.places[layer_idx].attn
        if name is None:
            return None
        attn = _module(self._layers[layer_idx], name)
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window or None
        return super().sliding_window(layer_idx)

    def attn_logit_softcap(self) -> float | None:
        return getattr(self.config, "attn_logit_softcapping", None) or None

    def final_logit_softcap(self) -> float | None:
        return getattr(self.config, "final_logit_softcapping", None) or None

    def logits_from_normed(self, normed):
        return self._cap_logits(self.unembed(normed))

    def _cap_logits(self, logits):
        """The family's scaling of the unembedding's output (Cohere multiplies by logit_scale,
        Granite divides by logits_scaling), then any final softcap."""
        c = self.config
        if getattr(c, "logit_scale", None):
            logits = logits * c.logit_scale
        if getattr(c, "logits_scaling", None):
            logits = logits / c.logits_scaling
        return super()._cap_logits(logits)

    # --- the attention, as the model computed it --------------------------------------------
    def _call(self, layer_idx: int, module: nn.Module, x: torch.Tensor, rope, **extra) -> None:
        """Run `module` (a decoder layer or its attention) on x [T, d] as the model calls it: a
        decoder layer with the very arguments the traced forward gave it (a LayerCall), else no
        cache, the positions 0..T-1, the mask and the rotary cos/sin the model passed that layer."""
        call = rope if isinstance(rope, LayerCall) else None
        if call is not None and module is self._layers[layer_idx]:
            kwargs = {**call.kwargs, **extra}
            if "use_cache" in inspect.signature(module.forward).parameters:
                kwargs["use_cache"] = False
            module(x[None], *call.args, **kwargs)
            return
        if call is not None:  # the attention module alone: the layer's mask and rotary
            rope = call.kwargs.get("position_embeddings")
        T = x.shape[0]
        pos = torch.arange(T, device=x.device)[None]  # [1, T]
        # The mask the model builds for this layer: causal, and the layer's sliding window (some
        # families pass the window only through the mask, not to the attention function).
        mask = self.causal_mask(layer_idx, T, x.device)[None, None]  # [1, 1, T, T]
        if call is not None and call.kwargs.get("attention_mask") is not None:
            mask = call.kwargs["attention_mask"]
        kwargs = {"attention_mask": mask, "position_ids": pos, "cache_position": pos[0], "use_cache": False, **extra}
        if rope is not None:
            kwargs["position_embeddings"] = rope
        params = inspect.signature(module.forward).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        module(x[None], **kwargs)

    def _eager_pattern(self, layer_idx: int, attn: nn.Module, run) -> Attention:
        """The pattern of a family that computes attention in its own code (BLOOM and Falcon's ALiBi,
        GPT-Neo, XGLM): the weights its layer returns when asked for them (output_attentions). Only
        the pattern: q, k and the scores stay inside the family's code (attention_scores says so)."""
        seen = {}

        def keep(module, args, out):
            seen["w"] = out[1] if isinstance(out, tuple) and len(out) > 1 else None

        h = attn.register_forward_hook(keep)
        try:
            with torch.inference_mode():
                run()
        finally:
            h.remove()
        w = seen.get("w")
        if not torch.is_tensor(w) or w.dim() != 4:
            raise ModelLoadError(f"Architecture '{self.config.model_type}' does not call transformers' attention "
                                 f"interface, so lmscope cannot read its attention pattern.")
        probs = w[0].float()  # [H, T, T]
        self._eager_only.add(layer_idx)
        empty = w.new_empty(0)
        return Attention(q=empty, k=empty, v=empty, raw_scores=empty, scaled_scores=empty, mask=probs[0] > 0,
                         probs=probs)

    def _captured(self, layer_idx: int, run, eager=None) -> Attention:
        why = self.no_attention(layer_idx)
        if why:
            raise PromptError(why)
        attn = _module(self._layers[layer_idx], self.places[layer_idx].attn)
        attn._lmscope_layer = layer_idx
        rec = Recorder(capture=False, patterns=frozenset({layer_idx}))
        with torch.inference_mode(), recording(rec):
            run()
        got = rec.patterns_out.get(layer_idx)
        if got is None and eager is not None:
            return self._eager_pattern(layer_idx, attn, eager)
        if got is None:
            raise ModelLoadError(f"Architecture '{self.config.model_type}' does not call transformers' attention "
                                 f"interface, so lmscope cannot read its attention pattern (load it with "
                                 f"attn_implementation='lmscope').")
        return Attention(**got)

    def _queries(self, a: Attention, queries) -> Attention:
        if queries is None:
            return a
        if not a.q.numel():  # a pattern read from the family's eager weights only
            return Attention(q=a.q, k=a.k, v=a.v, raw_scores=a.raw_scores, scaled_scores=a.scaled_scores,
                             mask=a.mask[queries], probs=a.probs[:, queries])
        return Attention(q=a.q[:, queries], k=a.k, v=a.v, raw_scores=a.raw_scores[:, queries],
                         scaled_scores=a.scaled_scores[:, queries], mask=a.mask[queries], probs=a.probs[:, queries])

    def attend(self, layer_idx, x, rope, queries=None) -> Attention:
        """From the normalised input x [T, d]: the layer's attention module run on it."""
        if self.no_attention(layer_idx):
            raise PromptError(self.no_attention(layer_idx))
        attn = _module(self._layers[layer_idx], self.places[layer_idx].attn)
        return self._queries(self._captured(layer_idx, lambda: self._call(layer_idx, attn, x, rope)), queries)

    def attention(self, layer_idx, resid_pre, rope, queries=None) -> Attention:
        """From the layer's residual input [T, d]: the whole decoder layer re-run (its own norms)."""
        layer = self._layers[layer_idx]
        a = self._captured(layer_idx, lambda: self._call(layer_idx, layer, resid_pre, rope),
                           eager=lambda: self._call(layer_idx, layer, resid_pre, rope, output_attentions=True))
        return self._queries(a, queries)

    def attention_scores(self, layer_idx, resid_pre, rope):
        a = self.attention(layer_idx, resid_pre, rope)
        if not a.q.numel():
            raise PromptError(f"This {self.config.model_type} model computes its attention in its own code: lmscope "
                              f"shows its pattern but not its queries, keys and scores step by step.")
        pattern = a.pattern
        v = a.v.repeat_interleave(a.q.shape[0] // a.v.shape[0], dim=0)
        return {"x_normed": self.attn_norm(self._layers[layer_idx])(resid_pre), "q": a.q, "k": a.k, "v": v,
                "raw_scores": a.raw_scores, "scaled_scores": a.scaled_scores, "mask": a.mask, "pattern": pattern,
                "z": torch.matmul(pattern, v)}

    def mlp_hidden(self, layer_idx, x):
        """The activation entering the MLP's down projection, from the MLP's normalised input x [T, d]."""
        p = self.places[layer_idx]
        post = self.mlp_post_module(self._layers[layer_idx])
        if post is None or p.mlp_inline:
            raise NotImplementedError(f"'{self.config.model_type}': {'; '.join(self.missing()) or 'inline MLP'}")
        seen = {}
        h = post.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
        try:
            _module(self._layers[layer_idx], p.mlp)(x[None])
        finally:
            h.remove()
        return seen["x"][0]


def generic_adapter(model: nn.Module) -> GenericAdapter:
    """The generic adapter of `model`, its attention modules tagged with their layer index."""
    ad = GenericAdapter(model)
    for i, layer in enumerate(ad.layers):
        if ad.places[i].attn:
            _module(layer, ad.places[i].attn)._lmscope_layer = i
    for miss in ad.missing():
        log.info("%s: %s", model.config.model_type, miss)
    return ad


register_fallback(generic_adapter)
