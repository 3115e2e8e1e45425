"""Mixture-of-experts routing, as the model routed: which experts each token went to, with what
weight, and the load on every expert over a prompt.

The router is read from the model, not recomputed: every mixture-of-experts block transformers 5
ships (Mixtral, Qwen-MoE, OLMoE, DeepSeek, GPT-OSS, Granite-MoE, ...) has a router module
(`*Router`, usually the MLP's `gate` or `router` child) that returns (router logits [T, E], the
chosen experts' weights [T, k], the chosen experts [T, k]). A forward hook on the routers of the
asked layers keeps those three; the probabilities shown are the softmax of the logits (the
model's own weights may be renormalised over the chosen k, or come from a sigmoid: both are kept
as the model returned them). Layers with a dense MLP (DeepSeek's first layers) have no router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model_core.core.errors import PromptError


@dataclass
class Routing:
    layer: int
    logits: torch.Tensor  # [T, E] the router's logits
    weights: torch.Tensor  # [T, k] the chosen experts' weights, as the model mixes them
    experts: torch.Tensor  # [T, k] the chosen experts' indices

    @property
    def n_experts(self) -> int:
        return self.logits.shape[-1]

    @property
    def probs(self) -> torch.Tensor:
        """[T, E] softmax of the router logits."""
        return torch.softmax(self.logits.float(), dim=-1)

    def load(self) -> torch.Tensor:
        """[E] the share of the prompt's (token, slot) choices each expert got; sums to 1."""
        counts = torch.bincount(self.experts.reshape(-1).cpu(), minlength=self.n_experts).float()
        return counts / counts.sum().clamp(min=1)


def _is_router(module: nn.Module) -> bool:
    return type(module).__name__.lower().endswith("router")


def router_of(layer: nn.Module) -> nn.Module | None:
    """The router module inside one decoder layer, or None (a dense MLP, a state-space layer)."""
    return next((m for m in layer.modules() if _is_router(m)), None)


def moe_layers(lm) -> list[int]:
    """Indices of the decoder layers whose MLP routes tokens to experts."""
    return [i for i, layer in enumerate(lm.adapter.layers) if router_of(layer) is not None]


def routing(lm, token_ids, layers=None) -> dict[int, Routing]:
    """One forward of `token_ids` with the routers of `layers` (default: every routed layer) watched."""
    ids = [int(t) for t in (token_ids.tolist() if torch.is_tensor(token_ids) else token_ids)]
    if not ids:
        raise PromptError("No tokens to route.")
    routed = moe_layers(lm)
    wanted = routed if layers is None else [int(l) for l in layers if int(l) in routed]
    kept: dict[int, tuple] = {}
    handles = []
    for i in wanted:
        def keep(module, args, output, i=i):
            if isinstance(output, tuple) and len(output) >= 3:
                kept[i] = output[:3]
            else:  # a router that returns only logits: the chosen k are its top-k
                k = getattr(module, "top_k", None) or getattr(lm.model.config, "num_experts_per_tok", 1)
                w, e = torch.topk(torch.softmax(output.float(), -1), k, dim=-1)
                kept[i] = (output, w, e)
        handles.append(router_of(lm.adapter.layers[i]).register_forward_hook(keep))
    try:
        with torch.inference_mode():
            lm.model(input_ids=torch.tensor([ids], device=lm.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    T = len(ids)
    return {i: Routing(i, *(t.reshape(T, -1) for t in kept[i])) for i in wanted if i in kept}
