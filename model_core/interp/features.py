"""Sparse-autoencoder features (issue 19): a TopK sparse autoencoder trained on one hook point's
activations, its quality on held-out text, and what each feature reads and writes.

The autoencoder is EleutherAI's `SparseCoder` (package eai-sparsify, import `sparsify`): encoder
z = TopK_k(ReLU(W_enc (x - b_dec) + b_enc)), decoder x_hat = z W_dec + b_dec with unit-norm decoder
rows, its loss FVU = sum ||x - x_hat||^2 / sum ||x - mean(x)||^2 (over the batch) plus its AuxK loss,
and its initialisation (b_dec = the first batch's mean; gradients parallel to the decoder rows
removed). Optimiser: Adam (lr 1e-3) by default; `optimizer="signum"` is the library's default
(sign-SGD under a schedule-free wrapper, lr 5e-3 / sqrt(latents / 2^14)), made for batches of ~65k
tokens: at our ~1k-token steps it drifts (layer 6 of SmolLM2, 60k tokens cached and seen twice:
held-out FVU 0.19 after one pass, 0.32 after two).
sparsify's own `Trainer` is not used: it hooks module outputs by module path (not our hook names), reads
a Hugging Face `datasets` table of whole sequences, has no progress or stop callback, prints, and
writes optimiser and rank state; the loop here streams activations through lmscope's own hooks.

Hook points (model_core.core.hook_names; the activation the autoencoder reads, and where the
reconstruction is spliced back in with a `Recorder` edit):
  resid_pre   blocks.{l}.hook_resid_pre   (the edit point itself)
  resid_post  blocks.{l}.hook_resid_post  (= blocks.{l+1}.hook_resid_pre, edited there; not the last layer)
  attn_out    blocks.{l}.hook_attn_out, mlp_out  blocks.{l}.hook_mlp_out  (edit points)

Streaming and memory: the corpus (its documents in a seeded random order) is tokenized text by text
into windows of `context` tokens; each forward pass runs `batch_size` windows and STOPS at the hook
point (the blocks above it never run), so at most batch_size x context activation vectors of width
d_model exist at once (plus the encoder's batch_size x context x latents pre-activations during a
step). `ActivationBuffer` counts
what it held (`peak_rows`, never above `limit_rows`). Position 0 of every window is left out of
training and of every metric (the attention sink: its residual norm is several times the others'),
and the splices below leave it clean.

Quality on held-out windows (the built-in corpus's held-out split):
  FVU over all held-out activations (one mean for them all), explained = 1 - FVU;
  CE loss (transformers' `labels=` loss, every next-token prediction of each window) clean, with the
  reconstruction spliced in at the hook, and with the hook zero-ablated (positions >= 1 each time);
  CE recovered = (CE_zero - CE_sae) / (CE_zero - CE_clean).

Reading features: `feature_activations` (per position, the features that fire), `context_index` /
`top_contexts` (the largest activations of every feature over a bounded token stream, and every
activation binned on a log scale: `density`, how often each feature fires),
`promoted_tokens` (the decoder row through the final norm's gain and the unembedding, as
model_core.interp.neurons reads a neuron), `label` (most frequent n-grams ending at the top contexts'
activating token, and the top promoted tokens).

Saved as <data dir>/features/<name>/: sae.safetensors + cfg.json (sparsify's own format:
`SparseCoder.load_from_disk` reads it), features.json (settings, memory bound, metrics, history),
contexts.safetensors and labels.json; written into data/features-staging/ and renamed when complete,
so a failed or cancelled run leaves nothing.

The parts, each beside this module (everything is importable from here too):
  features_sae      hook points, capture, the buffer bound, Features, encode / decode, FeatureError
  features_corpus   the built-in corpus, held-out split, token windows
  features_train    FeatureSettings, validate_settings, train_features
  features_quality  ce_loss, splice_edit, evaluate (FVU, CE recovered)
  features_reading  feature_activations, FeatureContexts, context_index, density, top_contexts,
                    promoted_tokens, label, label_all
  features_store    features_dir, load_features, list_features
"""

from __future__ import annotations

from model_core.interp.features_corpus import (
    BUILTIN_VERSION,
    DEFAULT_EVAL_TOKENS,
    builtin_texts,
    dataset_texts,
    eval_windows,
    window_batches,
)
from model_core.interp.features_quality import ce_loss, evaluate, splice_edit
from model_core.interp.features_reading import (
    HIST_BINS,
    HIST_LOG10,
    TOP_K,
    FeatureContexts,
    _hist_bins,
    context_index,
    decoder_directions,
    density,
    feature_activations,
    hist_edges,
    label,
    label_all,
    promoted_tokens,
    top_contexts,
)
from model_core.interp.features_sae import (
    DEFAULT_BATCH,
    DEFAULT_CONTEXT,
    FORMAT,
    HOOK_KINDS,
    ActivationBuffer,
    FeatureError,
    Features,
    FeaturesCancelled,
    HookPoint,
    capture,
    check_width,
    hook_point,
    new_sae,
    reconstruct,
)
from model_core.interp.features_sae import sae_encode as _encode
from model_core.interp.features_store import features_dir, list_features, load_features
from model_core.interp.features_train import (
    DEFAULT_CONTEXT_TOKENS,
    DEFAULT_TOKENS,
    MAX_TOKENS,
    OPTIMIZERS,
    FeatureRun,
    FeatureSettings,
    ProgressFn,
    default_name,
    train_features,
    validate_settings,
)

__all__ = [
    "BUILTIN_VERSION", "DEFAULT_BATCH", "DEFAULT_CONTEXT", "DEFAULT_CONTEXT_TOKENS", "DEFAULT_EVAL_TOKENS",
    "DEFAULT_TOKENS", "FORMAT", "HIST_BINS", "HIST_LOG10", "HOOK_KINDS", "MAX_TOKENS", "OPTIMIZERS", "TOP_K",
    "ActivationBuffer", "FeatureContexts", "FeatureError", "FeatureRun", "FeatureSettings", "Features",
    "FeaturesCancelled", "HookPoint", "ProgressFn",
    "_encode", "_hist_bins",
    "builtin_texts", "capture", "ce_loss", "check_width", "context_index", "dataset_texts", "decoder_directions",
    "default_name", "density", "eval_windows", "evaluate", "feature_activations", "features_dir", "hist_edges",
    "hook_point",
    "label", "label_all", "list_features", "load_features", "new_sae", "promoted_tokens", "reconstruct",
    "splice_edit", "top_contexts", "train_features", "validate_settings", "window_batches",
]
