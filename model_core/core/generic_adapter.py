"""The adapter for every decoder-only family without a hand-written one: it reads the model.

Where things are is found from the module tree, not a table: the decoder layers are the largest
nn.ModuleList of identical blocks; in each layer the attention is the child named *attn* /
*attention*, the MLP the child named mlp / feed_forward / ffn / *moe* (or, for OPT-style layers with
the MLP inline, its last linear fc2); the final norm is the last norm outside the layers. Families
whose post-norms' outputs join the residual (Gemma 2/3, OLMo 2: post_attention_layernorm with a
post_feedforward_layernorm) hook those norms instead of the sublayers.

The attention pattern is not recomputed by hand either: the model runs with attn_implementation
"lmscope" (model_core.core.attention_capture), and a pattern is read by re-running that one decoder
layer on its captured input with a Recorder asking for it; the attention function keeps the exact
q, k, v, scores and softmax the model computed.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from model_core.core.adapters import Adapter, Attention, ModelShape, is_norm, register_fallback
from model_core.core.errors import ModelLoadError
from model_core.core.hooks import Recorder, recording

log = logging.getLogger(__name__)

_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")
_OUT_PROJ = ("o_proj", "out_proj", "dense", "c_proj", "wo", "o")
_DOWN_PROJ = ("down_proj", "c_proj", "fc2", "fc_out", "w2", "dense_4h_to_h", "wo")


def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The largest nn.ModuleList whose items are all of one class (the decoder blocks)."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and len({type(m) for m in mod}) == 1:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ModelLoadError(f"Architecture '{model.config.model_type}' is not supported yet: lmscope "
                             f"found no list of decoder layers in it.")
    return best


def _child(module: nn.Module, names) -> tuple[str, nn.Module] | None:
    """The first direct child whose name is one of `names`."""
    children = dict(module.named_children())
    for n in names:
        if n in children:
            return n, children[n]
    return None


class GenericAdapter(Adapter):
    """Any decoder-only family: module places read from the model, patterns from its own attention call."""

    family = "generic"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        mt = getattr(model.config, "model_type", "?")
        self.layers_path, layer_list = _find_layers(model)
        self._layers = list(layer_list)
        layer = self._layers[0]
        children = list(layer.named_children())
        norms = [(n, m) for n, m in children if is_norm(m)]
        # Only children with weights: GPT-NeoX's post_attention_dropout is no attention module.
        blocks = [(n, m) for n, m in children if not is_norm(m) and any(True for _ in m.parameters())]
        attn = [(n, m) for n, m in blocks if "attn" in n or "attention" in n]
        mlp = [(n, m) for n, m in blocks if any(k in n for k in _MLP_NAMES)]
        if not attn and any(k in n for n, _ in children for k in ("mamba", "mixer", "conv", "ssm", "linear_attn")):
            raise ModelLoadError(f"Architecture '{mt}' is not supported yet: its first decoder layer is a state-space, "
                                 f"convolution or linear-attention block with no softmax attention to trace.")
        if not attn:
            raise ModelLoadError(f"Architecture '{mt}' is not supported yet: its decoder layer has no child "
                                 f"named like an attention module (children: {', '.join(n for n, _ in children)}).")
        self.attn_name = attn[0][0]
        if mlp:
            self.mlp_name = mlp[0][0]
            self.mlp_inline = False
        elif _child(layer, ("fc2",)):  # OPT-style: fc1 / activation / fc2 inline in the layer
            self.mlp_name, self.mlp_inline = "fc2", True
        else:
            raise ModelLoadError(f"Architecture '{mt}' is not supported yet: its decoder layer has no MLP child "
                                 f"lmscope recognises (children: {', '.join(n for n, _ in children)}).")
        post_mlp = [n for n, _ in norms if n.startswith("post_") and any(k in n for k in ("feedforward", "mlp", "ffn"))]
        post_attn = [n for n, _ in norms if n.startswith("post_") and ("attn" in n or "attention" in n)]
        # GLM-4 has both: post_self_attn_layernorm on the attention's output, post_attention_layernorm
        # before the MLP (as in Llama).
        post_attn.sort(key=lambda n: "self_attn" not in n)
        # A post-MLP norm means the post-attention norm is a post-norm too (in Llama the same name
        # is the pre-MLP norm): their outputs are what joins the residual.
        self.post_norms = bool(post_mlp and post_attn)
        self.attn_out_name = post_attn[0] if self.post_norms else self.attn_name
        self.mlp_out_name = post_mlp[0] if self.post_norms else self.mlp_name
        pre = [n for n, _ in norms if n not in (self.attn_out_name, self.mlp_out_name)]
        self.attn_norm_name = pre[0] if pre else None
        self.mlp_norm_name = pre[1] if len(pre) > 1 else None
        self.final_norm_module = self._final_norm()
        self.parallel = self._is_parallel()

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

    def attn_out_module(self, layer):
        return getattr(layer, self.attn_out_name)

    def mlp_out_module(self, layer):
        return getattr(layer, self.mlp_out_name)

    def attn_norm(self, layer):
        return getattr(layer, self.attn_norm_name) if self.attn_norm_name else nn.Identity()

    def mlp_norm(self, layer):
        if self.parallel:  # the MLP reads the attention's normalised input
            return self.attn_norm(layer)
        return getattr(layer, self.mlp_norm_name) if self.mlp_norm_name else nn.Identity()

    def attn_z_module(self, layer):
        found = _child(getattr(layer, self.attn_name), _OUT_PROJ)
        return found[1] if found and hasattr(found[1], "weight") else None

    def mlp_post_module(self, layer):
        if self.mlp_inline:
            return layer.fc2
        found = _child(getattr(layer, self.mlp_name), _DOWN_PROJ)
        return found[1] if found and hasattr(found[1], "weight") else None

    def missing(self) -> list[str]:
        """One phrase per hook the generic path cannot place (empty: all of them)."""
        layer = self._layers[0]
        out = []
        if self.attn_z_module(layer) is None:
            out.append("no single attention output projection (attn.hook_z)")
        if self.mlp_post_module(layer) is None:
            out.append("no single MLP down projection (mlp.hook_post; mixture-of-experts MLPs have one per expert)")
        return out

    def shape(self) -> ModelShape:
        c = self.config
        attn = getattr(self._layers[0], self.attn_name)
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
        attn = getattr(self._layers[layer_idx], self.attn_name)
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
    def _call(self, layer_idx: int, module: nn.Module, x: torch.Tensor, rope) -> None:
        """Run `module` (a decoder layer or its attention) on x [T, d] as the model calls it: no
        cache, the positions 0..T-1, the rotary cos/sin the model passed that layer."""
        T = x.shape[0]
        pos = torch.arange(T, device=x.device)[None]  # [1, T]
        # The mask the model builds for this layer: causal, and the layer's sliding window (some
        # families pass the window only through the mask, not to the attention function).
        mask = self.causal_mask(layer_idx, T, x.device)[None, None]  # [1, 1, T, T]
        kwargs = {"attention_mask": mask, "position_ids": pos, "cache_position": pos[0], "use_cache": False}
        if rope is not None:
            kwargs["position_embeddings"] = rope
        params = inspect.signature(module.forward).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        module(x[None], **kwargs)

    def _captured(self, layer_idx: int, run) -> Attention:
        attn = getattr(self._layers[layer_idx], self.attn_name)
        attn._lmscope_layer = layer_idx
        rec = Recorder(capture=False, patterns=frozenset({layer_idx}))
        with torch.inference_mode(), recording(rec):
            run()
        got = rec.patterns_out.get(layer_idx)
        if got is None:
            raise ModelLoadError(f"Architecture '{self.config.model_type}' does not call transformers' attention "
                                 f"interface, so lmscope cannot read its attention pattern (load it with "
                                 f"attn_implementation='lmscope').")
        return Attention(**got)

    def _queries(self, a: Attention, queries) -> Attention:
        if queries is None:
            return a
        return Attention(q=a.q[:, queries], k=a.k, v=a.v, raw_scores=a.raw_scores[:, queries],
                         scaled_scores=a.scaled_scores[:, queries], mask=a.mask[queries], probs=a.probs[:, queries])

    def attend(self, layer_idx, x, rope, queries=None) -> Attention:
        """From the normalised input x [T, d]: the layer's attention module run on it."""
        attn = getattr(self._layers[layer_idx], self.attn_name)
        return self._queries(self._captured(layer_idx, lambda: self._call(layer_idx, attn, x, rope)), queries)

    def attention(self, layer_idx, resid_pre, rope, queries=None) -> Attention:
        """From the layer's residual input [T, d]: the whole decoder layer re-run (its own norms)."""
        layer = self._layers[layer_idx]
        return self._queries(self._captured(layer_idx, lambda: self._call(layer_idx, layer, resid_pre, rope)), queries)

    def attention_scores(self, layer_idx, resid_pre, rope):
        a = self.attention(layer_idx, resid_pre, rope)
        pattern = a.pattern
        v = a.v.repeat_interleave(a.q.shape[0] // a.v.shape[0], dim=0)
        return {"x_normed": self.attn_norm(self._layers[layer_idx])(resid_pre), "q": a.q, "k": a.k, "v": v,
                "raw_scores": a.raw_scores, "scaled_scores": a.scaled_scores, "mask": a.mask, "pattern": pattern,
                "z": torch.matmul(pattern, v)}

    def mlp_hidden(self, layer_idx, x):
        """The activation entering the MLP's down projection, from the MLP's normalised input x [T, d]."""
        post = self.mlp_post_module(self._layers[layer_idx])
        if post is None or self.mlp_inline:
            raise NotImplementedError(f"'{self.config.model_type}': {'; '.join(self.missing()) or 'inline MLP'}")
        seen = {}
        h = post.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
        try:
            getattr(self._layers[layer_idx], self.mlp_name)(x[None])
        finally:
            h.remove()
        return seen["x"][0]


def generic_adapter(model: nn.Module) -> GenericAdapter:
    """The generic adapter of `model`, its attention modules tagged with their layer index."""
    ad = GenericAdapter(model)
    for i, layer in enumerate(ad.layers):
        getattr(layer, ad.attn_name)._lmscope_layer = i
    for miss in ad.missing():
        log.info("%s: %s", model.config.model_type, miss)
    return ad


register_fallback(generic_adapter)
