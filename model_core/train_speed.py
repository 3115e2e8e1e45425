"""What makes a training step fast on a GPU, chosen in one place for the training jobs.

Measured (bench/sft.py, H200, bf16, the default architecture, full fine-tuning, 256 x 512 tokens a
step, same run): the whole model compiled 29.8% MFU (6 N); Liger's fused linear + cross-entropy with
the whole model compiled 30.1%; the same loss with each decoder layer compiled on its own
("regional" compilation) 35.3%; Liger's kernels everywhere, eager, 31.7%. Compiling layer by layer
is what pays, so GPU jobs do that. The loss: TRL's SFTTrainer brings its own fused LM head (no
[tokens, vocab] logits tensor; it refuses Liger's); through the SFT job on one H200 it ran at the
same steady tokens/s as Trainer + Liger (bench/data_parallel.py, same run). On the CPU nothing is
compiled by default: a short demo run would spend more time compiling than it saves.
"""

from __future__ import annotations

import torch

from .adapters import adapter_for


def _base_model(model):
    """The transformers model under a PEFT wrapper (LoRA), or the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def compile_decoder_layers(model) -> int:
    """torch.compile each decoder layer in place (Module.compile: the state dict keeps its names; one
    graph serves every layer of the same shape); returns how many were compiled."""
    layers = adapter_for(_base_model(model)).layers
    for layer in layers:
        layer.compile()
    return len(layers)


def should_compile(device: torch.device, compile_: bool | None) -> bool:
    """compile_ as the job's setting says; None: on for a GPU, off for the CPU."""
    return compile_ if compile_ is not None else torch.device(device).type == "cuda"


def speed_up(model, device: torch.device, compile_: bool | None) -> list[str]:
    """Apply the GPU speed-ups to a model about to train; -> sentences for the job's log."""
    if not should_compile(device, compile_):
        return []
    n = compile_decoder_layers(model)
    return [f"compiled each of the {n} decoder layers (the first steps include compiling)"]
