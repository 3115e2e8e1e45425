"""What makes a Trainer's step fast on a GPU, chosen in one place for the training jobs.

Measured (bench/sft.py, H200, bf16, the default architecture, full fine-tuning, 256 x 512 tokens a
step, same run): transformers' own loss with the whole model compiled 29.8% MFU (6 N); Liger's fused
linear + cross-entropy (no [tokens, vocab] logits tensor) with the whole body compiled 30.1% (and
69 instead of 105 GiB); the same loss with each decoder layer compiled on its own ("regional"
compilation) 35.3%; Liger's kernels everywhere, eager, 31.7%. Compiling layer by layer is what
pays; Liger's loss is kept for its memory when liger-kernel is installed (an optional package: it
needs a GPU). Liger's Triton kernels inside a whole-model compile crashed in an earlier stop, so
its loss stays outside the compiled layers. On the CPU nothing is compiled by default: a short demo
run would spend more time compiling than it saves.
"""

from __future__ import annotations

import importlib.util

import torch

from model_core.core.adapters import adapter_for

# Only the loss: Liger's RMSNorm/SwiGLU/RoPE would sit inside the compiled layers (see above).
LIGER_LOSS_ONLY = {"fused_linear_cross_entropy": True, "rope": False, "rms_norm": False, "swiglu": False,
                   "cross_entropy": False}


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _base_model(model):
    """The transformers model under a PEFT wrapper (LoRA), or the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def compile_decoder_layers(model) -> int:
    """torch.compile each decoder layer in place (one graph, reused by every layer of the same shape);
    returns how many were compiled."""
    layers = adapter_for(_base_model(model)).layers
    for layer in layers:
        layer.compile()
    return len(layers)


def speed_options(model, device: torch.device, compile_: bool | None) -> tuple[dict, list[str]]:
    """-> (TrainingArguments keyword arguments, sentences for the job's log). compile_: None = on for
    a GPU, off for the CPU. Compiles the model's decoder layers in place when it says so."""
    notes: list[str] = []
    on_gpu = torch.device(device).type == "cuda"
    kwargs: dict = {}
    if on_gpu and liger_available():
        kwargs = {"use_liger_kernel": True, "liger_kernel_config": dict(LIGER_LOSS_ONLY)}
        notes.append("loss: Liger's fused linear + cross-entropy (no full logits tensor)")
    elif on_gpu:
        notes.append("liger-kernel is not installed, so the loss builds the full logits tensor "
                     "(pip install 'lmscope[gpu]' for the fused loss)")
    if compile_ if compile_ is not None else on_gpu:
        n = compile_decoder_layers(model)
        notes.append(f"compiled each of the {n} decoder layers (the first steps include compiling)")
    return kwargs, notes
