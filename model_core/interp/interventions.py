"""Interventions through the same hooks as tracing: ablation, activation patching, prompt comparison.

Every intervention is a set of edits in a `Recorder` that lives in a ContextVar for the duration
of one forward pass (see hooks.py), so an ablation or a patch never leaks into another request
that uses the same model object, even from another thread.

Hook points used (names from model_core.core.hook_names; all edits REPLACE the value the model computed):
  blocks.{l}.attn.hook_z       [B, T, H*d_head] input of the attention output projection: head h is
                               the slice h*d_head:(h+1)*d_head -> head ablation and head patching;
  blocks.{l}.hook_mlp_out      [B, T, d] what the MLP adds to the residual -> MLP-layer ablation;
  blocks.{l}.mlp.hook_post     [B, T, d_mlp] input of the MLP down projection -> neuron ablation;
  blocks.{l}.hook_resid_pre    [B, T, d] input of block l -> residual patching per layer x position.

Ablation modes: "zero" sets the value to 0; "mean" replaces it with its mean over the positions
of the same prompt (a per-prompt mean, not a dataset mean).

Activation patching runs the CORRUPTED prompt and replaces one activation with the CLEAN prompt's
value at that point. The metric is read at the last position: the log-probability of a target
token, or the logit difference target - other. Each cell reports the raw metric, its change from
the corrupted run, and the normalised effect (patched - corrupted) / (clean - corrupted): 0 means
"no better than corrupted", 1 means "fully restores the clean answer" (NaN when clean and
corrupted score the same). Cells are batched: a batch holds B copies of the corrupted prompt,
each with a different patch, so a layers x positions sweep costs about cells / B forward passes.

Prompts of different token lengths: position-wise patching needs position correspondence, so by
default (`align="error"`) a PromptError says so in one sentence. `align="right"` aligns the two
prompts at their LAST token (position -1 with -1, -2 with -2, ...); corrupted positions without
a clean counterpart get NaN cells.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from model_core.core import settings
from model_core.core.errors import PromptError, SettingsError
from model_core.core.hook_names import act_name
from model_core.core.hooks import Recorder, instrument, recording
from model_core.core.prompts import prompt_ids
from model_core.core.row_edits import ZeroColumns
from model_core.interp.trace import Trace, trace

Progress = Callable[[float], None]
PromptLike = "str | Sequence[int]"


# ---------------------------------------------------------------------------------------------
# Inputs


def token_id(lm, token: str | int) -> int:
    """A single vocabulary entry from an id or a text such as " Paris" (which must be ONE token)."""
    if isinstance(token, int) or (isinstance(token, str) and token.strip().lstrip("-").isdigit()
                                  and not token.startswith(" ")):
        tid = int(token)
        if not 0 <= tid < lm.shape.vocab_size:
            raise SettingsError(f"Token id {tid} is outside the vocabulary (0..{lm.shape.vocab_size - 1}).")
        return tid
    if not isinstance(token, str) or token == "":
        raise SettingsError("Give the target as a token text (e.g. ' Paris') or a token id.")
    ids = lm.tokenizer(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = [lm.tokenizer.decode([i]) for i in ids]
        raise SettingsError(
            f"'{token}' is {len(ids)} tokens for this model ({pieces}); pick a single-token target "
            f"(mind the leading space, e.g. ' Paris')."
        )
    return int(ids[0])


@dataclass(frozen=True)
class Metric:
    """Read at the last position. kind "logprob": log p(target); "logit_diff": logit[target] - logit[other]."""

    target: int
    other: int | None = None
    kind: str = "logprob"

    def __post_init__(self):
        if self.kind not in ("logprob", "logit_diff"):
            raise SettingsError(f"Unknown metric '{self.kind}'; use 'logprob' or 'logit_diff'.")
        if self.kind == "logit_diff" and self.other is None:
            raise SettingsError("A logit difference needs a second token.")

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> [...] (float32)."""
        logits = logits.float()
        if self.kind == "logit_diff":
            return logits[..., self.target] - logits[..., self.other]
        return torch.log_softmax(logits, dim=-1)[..., self.target]

    def describe(self, lm=None) -> str:
        dec = (lambda i: repr(lm.tokenizer.decode([i]))) if lm is not None else str
        if self.kind == "logit_diff":
            return f"logit[{dec(self.target)}] - logit[{dec(self.other)}]"
        return f"log p({dec(self.target)})"


def make_metric(lm, target: str | int, other: str | int | None = None, kind: str | None = None) -> Metric:
    """Default kind: logit difference when `other` is given, else target log-prob."""
    t = token_id(lm, target)
    o = None if other in (None, "") else token_id(lm, other)
    return Metric(target=t, other=o, kind=kind or ("logit_diff" if o is not None else "logprob"))


# ---------------------------------------------------------------------------------------------
# Running the model with edits


_KEEP: dict[type, bool] = {}


def _supports_logits_to_keep(model) -> bool:
    cls = type(model)
    if cls not in _KEEP:
        try:
            _KEEP[cls] = "logits_to_keep" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            _KEEP[cls] = False
    return _KEEP[cls]


def last_logits(lm, ids: torch.Tensor, edits: dict | None = None) -> torch.Tensor:
    """ids [B, T] -> logits at the last position [B, V], with `edits` active for this call only.
    Only the last position goes through the unembedding (`logits_to_keep=1` where supported)."""
    instrument(lm.adapter)
    kw = {"logits_to_keep": 1} if _supports_logits_to_keep(lm.model) else {}
    with torch.inference_mode(), recording(Recorder(capture=False, edits=dict(edits or {}))):
        out = lm.model(input_ids=ids, use_cache=False, **kw)
    return out.logits[:, -1]


def z_capture_edits(n_layers: int, store: dict) -> dict:
    """Identity edits on every layer's hook_z that keep the value (hook_z has no capture of its own)."""
    def keep(name, x):
        store[name] = x
        return x
    return {act_name("z", l): keep for l in range(n_layers)}


def trace_with_edits(lm, token_ids: Sequence[int], edits: dict | None = None, *, capture_z: bool = False,
                     store: dict | None = None) -> Trace:
    """Like model_core.interp.trace.trace, with edits active: the Trace of an intervened forward pass
    (views such as the logit lens then show the intervened model). With capture_z, each layer's
    hook_z [T, H*d_head] lands in `store` (a dict the caller passes)."""
    n_layers = lm.shape.n_layers
    edits = dict(edits or {})
    if capture_z:
        zs: dict = {}
        keep = z_capture_edits(n_layers, zs)
        for name, fn in keep.items():
            if name in edits:
                user = edits[name]
                edits[name] = (lambda u: (lambda n, x: keep[n](n, u(n, x))))(user)
            else:
                edits[name] = fn
    tr = trace(lm, token_ids=token_ids, edits=edits)
    if capture_z and store is not None:
        for name, z in zs.items():
            store[name] = z[0]
    return tr


# ---------------------------------------------------------------------------------------------
# Ablation


@dataclass(frozen=True)
class Ablation:
    """What to switch off. heads: (layer, head); mlps: layer; neurons: (layer, neuron)."""

    heads: tuple[tuple[int, int], ...] = ()
    mlps: tuple[int, ...] = ()
    neurons: tuple[tuple[int, int], ...] = ()
    mode: str = "zero"  # "zero" | "mean" (mean over the positions of the same prompt)

    @property
    def is_empty(self) -> bool:
        return not (self.heads or self.mlps or self.neurons)

    def describe(self) -> str:
        parts = [f"L{l}H{h}" for l, h in sorted(set(self.heads))]
        parts += [f"MLP{l}" for l in sorted(set(self.mlps))]
        parts += [f"L{l}N{n}" for l, n in sorted(set(self.neurons))]
        return (f"{self.mode}-ablated: " + ", ".join(parts)) if parts else "nothing ablated"


def _check_ablation(lm, ab: Ablation) -> None:
    s = lm.shape
    if ab.mode not in ("zero", "mean"):
        raise SettingsError(f"Unknown ablation mode '{ab.mode}'; use 'zero' or 'mean'.")
    for l, h in ab.heads:
        if not (0 <= l < s.n_layers and 0 <= h < s.n_heads):
            raise SettingsError(f"Head L{l}H{h} does not exist: layers 0..{s.n_layers - 1}, heads 0..{s.n_heads - 1}.")
    for l in ab.mlps:
        if not 0 <= l < s.n_layers:
            raise SettingsError(f"MLP layer {l} does not exist: layers 0..{s.n_layers - 1}.")
    for l, n in ab.neurons:
        if not (0 <= l < s.n_layers and 0 <= n < s.d_mlp):
            raise SettingsError(f"Neuron L{l}N{n} does not exist: layers 0..{s.n_layers - 1}, neurons 0..{s.d_mlp - 1}.")
    if ab.neurons and not hasattr(lm.adapter, "mlp_post_module"):
        raise SettingsError(f"Neuron ablation is not available for the '{lm.adapter.family}' family.")
    if ab.heads and not hasattr(lm.adapter, "attn_z_module"):
        raise SettingsError(f"Head ablation is not available for the '{lm.adapter.family}' family.")


def _replace(x: torch.Tensor, index, mode: str) -> torch.Tensor:
    """x [B, T, ...] -> a copy with x[..., index] zeroed or set to its mean over positions."""
    x = x.clone()
    if mode == "zero":
        x[..., index] = 0
    else:
        x[..., index] = x[..., index].mean(dim=1, keepdim=True)
    return x


def ablation_edits(lm, ablation: Ablation) -> dict:
    """The Recorder edits that perform `ablation` (validated)."""
    _check_ablation(lm, ablation)
    dh, mode = lm.shape.d_head, ablation.mode
    edits = {}
    by_layer: dict[int, list[int]] = {}
    for l, h in ablation.heads:
        by_layer.setdefault(int(l), []).append(int(h))
    s = lm.shape
    # zero ablations are RowEdits: the engine runs them per row (model_core.core.row_edits); a mean
    # is over one forward's positions, which a decode step's single position has not
    for l, heads in by_layer.items():
        cols = torch.cat([torch.arange(h * dh, (h + 1) * dh) for h in sorted(set(heads))])
        edits[act_name("z", l)] = (ZeroColumns(s.n_heads * dh, cols) if mode == "zero"
                                   else (lambda c: (lambda n, x: _replace(x, c.to(x.device), mode)))(cols))
    for l in set(ablation.mlps):
        edits[act_name("mlp_out", int(l))] = (
            ZeroColumns(s.d_model) if mode == "zero"
            else (lambda n, x: x.mean(dim=1, keepdim=True).expand_as(x).clone()))
    neurons: dict[int, list[int]] = {}
    for l, n in ablation.neurons:
        neurons.setdefault(int(l), []).append(int(n))
    for l, ns in neurons.items():
        idx = torch.tensor(sorted(set(ns)))
        edits[act_name("post", l)] = (ZeroColumns(s.d_mlp, idx) if mode == "zero"
                                      else (lambda i: (lambda n, x: _replace(x, i.to(x.device), mode)))(idx))
    return edits


@dataclass
class AblationResult:
    ablation: Ablation
    clean: Trace
    ablated: Trace
    metric: Metric | None = None
    clean_metric: float | None = None
    ablated_metric: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.clean.token_ids

    def next_token_probs(self, k: int = 10) -> dict:
        """Top-k of the union of clean and ablated next-token distributions, with both probabilities."""
        pc = torch.softmax(self.clean.next_logits.float(), -1)
        pa = torch.softmax(self.ablated.next_logits.float(), -1)
        ids = torch.unique(torch.cat([pc.topk(k).indices, pa.topk(k).indices]))
        ids = ids[torch.argsort(torch.maximum(pc[ids], pa[ids]), descending=True)][:k]
        return {"ids": ids.tolist(), "clean": pc[ids].tolist(), "ablated": pa[ids].tolist()}


def ablate(lm, prompt, ablation: Ablation, *, metric: Metric | None = None, chat: bool = False) -> AblationResult:
    """One clean and one ablated forward pass of the same prompt, both as full Traces (so every
    view, e.g. the logit lens, can show the difference)."""
    ids = prompt_ids(lm, prompt, chat=chat)
    edits = ablation_edits(lm, ablation)
    clean = trace_with_edits(lm, ids, {})
    ablated = trace_with_edits(lm, ids, edits)
    res = AblationResult(ablation=ablation, clean=clean, ablated=ablated, metric=metric)
    if metric is not None:
        res.clean_metric = float(metric(clean.next_logits))
        res.ablated_metric = float(metric(ablated.next_logits))
    return res


# ---------------------------------------------------------------------------------------------
# Activation patching


def _align(n_clean: int, n_corrupt: int, align: str) -> dict[int, int]:
    """corrupted position -> clean position."""
    if n_clean == n_corrupt:
        return {p: p for p in range(n_corrupt)}
    if align == "right":
        off = n_clean - n_corrupt
        return {p: p + off for p in range(n_corrupt) if 0 <= p + off < n_clean}
    if align == "error":
        raise PromptError(
            f"The clean prompt is {n_clean} tokens and the corrupted prompt is {n_corrupt}: patching needs "
            f"matching positions, so make them the same length or align them at the last token."
        )
    raise SettingsError(f"Unknown alignment '{align}'; use 'error' or 'right'.")


def default_batch_size(lm, n_tokens: int) -> int:
    """Rows per patched batch: a token budget (LMSCOPE_PATCH_TOKENS) divided by the prompt length."""
    budget = settings.current().patch_tokens or (65536 if lm.device.type == "cuda" else 1024)
    return max(1, budget // max(1, n_tokens))


@dataclass
class PatchingResult:
    kind: str  # "resid" (rows: layers, cols: corrupted positions) | "heads" (rows: layers, cols: heads)
    rows: list[int]
    cols: list[int]
    values: torch.Tensor  # [R, C] raw metric of the patched run (NaN: not patched)
    clean_value: float
    corrupted_value: float
    metric: Metric
    clean_ids: list[int]
    corrupted_ids: list[int]
    n_forward: int
    batch_size: int
    seconds: float
    aligned: str = "same length"

    @property
    def delta(self) -> torch.Tensor:
        """Change in the metric vs the corrupted run."""
        return self.values - self.corrupted_value

    @property
    def normalized(self) -> torch.Tensor:
        """0 = corrupted, 1 = clean; NaN when clean and corrupted score the same."""
        denom = self.clean_value - self.corrupted_value
        if abs(denom) < 1e-6:
            return torch.full_like(self.values, float("nan"))
        return self.delta / denom

    def to_dict(self) -> dict:
        """JSON-ready (for a job result)."""
        def rows(t):
            return [[None if math.isnan(v) else v for v in r] for r in t.tolist()]
        return {"kind": self.kind, "rows": self.rows, "cols": self.cols, "values": rows(self.values),
                "delta": rows(self.delta), "normalized": rows(self.normalized),
                "clean_value": self.clean_value, "corrupted_value": self.corrupted_value,
                "metric": {"target": self.metric.target, "other": self.metric.other, "kind": self.metric.kind},
                "clean_ids": self.clean_ids, "corrupted_ids": self.corrupted_ids, "n_forward": self.n_forward,
                "batch_size": self.batch_size, "seconds": self.seconds, "aligned": self.aligned}


def _run_cells(lm, corrupted_ids: list[int], cells: list, make_edits, metric: Metric, batch_size: int,
               progress: Progress | None) -> tuple[list[float], int]:
    """Run `cells` in batches of corrupted copies; make_edits(cells_of_batch) -> edits where the
    batch row r carries cells_of_batch[r]. Returns one metric value per cell and the pass count."""
    out: list[float] = []
    n = 0
    base = torch.tensor([corrupted_ids], device=lm.device)
    for start in range(0, len(cells), batch_size):
        chunk = cells[start:start + batch_size]
        ids = base.expand(len(chunk), -1)
        edits = make_edits(chunk)
        if progress is not None:  # one report as each layer of the batch starts, not only per batch
            edits = layer_ticks(edits, lm.shape.n_layers,
                                lambda l, s=start, k=len(chunk): progress((s + k * l / lm.shape.n_layers) / len(cells)))
        logits = last_logits(lm, ids, edits)
        out += metric(logits).tolist()
        n += 1
        if progress is not None:
            progress(min(1.0, (start + len(chunk)) / len(cells)))
    return out, n


def layer_ticks(edits: dict, n_layers: int, tick: Callable[[int], None]) -> dict:
    """`edits` plus a call tick(l) as layer l's input arrives (an identity edit on hook_resid_pre,
    composed with an edit already there): progress per layer inside one batched forward, and a
    place to stop (an exception raised by tick ends the forward)."""
    out = dict(edits)
    for l in range(n_layers):
        name = act_name("resid_pre", l)
        inner = out.get(name)

        def edit(nm, x, l=l, inner=inner):
            tick(l)
            return inner(nm, x) if inner is not None else x
        out[name] = edit
    return out


def _capture(lm, ids: list[int], z: bool = False) -> tuple[dict, torch.Tensor]:
    """One forward pass keeping every layer's resid_pre (and hook_z): store with [T, ...] tensors."""
    store: dict = {}
    tr = trace_with_edits(lm, ids, {}, capture_z=z, store=store)
    for l in range(lm.shape.n_layers):
        store[act_name("resid_pre", l)] = tr.resid_pre[l]
    return store, tr.next_logits


def patch_residual(lm, clean, corrupted, metric: Metric, *, layers: Sequence[int] | None = None,
                   positions: Sequence[int] | None = None, align: str = "error", batch_size: int | None = None,
                   progress: Progress | None = None, chat: bool = False) -> PatchingResult:
    """Residual-stream patching: cell (l, p) runs the corrupted prompt with blocks.{l}.hook_resid_pre
    at corrupted position p replaced by the clean value (at the aligned clean position)."""
    t0 = time.perf_counter()
    c_ids, k_ids = prompt_ids(lm, clean, chat), prompt_ids(lm, corrupted, chat)
    pos_map = _align(len(c_ids), len(k_ids), align)
    L = lm.shape.n_layers
    layers = list(range(L)) if layers is None else sorted({int(l) for l in layers})
    if any(not 0 <= l < L for l in layers):
        raise SettingsError(f"Layers must be between 0 and {L - 1}.")
    T = len(k_ids)
    positions = list(range(T)) if positions is None else sorted({int(p) % T for p in positions})
    clean_store, clean_logits = _capture(lm, c_ids)
    corrupted_logits = last_logits(lm, torch.tensor([k_ids], device=lm.device))[0]
    cells = [(l, p) for l in layers for p in positions if p in pos_map]

    def make_edits(chunk):
        per_layer: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for r, (l, p) in enumerate(chunk):
            rows, ps, cps = per_layer.setdefault(l, ([], [], []))
            rows.append(r), ps.append(p), cps.append(pos_map[p])
        edits = {}
        for l, (rows, ps, cps) in per_layer.items():
            src = clean_store[act_name("resid_pre", l)][cps]  # [n, d]

            def edit(name, x, rows=rows, ps=ps, src=src):
                x = x.clone()
                x[rows, ps] = src.to(x.dtype)
                return x
            edits[act_name("resid_pre", l)] = edit
        return edits

    bs = batch_size or default_batch_size(lm, T)
    vals, n = _run_cells(lm, k_ids, cells, make_edits, metric, bs, progress)
    grid = torch.full((len(layers), len(positions)), float("nan"))
    li, pi = {l: i for i, l in enumerate(layers)}, {p: i for i, p in enumerate(positions)}
    for (l, p), v in zip(cells, vals):
        grid[li[l], pi[p]] = v
    return PatchingResult(
        kind="resid", rows=layers, cols=positions, values=grid, clean_value=float(metric(clean_logits)),
        corrupted_value=float(metric(corrupted_logits)), metric=metric, clean_ids=c_ids, corrupted_ids=k_ids,
        n_forward=n + 2, batch_size=bs, seconds=time.perf_counter() - t0,
        aligned="same length" if len(c_ids) == len(k_ids) else "aligned at the last token")


def _head_cell_edits(chunk: list[tuple[int, int]], d_head: int, write) -> dict:
    """hook_z edits for a batch whose row r carries the head cell chunk[r] = (layer, head):
    write(layer, x, r, columns) changes that head's columns of row r in x, a copy of the layer's
    hook_z [B, T, H*d_head]."""
    per_layer: dict[int, list[tuple[int, int]]] = {}
    for r, (l, h) in enumerate(chunk):
        per_layer.setdefault(l, []).append((r, h))

    def layer_edit(l, rows_heads):
        def edit(name, x):
            x = x.clone()
            for r, h in rows_heads:
                write(l, x, r, slice(h * d_head, (h + 1) * d_head))
            return x
        return edit
    return {act_name("z", l): layer_edit(l, rh) for l, rh in per_layer.items()}


def patch_heads(lm, clean, corrupted, metric: Metric, *, layers: Sequence[int] | None = None,
                align: str = "error", batch_size: int | None = None, progress: Progress | None = None,
                chat: bool = False) -> PatchingResult:
    """Head-output patching: cell (l, h) runs the corrupted prompt with head h's slice of
    blocks.{l}.attn.hook_z replaced by the clean one at every (aligned) position."""
    t0 = time.perf_counter()
    if not hasattr(lm.adapter, "attn_z_module"):
        raise SettingsError(f"Head patching is not available for the '{lm.adapter.family}' family.")
    c_ids, k_ids = prompt_ids(lm, clean, chat), prompt_ids(lm, corrupted, chat)
    pos_map = _align(len(c_ids), len(k_ids), align)
    kp = torch.tensor(sorted(pos_map))
    cp = torch.tensor([pos_map[p] for p in sorted(pos_map)])
    s = lm.shape
    layers = list(range(s.n_layers)) if layers is None else sorted({int(l) for l in layers})
    if any(not 0 <= l < s.n_layers for l in layers):
        raise SettingsError(f"Layers must be between 0 and {s.n_layers - 1}.")
    clean_store, clean_logits = _capture(lm, c_ids, z=True)
    corrupted_logits = last_logits(lm, torch.tensor([k_ids], device=lm.device))[0]
    cells = [(l, h) for l in layers for h in range(s.n_heads)]

    def patch(l, x, r, sl):  # row r's head columns sl <- the clean run's, at aligned positions
        z = clean_store[act_name("z", l)]  # [T_clean, H*dh]
        x[r, kp.to(x.device), sl] = z[cp.to(z.device), sl].to(x.dtype)

    bs = batch_size or default_batch_size(lm, len(k_ids))
    vals, n = _run_cells(lm, k_ids, cells, lambda chunk: _head_cell_edits(chunk, s.d_head, patch), metric, bs,
                         progress)
    grid = torch.tensor(vals, dtype=torch.float32).view(len(layers), s.n_heads)
    return PatchingResult(
        kind="heads", rows=layers, cols=list(range(s.n_heads)), values=grid,
        clean_value=float(metric(clean_logits)), corrupted_value=float(metric(corrupted_logits)), metric=metric,
        clean_ids=c_ids, corrupted_ids=k_ids, n_forward=n + 2, batch_size=bs, seconds=time.perf_counter() - t0,
        aligned="same length" if len(c_ids) == len(k_ids) else "aligned at the last token")


def head_ablation_sweep(lm, prompt, metric: Metric, *, mode: str = "zero", batch_size: int | None = None,
                        progress: Progress | None = None, chat: bool = False) -> torch.Tensor:
    """Ablate each head on its own (one batch row per head): the metric change [layers, heads]
    vs the clean run. Negative = the head helped the target."""
    ids = prompt_ids(lm, prompt, chat)
    s = lm.shape
    base = float(metric(last_logits(lm, torch.tensor([ids], device=lm.device))[0]))
    cells = [(l, h) for l in range(s.n_layers) for h in range(s.n_heads)]

    def ablate_head(l, x, r, sl):
        x[r, :, sl] = 0 if mode == "zero" else x[r, :, sl].mean(dim=0, keepdim=True)

    if mode not in ("zero", "mean"):
        raise SettingsError(f"Unknown ablation mode '{mode}'; use 'zero' or 'mean'.")
    vals, _ = _run_cells(lm, ids, cells, lambda chunk: _head_cell_edits(chunk, s.d_head, ablate_head), metric,
                         batch_size or default_batch_size(lm, len(ids)), progress)
    return torch.tensor(vals).view(s.n_layers, s.n_heads) - base


# ---------------------------------------------------------------------------------------------
# Two prompts side by side


@dataclass
class Comparison:
    a: Trace
    b: Trace
    resid_diff_norm: torch.Tensor  # [L] ||resid_post_a[l][-1] - resid_post_b[l][-1]|| (last positions)
    resid_rel_diff: torch.Tensor  # [L] the same divided by the mean of the two norms
    resid_cosine: torch.Tensor  # [L]
    top: dict = field(default_factory=dict)


def compare_prompts(lm, a, b, *, k: int = 10, chat: bool = False) -> Comparison:
    """Two prompts side by side: next-token distributions and, per layer, how far apart the
    residual streams are at the last position (the position that predicts the next token)."""
    ta = trace_with_edits(lm, prompt_ids(lm, a, chat))
    tb = trace_with_edits(lm, prompt_ids(lm, b, chat))
    norms, rel, cos = [], [], []
    with torch.inference_mode():
        for l in range(lm.shape.n_layers):
            ra, rb = ta.resid_post(l)[-1].float(), tb.resid_post(l)[-1].float()
            d = torch.linalg.vector_norm(ra - rb)
            norms.append(float(d))
            rel.append(float(d / ((ra.norm() + rb.norm()) / 2).clamp_min(1e-12)))
            cos.append(float(torch.nn.functional.cosine_similarity(ra, rb, dim=0)))
    top = {}
    for key, t in (("a", ta), ("b", tb)):
        p = torch.softmax(t.next_logits.float(), -1)
        v, i = p.topk(min(k, p.shape[-1]))
        top[key] = {"ids": i.tolist(), "probs": v.tolist(),
                    "tokens": [lm.tokenizer.decode([j]) for j in i.tolist()]}
    return Comparison(a=ta, b=tb, resid_diff_norm=torch.tensor(norms), resid_rel_diff=torch.tensor(rel),
                      resid_cosine=torch.tensor(cos), top=top)
