"""The training jobs' GPU speed-ups (model_core.train_speed): compiled layer by layer on a GPU, not on
the CPU unless asked, through a LoRA wrapper too, without renaming a single weight (a saved model must
load as a plain transformers checkpoint). Compiling happens at the first call, so nothing here pays it."""

from __future__ import annotations

import torch

from model_core import sft, train_speed


def test_compiled_on_a_gpu_not_on_the_cpu_unless_asked():
    assert train_speed.should_compile(torch.device("cuda"), None)
    assert not train_speed.should_compile(torch.device("cpu"), None)
    assert train_speed.should_compile(torch.device("cpu"), True)
    assert not train_speed.should_compile(torch.device("cuda"), False)


def test_each_decoder_layer_compiled_in_place_and_no_weight_renamed():
    model, _tok, dev = sft.load_trainable("random-llama-tiny", "cpu")
    names = list(model.state_dict())
    assert train_speed.speed_up(model, dev, None) == []  # the CPU: nothing
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    notes = train_speed.speed_up(model, dev, True)
    n = len(model.model.layers)
    assert notes == [f"compiled each of the {n} decoder layers (the first steps include compiling)"]
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert list(model.state_dict()) == names
    lora = sft.apply_lora(sft.load_trainable("random-llama-tiny", "cpu")[0], 4, None)
    assert train_speed.compile_decoder_layers(lora) == n
