"""The training jobs' GPU speed-ups (model_core.training.train_speed): compiled layer by layer on a GPU, not on
the CPU unless asked, through a LoRA wrapper too, without renaming a single weight (a saved model must
load as a plain transformers checkpoint); Liger's fused loss only on a GPU and only when installed.
Compiling happens at the first call, so nothing here pays it."""

from __future__ import annotations

import torch

from model_core.training import sft, train_speed


def test_each_decoder_layer_compiled_in_place_and_no_weight_renamed():
    model, _tok, dev = sft.load_trainable("random-llama-tiny", "cpu")
    names = list(model.state_dict())
    assert train_speed.speed_options(model, dev, None) == ({}, [])  # the CPU: nothing
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    kwargs, notes = train_speed.speed_options(model, dev, True)
    n = len(model.model.layers)
    assert kwargs == {} and notes == [f"compiled each of the {n} decoder layers (the first steps include compiling)"]
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert list(model.state_dict()) == names
    lora = sft.apply_lora(sft.load_trainable("random-llama-tiny", "cpu")[0], 4, None)
    assert train_speed.compile_decoder_layers(lora) == n


def test_the_fused_loss_is_asked_for_on_a_gpu_only_when_liger_is_there(monkeypatch):
    model, _tok, _dev = sft.load_trainable("random-llama-tiny", "cpu")
    gpu = torch.device("cuda")  # nothing runs on it: compile is off, and the kwargs are only built
    monkeypatch.setattr(train_speed, "liger_available", lambda: False)
    kwargs, notes = train_speed.speed_options(model, gpu, False)
    assert kwargs == {} and "liger-kernel is not installed" in notes[0]
    monkeypatch.setattr(train_speed, "liger_available", lambda: True)
    kwargs, notes = train_speed.speed_options(model, gpu, False)
    assert kwargs == {"use_liger_kernel": True, "liger_kernel_config": train_speed.LIGER_LOSS_ONLY}
    assert train_speed.LIGER_LOSS_ONLY["fused_linear_cross_entropy"] and not train_speed.LIGER_LOSS_ONLY["rms_norm"]
