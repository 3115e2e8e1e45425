"""lmscope's model core: load decoder-only models, trace instrumented forward passes,
logit lens, sampling. Pure PyTorch + transformers; never imports gradio or celery."""

from model_core.core.errors import LmscopeError, ModelLoadError, PromptError, SettingsError
from model_core.core.registry import LoadedModel, list_models, load_model, resolve_device
from model_core.core.sampling import SamplingSettings, apply_sampling
from model_core.interp.trace import Trace, trace
from model_core.interp.trace_io import load_trace, save_trace

__all__ = [
    "LmscopeError", "ModelLoadError", "SettingsError", "PromptError",
    "LoadedModel", "list_models", "load_model", "resolve_device",
    "Trace", "trace", "load_trace", "save_trace", "SamplingSettings", "apply_sampling",
]
