"""TransformerLens-style hook names, built and read in one place (like TransformerLens's
`utils.get_act_name` and its documented activation cache).

Per layer l (the model's block l), in the order a forward pass reaches them:

    kind        name                          shape in a Trace      what it is
    resid_pre   blocks.{l}.hook_resid_pre     [T, d_model]          block l's input (blocks.0: the embedding)
    z           blocks.{l}.attn.hook_z        [T, n_heads*d_head]   input of attention's output projection
                                                                    (head h: columns h*d_head:(h+1)*d_head;
                                                                    an edit point only, not in a Trace)
    pattern     blocks.{l}.attn.hook_pattern  [n_heads, T, T]       attention weights; row i: where query i
                                                                    attends (recomputed on demand)
    attn_out    blocks.{l}.hook_attn_out      [T, d_model]          what attention adds to the residual stream
    resid_mid   blocks.{l}.hook_resid_mid     [T, d_model]          resid_pre + attn_out (re-derived)
    post        blocks.{l}.mlp.hook_post      [T, d_mlp]            the MLP activation entering its down
                                                                    projection (recomputed on demand)
    mlp_out     blocks.{l}.hook_mlp_out       [T, d_model]          what the MLP adds to the residual stream
    resid_post  blocks.{l}.hook_resid_post    [T, d_model]          resid_mid + mlp_out (re-derived)

Model-wide (no layer):

    embed       hook_embed                    [T, d_model]          the embedding (= blocks.0.hook_resid_pre)
    ln_final    ln_final.hook_normalized      [T, d_model]          the final norm's output
    logits      logits                        [T, vocab]            through the model's own unembedding

During a forward pass (hooks, `Recorder.edits`) every tensor carries a batch dimension first:
[B, T, ...]. The names are external API (saved trace files, URLs, tests): they never change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from model_core.core.errors import LmscopeError


@dataclass(frozen=True)
class Kind:
    kind: str  # the short name act_name takes, e.g. "pattern"
    suffix: str  # the name after "blocks.{l}." (per layer) or the whole name (model-wide)
    per_layer: bool
    shape: str  # in a Trace; a forward pass adds a batch dimension first
    what: str
    in_trace: bool = True  # Trace[name] serves it (hook_z is an edit point only)


KINDS: dict[str, Kind] = {k.kind: k for k in (
    Kind("resid_pre", "hook_resid_pre", True, "[T, d_model]", "block l's input (blocks.0: the embedding)"),
    Kind("z", "attn.hook_z", True, "[T, n_heads*d_head]",
         "input of attention's output projection (head h: columns h*d_head:(h+1)*d_head)", in_trace=False),
    Kind("pattern", "attn.hook_pattern", True, "[n_heads, T, T]", "attention weights; row i: where query i attends"),
    Kind("attn_out", "hook_attn_out", True, "[T, d_model]", "what attention adds to the residual stream"),
    Kind("resid_mid", "hook_resid_mid", True, "[T, d_model]", "resid_pre + attn_out"),
    Kind("post", "mlp.hook_post", True, "[T, d_mlp]", "the MLP activation entering its down projection"),
    Kind("mlp_out", "hook_mlp_out", True, "[T, d_model]", "what the MLP adds to the residual stream"),
    Kind("resid_post", "hook_resid_post", True, "[T, d_model]", "resid_mid + mlp_out"),
    Kind("embed", "hook_embed", False, "[T, d_model]", "the embedding (= blocks.0.hook_resid_pre)"),
    Kind("ln_final", "ln_final.hook_normalized", False, "[T, d_model]", "the final norm's output"),
    Kind("logits", "logits", False, "[T, vocab]", "logits through the model's own unembedding"),
)}

LAYER_KINDS = tuple(k for k, v in KINDS.items() if v.per_layer)
# What a Trace serves per layer, in this order (Trace.hook_names).
TRACE_LAYER_KINDS = tuple(k for k in LAYER_KINDS if KINDS[k].in_trace)

# act_name also takes a kind by its name's suffix ("attn.hook_pattern", "hook_attn_out", ...).
_BY_SUFFIX = {v.suffix: k for k, v in KINDS.items()}
_MODEL_WIDE = {v.suffix: k for k, v in KINDS.items() if not v.per_layer}
_LAYER_RE = re.compile(r"blocks\.(0|[1-9][0-9]*)\.(" + "|".join(
    re.escape(KINDS[k].suffix) for k in LAYER_KINDS) + ")")


class UnknownHookName(KeyError, LmscopeError):
    """A name or kind that is not one of KINDS (a KeyError, as a mapping lookup's miss)."""

    def __str__(self) -> str:  # one sentence, not KeyError's repr of it
        return str(self.args[0]) if self.args else "unknown hook name"


def _kind(kind: str) -> Kind:
    k = KINDS.get(kind) or KINDS.get(_BY_SUFFIX.get(kind, ""))
    if k is None:
        raise UnknownHookName(f"unknown hook kind '{kind}' (kinds: {', '.join(KINDS)})")
    return k


def act_name(kind: str, layer: int | None = None) -> str:
    """("pattern", 3) -> "blocks.3.attn.hook_pattern"; ("ln_final",) -> "ln_final.hook_normalized".
    kind: a short kind of KINDS or its suffix; layer: required for per-layer kinds, None otherwise."""
    k = _kind(kind)
    if not k.per_layer:
        if layer is not None:
            raise UnknownHookName(f"hook kind '{k.kind}' has no layer (got layer {layer})")
        return k.suffix
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise UnknownHookName(f"hook kind '{k.kind}' needs a layer number >= 0 (got {layer!r})")
    return f"blocks.{layer}.{k.suffix}"


def parse(name: str) -> tuple[str, int | None]:
    """The inverse of act_name: "blocks.3.attn.hook_pattern" -> ("pattern", 3), "logits" ->
    ("logits", None). Anything else raises UnknownHookName (a KeyError)."""
    if isinstance(name, str):
        if name in _MODEL_WIDE:
            return _MODEL_WIDE[name], None
        m = _LAYER_RE.fullmatch(name)
        if m:
            return _BY_SUFFIX[m.group(2)], int(m.group(1))
    raise UnknownHookName(f"unknown hook name '{name}'")


def layer_of(name: str) -> int | None:
    """The layer of a hook name (None for a model-wide one); unknown names raise."""
    return parse(name)[1]


def layer_names(kinds, layers) -> list[str]:
    """act_name(kind, l) for each layer, and each kind within a layer, in the order given."""
    return [act_name(k, l) for l in layers for k in kinds]


def trace_names(layers) -> list[str]:
    """Every name a Trace that captured `layers` serves, in Trace.hook_names()'s order."""
    return [act_name("embed"), *layer_names(TRACE_LAYER_KINDS, layers), act_name("ln_final"), act_name("logits")]
