"""A transcoder's inputs and outputs in the model: the (MLP input, MLP output) pairs of a forward,
and a coder's sparse code and output on MLP inputs. The base the transcoder modules build on
(model_core.interp.transcoders, transcoder_contexts, attribution_graph)."""

from __future__ import annotations

import torch

from model_core.core.hook_names import act_name
from model_core.core.hooks import Recorder, instrument, recording


def mlp_pairs(lm, ids: torch.Tensor, layers) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """ids [B, T] -> {layer: (mlp input [B, T, d], mlp output [B, T, d])}, float32, one forward.
    The input is the layer's own MLP norm applied to resid_pre + attn_out (what the MLP reads)."""
    inst = instrument(lm.adapter)
    del inst
    rec = Recorder(layers=frozenset(layers))
    with torch.inference_mode(), recording(rec):
        lm.model(input_ids=ids.to(lm.device), use_cache=False)
        out = {}
        for layer in layers:
            block = lm.adapter.layers[layer]
            mid = rec.store[act_name("resid_pre", layer)] + rec.store[act_name("attn_out", layer)]
            x = lm.adapter.mlp_norm(block)(mid)
            out[layer] = (x.float(), rec.store[act_name("mlp_out", layer)].float())
    return out


def encode(coder, x: torch.Tensor):
    """x [rows, d] -> (top_acts [rows, k], top_indices [rows, k]) (float32)."""
    enc = coder.encode(x.to(coder.device, torch.float32))
    return enc.top_acts.float(), enc.top_indices


def transcode(coder, x: torch.Tensor) -> torch.Tensor:
    """[..., d] MLP input -> the transcoder's MLP output [..., d] (float32): the features' decoded sum,
    plus the skip connection's x W_skip^T where the coder has one."""
    flat = x.reshape(-1, x.shape[-1]).to(coder.device, torch.float32)
    with torch.no_grad():
        out = coder.decode(*encode(coder, flat)).float()
        if coder.W_skip is not None:
            out = out + flat @ coder.W_skip.float().mT
    return out.reshape(x.shape)
