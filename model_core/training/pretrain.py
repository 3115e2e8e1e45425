"""Training a tiny decoder from scratch, and a scaling sweep that fits L(N).

Pure torch + transformers (no celery, no gradio). The Celery jobs (tasks/pretrain_job.py, kinds
'pretrain' and 'scaling') and the tests call `run_pretrain` / `run_scaling`; the text comes from the
caller (the jobs pass the built-in corpus, tasks.corpus: the standard library's docstrings, with its
own held-out split), so model_core never reaches into tasks.

Model: a LlamaConfig decoder (RMSNorm, RoPE, SwiGLU, multi-head attention with head_dim 32,
tied input/output embedding) of width d, n layers, MLP width 8/3·d rounded up to a multiple of 16,
so each layer holds ≈ 12·d² weights as in Kaplan et al.'s 12·n_layer·d_model² count.

Tokenizer: the 258-token byte tokenizer of model_core.core.tokenization (one byte = one token, plus
<bos>/<eos>). It trains fastest here: with the default model's 49,152-token vocabulary the tied
embedding alone would be 49,152·d weights (3.1M at d = 64, thirty times the body of a 2-layer
model) and the output softmax would cost 2·49,152·d FLOPs per token against the body's ≈ 24·n·d²
(at d = 128, n = 2: 12.6M vs 0.8M, the head 16x the body); with 258 tokens the body is almost all
of the compute and all of the parameters, which is what a scaling law in N is about. The price:
losses are nats per *byte* (bits per byte = loss / ln 2), not per BPE token, so they are not on the
same scale as the published laws (which are per token of their own tokenizers and data).

Parameters are counted each tensor once (the tied output matrix is the embedding). N for the
scaling law is the non-embedding count, as Kaplan et al. (2020) do: every parameter except the token
embedding (attention, MLP and all RMSNorm gains; this model has no position embedding). The
Chinchilla fit (Hoffmann et al. 2022) uses all parameters; both counts are reported.

Training: plain torch. AdamW (β = 0.9, 0.95; weight decay 0.1 on matrices, none on gains), linear
warm-up then cosine decay to 10 % of the peak rate, gradient clipping at 1.0, batches of random
windows of `context` + 1 tokens from the training stream (seeded: the same windows for every width).
Held-out loss (and perplexity = e^loss) on fixed windows of the held-out text at step 0, every
`eval_every` steps and at the end.

Checkpoints register as models (<data dir>/models/<name>, lmscope.json {from_scratch: true, ...}),
so they open in every model picker like SFT results: the final model as <name>, and with
keep_checkpoints = K the model at K evenly spaced steps starting with step 0 (the random
initialisation) as <name>-step<S>. Written to a staging folder and renamed only when the run
succeeds: a cancelled or failed run registers nothing.

Scaling sweep (`run_scaling`): the same settings and the same token budget for several widths, one
after another; each width's final held-out loss against its non-embedding N, fitted by least
squares as log L = log a - α log N (`fit_power_law`: α, its standard error, R²), and with four or
more widths also L = E + A / N^α (`fit_power_law_offset`, a grid over E; scipy is not needed).

Depth sweep (`run_scaling(depths=..., params=N)`): each depth at the width whose counted N is closest
(`depth_shapes`: any width make_config splits into heads, within ≈ 6 % of N); nothing to fit at equal N.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from model_core.core.checkpoints import valid_output_name
from model_core.core.errors import LmscopeError, SettingsError
from model_core.training.run import TrainingRun
from model_core.training.sft_settings import setting_number

ProgressFn = Callable[[dict], None]

HEAD_DIM = 32
MAX_WIDTH = 1024
MAX_LAYERS = 12
MAX_CONTEXT = 1024
MAX_STEPS = 100_000
MAX_WIDTHS = 8
MAX_KEEP_CHECKPOINTS = 20
MAX_PARAMS = 200_000_000  # non-embedding target of a depth sweep (12 layers at width 1024 is ≈ 150M)
# A depth's closest width must come this close to the target N, else the target is out of that
# depth's range (the width step alone leaves at most ≈ 6 %).
SHAPE_TOLERANCE = 0.10

# The published fits the sweep is drawn against (their data, their tokenizers, their N: not ours).
KAPLAN_2020 = {"name": "Kaplan et al. 2020", "alpha_N": 0.076, "N_c": 8.8e13,
               "form": "L(N) = (N_c / N)^α_N", "N": "non-embedding parameters",
               "data": "WebText2, nats per BPE token", "ref": "arXiv:2001.08361, eq. 1.1"}
CHINCHILLA_2022 = {"name": "Hoffmann et al. 2022 (Chinchilla)", "E": 1.69, "A": 406.4, "B": 410.7,
                   "alpha": 0.34, "beta": 0.28, "form": "L(N, D) = E + A / N^α + B / D^β",
                   "N": "all parameters", "data": "MassiveText, nats per SentencePiece token",
                   "ref": "arXiv:2203.15556, eq. 10 (approach 3)"}


def kaplan_loss(n: float) -> float:
    """Kaplan et al. (2020) L(N) = (N_c/N)^0.076, N non-embedding (their fit on WebText2)."""
    return (KAPLAN_2020["N_c"] / float(n)) ** KAPLAN_2020["alpha_N"]


def chinchilla_loss(n: float, d: float) -> float:
    """Hoffmann et al. (2022) L(N, D) = E + A/N^α + B/D^β (their fit on MassiveText)."""
    c = CHINCHILLA_2022
    return c["E"] + c["A"] / float(n) ** c["alpha"] + c["B"] / float(d) ** c["beta"]


class PretrainError(LmscopeError):
    """A run that cannot start or did not finish; str() is one sentence."""


class PretrainCancelled(Exception):
    """should_stop() asked the run to stop; nothing was registered."""


# =============================================================================================
# Settings

@dataclass
class PretrainSettings:
    width: int = 128  # d_model
    layers: int = 2
    context: int = 128  # tokens per training window
    batch_size: int = 16
    max_steps: int | None = None  # wins over tokens when both are set
    tokens: int | None = None  # training-token budget: steps = ceil(tokens / (batch_size * context))
    learning_rate: float = 2e-3
    warmup_steps: int | None = None  # default 5 % of the steps (at least 1)
    weight_decay: float = 0.1
    eval_every: int | None = None  # default: 10 evaluations per run
    eval_tokens: int = 8192  # held-out tokens per evaluation (fixed windows)
    seed: int = 0
    output_name: str | None = None
    keep_checkpoints: int = 0  # register the model at this many evenly spaced steps, step 0 first
    device: str | None = None
    overwrite: bool = False

    def steps(self) -> int:
        if self.max_steps:
            return int(self.max_steps)
        if self.tokens:
            return max(1, math.ceil(self.tokens / (self.batch_size * self.context)))
        return 200

    def to_json(self) -> dict:
        d = asdict(self)
        d["max_steps"] = self.steps()
        d["warmup_steps"] = self.warmup()
        d["eval_every"] = self.eval_interval()
        d["tokenizer"] = "byte (258 tokens)"
        return d

    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, round(0.05 * self.steps()))

    def eval_interval(self) -> int:
        return self.eval_every or max(1, self.steps() // 10)


def head_split(width: int) -> tuple[int, int]:
    """(heads, head size) make_config uses for a width: heads of about HEAD_DIM."""
    heads = max(1, width // HEAD_DIM)
    return heads, width // heads


def width_ok(width: int) -> bool:
    """Whether make_config can build this width: whole heads of an even size (RoPE rotates pairs)."""
    heads, hd = head_split(width)
    return 16 <= width <= MAX_WIDTH and heads * hd == width and hd % 2 == 0


def _width_problem(w: int) -> str | None:
    """The one sentence for a user-given width (a multiple of 16 that splits into heads), or None."""
    if w % 16:
        return f"Setting 'width' must be a multiple of 16, got {w}."
    near = [v for v in range(16, MAX_WIDTH + 1, 16) if width_ok(v)]
    return None if width_ok(w) else (f"Width {w} does not split into {head_split(w)[0]} heads of an even size; "
                                     f"use {max(v for v in near if v < w)} or {min(v for v in near if v > w)}.")


def validate_settings(raw: dict | PretrainSettings, any_width: bool = False) -> PretrainSettings:
    """Settings with every value checked; SettingsError (one sentence) otherwise. any_width: the
    width need not be a multiple of 16, only splittable into heads (a depth sweep's shapes)."""
    if isinstance(raw, PretrainSettings):
        raw = asdict(raw)
    d = {k: v for k, v in dict(raw or {}).items() if v is not None and v != ""}
    known = set(PretrainSettings.__dataclass_fields__)
    bad = sorted(set(d) - known)
    if bad:
        raise SettingsError(f"Unknown pretraining setting '{bad[0]}'.")
    s = PretrainSettings()
    s.width = setting_number({**asdict(s), **d}, "width", int, 16, MAX_WIDTH)
    if any_width and not width_ok(s.width):
        raise SettingsError(f"Width {s.width} does not split into heads of an even size.")
    if not any_width and _width_problem(s.width):
        raise SettingsError(_width_problem(s.width))
    s.layers = setting_number({**asdict(s), **d}, "layers", int, 1, MAX_LAYERS)
    s.context = setting_number({**asdict(s), **d}, "context", int, 8, MAX_CONTEXT)
    s.batch_size = setting_number({**asdict(s), **d}, "batch_size", int, 1, 512)
    s.max_steps = setting_number(d, "max_steps", int, 1, MAX_STEPS, allow_none=True)
    s.tokens = setting_number(d, "tokens", int, 1, MAX_STEPS * 512 * MAX_CONTEXT, allow_none=True)
    if s.steps() > MAX_STEPS:
        raise SettingsError(f"{s.tokens:,} tokens at batch {s.batch_size} x context {s.context} is "
                            f"{s.steps():,} steps, over the limit of {MAX_STEPS:,}.")
    s.warmup_steps = setting_number(d, "warmup_steps", int, 0, MAX_STEPS, allow_none=True)
    s.eval_every = setting_number(d, "eval_every", int, 1, MAX_STEPS, allow_none=True)
    s.eval_tokens = setting_number({**asdict(s), **d}, "eval_tokens", int, s.context, 1_000_000)
    s.seed = setting_number({**asdict(s), **d}, "seed", int, 0, 2**31 - 1)
    s.keep_checkpoints = setting_number({**asdict(s), **d}, "keep_checkpoints", int, 0, MAX_KEEP_CHECKPOINTS)
    for key in ("learning_rate", "weight_decay"):
        v = d.get(key, getattr(s, key))
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise SettingsError(f"Setting '{key}' must be a number, got {v!r}.") from None
        if not math.isfinite(v) or v < 0 or (key == "learning_rate" and not 0 < v <= 1):
            raise SettingsError(f"Setting '{key}' is out of range: {v!r}.")
        setattr(s, key, v)
    name = d.get("output_name")
    if name is not None:
        if not valid_output_name(name):
            raise SettingsError("The model name may use letters, digits, '.', '_' and '-' (at most 100 characters).")
        s.output_name = name
    dev = d.get("device")
    s.device = str(dev) if dev else None
    s.overwrite = bool(d.get("overwrite", False))
    return s


def _parse_list(value, what: str, sweep: str, lo: int, hi: int, example: str) -> list[int]:
    """'a,b,c' or [a, b, c] -> sorted distinct whole numbers in [lo, hi], two to MAX_WIDTHS of them."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.replace(" ", ",").split(",") if p.strip()]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise SettingsError(f"Give the {what} as a list like {example}.")
    try:
        xs = sorted({setting_number({what: p}, what, int, lo, hi) for p in parts})
    except SettingsError:
        raise SettingsError(f"{what.capitalize()} must be whole numbers from {lo} to {hi}, like {example}.") from None
    if len(xs) < 2:
        raise SettingsError(f"A {sweep} sweep needs at least two different {what}.")
    if len(xs) > MAX_WIDTHS:
        raise SettingsError(f"A {sweep} sweep takes at most {MAX_WIDTHS} {what}.")
    return xs


def parse_widths(value) -> list[int]:
    """'64,128,256' or [64, 128, 256] -> sorted distinct widths; SettingsError otherwise."""
    ws = _parse_list(value, "widths", "scaling", 16, MAX_WIDTH, "64,128,256")
    for w in filter(_width_problem, ws):
        raise SettingsError(_width_problem(w).replace("Setting 'width'", "Every width"))
    return ws


def parse_depths(value) -> list[int]:
    """'1,2,4,8' or [1, 2, 4, 8] -> sorted distinct depths (layers); SettingsError otherwise."""
    return _parse_list(value, "depths", "depth", 1, MAX_LAYERS, "1,2,4,8")


def parse_params(value) -> int:
    """A depth sweep's target non-embedding parameter count; SettingsError otherwise."""
    return setting_number({"params": value}, "params", int, 1, MAX_PARAMS)


def default_output_name(s: PretrainSettings, suffix: str | None = None) -> str:
    return f"scratch-d{s.width}-l{s.layers}-" + (suffix or time.strftime("%Y%m%d-%H%M%S"))


# =============================================================================================
# Model and data

def mlp_width(width: int) -> int:
    return 16 * math.ceil(8 * width / 3 / 16)


def make_config(width: int, layers: int, context: int, vocab_size: int = 258, bos: int = 256, eos: int = 257):
    from transformers import LlamaConfig

    heads, hd = head_split(width)
    return LlamaConfig(
        hidden_size=width, intermediate_size=mlp_width(width), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hd,
        vocab_size=vocab_size, max_position_embeddings=context, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
        initializer_range=0.02, attention_bias=False, mlp_bias=False,
    )


def build_model(s: PretrainSettings, tokenizer=None):
    """(model, tokenizer): a fresh LlamaForCausalLM with random weights (seed s.seed), fp32."""
    from transformers import LlamaForCausalLM

    from model_core.core.tokenization import byte_tokenizer

    tok = tokenizer or byte_tokenizer()
    cfg = make_config(s.width, s.layers, s.context, len(tok), tok.bos_token_id, tok.eos_token_id)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        model = LlamaForCausalLM(cfg)
    return model, tok


def param_counts(model) -> dict:
    """{'total', 'embedding', 'non_embedding'}: each tensor counted once (the tied output matrix is
    the token embedding). Non-embedding = everything but the token embedding (Kaplan's N)."""
    def key(p):  # a meta tensor (shape_params) has no storage to compare: its identity instead
        return ("id", id(p)) if p.is_meta else ("ptr", p.data_ptr())

    seen, total = set(), 0
    for p in model.parameters():  # parameters() already yields a shared tensor once; be explicit anyway
        if key(p) in seen:
            continue
        seen.add(key(p))
        total += p.numel()
    emb = (emb_w := model.get_input_embeddings().weight).numel()
    out = model.get_output_embeddings()
    untied = out is not None and key(out.weight) != key(emb_w)
    emb_all = emb + (out.weight.numel() if untied else 0)
    return {"total": total, "embedding": emb_all, "non_embedding": total - emb_all}


@functools.lru_cache(maxsize=4096)
def shape_params(width: int, layers: int) -> int:
    """Non-embedding parameters of the (width, layers) model, counted by param_counts on a model
    built on the meta device (the real model's structure, no weights allocated)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(make_config(width, layers, 8))
    return param_counts(model)["non_embedding"]


def shape_widths() -> list[int]:
    """Every width make_config can build, ascending (the depth sweep's choices)."""
    return [w for w in range(16, MAX_WIDTH + 1, 2) if width_ok(w)]


def depth_shapes(depths, n_target: int) -> list[dict]:
    """Per depth, the buildable width whose counted non-embedding N is closest to n_target:
    [{layers, width, n_non_embedding}]. SettingsError (one sentence) when a depth cannot come within
    SHAPE_TOLERANCE of it (too few parameters for the deepest, too many for the shallowest)."""
    ws, out = shape_widths(), []
    for layers in depths:
        lo, hi = 0, len(ws) - 1
        while lo < hi:  # N grows with the width: the first width at or above the target
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if shape_params(ws[mid], layers) >= n_target else (mid + 1, hi)
        w = min(ws[max(lo - 1, 0):lo + 1], key=lambda c: (abs(shape_params(c, layers) - n_target), c))
        out.append({"layers": int(layers), "width": w, "n_non_embedding": shape_params(w, layers)})
    far = [s for s in out if abs(s["n_non_embedding"] - n_target) > SHAPE_TOLERANCE * n_target]
    few = [s for s in far if s["n_non_embedding"] > n_target]
    if far:  # name the deepest shape the target is too small for, else the shallowest it is too large for
        s = max(few, key=lambda s: s["layers"]) if few else min(far, key=lambda s: s["layers"])
        raise SettingsError(f"{n_target:,} non-embedding parameters is too {'few' if few else 'many'} for "
                            f"{s['layers']} layer{'s' if s['layers'] > 1 else ''} (the "
                            f"{'narrowest' if few else 'widest'}, width {s['width']}, has {s['n_non_embedding']:,}); "
                            f"give {'more' if few else 'fewer'} parameters or {'fewer' if few else 'more'} layers.")
    return out


def point_name(prefix: str, width: int, layers: int | None = None) -> str:
    """A sweep point's model name: '<prefix>-d<width>', or '<prefix>-L<layers>-d<width>' in a depth sweep."""
    return f"{prefix}-d{width}" if layers is None else f"{prefix}-L{layers}-d{width}"


def encode_docs(tokenizer, docs: list[str]) -> torch.Tensor:
    """One stream of token ids: each document's tokens followed by <eos>."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    enc = tokenizer(list(docs), add_special_tokens=False)["input_ids"]
    for e in enc:
        ids.extend(e)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def eval_windows(stream: torch.Tensor, context: int, n_tokens: int) -> torch.Tensor:
    """Fixed, evenly spaced windows [k, context + 1] of the held-out stream (k·context ≈ n_tokens)."""
    span = context + 1
    if stream.numel() < span:
        raise PretrainError(f"The held-out text has {stream.numel()} tokens, fewer than one window of {span}.")
    k = max(1, min(n_tokens // context, stream.numel() // span))
    starts = torch.linspace(0, stream.numel() - span, k).long()
    return torch.stack([stream[i:i + span] for i in starts.tolist()])


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device) -> float:
    """Mean next-token cross-entropy (nats per token) over the windows."""
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i:i + batch_size].to(device)
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += float(loss)
        n += w[:, 1:].numel()
    model.train(was)
    return total / max(n, 1)


def lr_at(step: int, s: PretrainSettings) -> float:
    """Linear warm-up to the peak, then cosine decay to 10 % of it at the last step (0-based step)."""
    total, warm = s.steps(), s.warmup()
    if step < warm:
        return s.learning_rate * (step + 1) / warm
    if total <= warm:
        return s.learning_rate
    t = (step - warm) / max(1, total - warm)
    return s.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def checkpoint_steps(max_steps: int, keep: int) -> list[int]:
    """`keep` evenly spaced steps from 0 (the random initialisation) below the last step."""
    if keep <= 0:
        return []
    return sorted({round(max_steps * i / keep) for i in range(keep)} & set(range(0, max_steps)))


# =============================================================================================
# The run

@dataclass
class PretrainResult:
    name: str
    path: Path
    info: dict
    history: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)  # [{name, step, path}]


def run_pretrain(settings: PretrainSettings | dict, train_docs: list[str], heldout_docs: list[str],
                 progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
                 log: Callable[[str], None] | None = None, data_note: str = "",
                 any_width: bool = False) -> PretrainResult:
    """Train a tiny decoder from scratch and register it (see the module docstring; the name checks,
    staging folder, cancel, lmscope.json and registration are run.TrainingRun's).

    progress(dict) gets {phase: 'training', step, max_steps, loss, eval_loss, eval_ppl, lr,
    tokens_seen, tokens_per_s, elapsed_s, eta_s}: a row per step with the training loss, and a row
    with eval_loss/eval_ppl (loss None) at step 0, every eval_every steps and at the end. Also
    {phase: 'saving'} and {phase: 'done'}. should_stop() is polled between steps (-> PretrainCancelled,
    nothing registered); a non-finite loss -> PretrainError. any_width: as validate_settings'."""
    from model_core.core.registry import resolve_device

    s = validate_settings(settings, any_width=any_width)
    max_steps = s.steps()
    run = TrainingRun(s.output_name or default_output_name(s), error_cls=PretrainError,
                      cancelled_cls=PretrainCancelled, overwrite=s.overwrite, progress=progress,
                      should_stop=should_stop, log=log, max_steps=max_steps)
    c_steps = checkpoint_steps(max_steps, s.keep_checkpoints)
    run.reserve_checkpoints(c_steps)
    dev, _ = resolve_device(s.device)
    with run:
        return _pretrain(s, run, dev, c_steps, train_docs, heldout_docs, data_note)


def _pretrain(s: PretrainSettings, run: TrainingRun, dev, c_steps: list[int], train_docs: list[str],
              heldout_docs: list[str], data_note: str) -> PretrainResult:
    """run_pretrain inside its TrainingRun: the model, the data, the training loop, the record."""
    say, name, max_steps = run.say, run.name, run.max_steps
    model, tok = build_model(s)
    model.to(dev).train()
    counts = param_counts(model)
    train_ids = encode_docs(tok, train_docs)
    held_ids = encode_docs(tok, heldout_docs)
    span = s.context + 1
    if train_ids.numel() < span:
        raise PretrainError(f"The training text has {train_ids.numel()} tokens, fewer than one window of {span}.")
    windows = eval_windows(held_ids, s.context, s.eval_tokens)
    tokens_per_step = s.batch_size * s.context
    say(f"model: d_model {s.width}, {s.layers} layers, {model.config.num_attention_heads} heads of "
        f"{model.config.head_dim}, MLP {model.config.intermediate_size}; {counts['non_embedding']:,} non-embedding "
        f"+ {counts['embedding']:,} embedding parameters (tied output)")
    say(f"data: {train_ids.numel():,} training tokens (bytes), {held_ids.numel():,} held-out; "
        f"{max_steps} steps x {tokens_per_step:,} tokens = {max_steps * tokens_per_step:,} tokens "
        f"({max_steps * tokens_per_step / train_ids.numel():.2f} passes); evaluating on "
        f"{windows.shape[0] * s.context:,} held-out tokens every {s.eval_interval()} steps, on {dev}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr_at(0, s), betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(s.seed)
    history: list[dict] = []
    train_time = 0.0
    eval_every = s.eval_interval()

    def row(step, **kw):
        elapsed = time.time() - run.t_start
        eta = train_time / step * (max_steps - step) if step else None
        return {"phase": "training", "step": step, "max_steps": max_steps, "tokens_seen": step * tokens_per_step,
                "tokens_per_s": round(step * tokens_per_step / train_time, 1) if train_time > 0 else None,
                "elapsed_s": round(elapsed, 2), "eta_s": round(eta, 1) if eta is not None else None, **kw}

    def do_eval(step):
        ev = evaluate(model, windows, s.batch_size, dev)
        if not math.isfinite(ev):
            raise PretrainError(f"The held-out loss became NaN/inf at step {step}; lower the learning rate.")
        r = row(step, loss=None, lr=None, eval_loss=ev, eval_ppl=math.exp(min(ev, 50.0)))
        for h in reversed(history):
            if h["step"] == step:
                h["eval_loss"], h["eval_ppl"] = ev, r["eval_ppl"]
                break
        else:
            history.append({k: v for k, v in r.items() if k != "phase"})
        run.progress(r)
        return ev

    def keep(step):
        d = run.checkpoint_dir(step)
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)

    first_eval = do_eval(0)
    say(f"held-out loss at initialisation: {first_eval:.3f} nats/token (ln {len(tok)} = {math.log(len(tok)):.3f})")
    if 0 in c_steps:
        keep(0)
    for step in range(max_steps):
        run.check_stop()
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s)
        starts = torch.randint(0, train_ids.numel() - span + 1, (s.batch_size,), generator=gen)
        batch = torch.stack([train_ids[i:i + span] for i in starts.tolist()]).to(dev)  # [batch, context + 1]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        lv = float(loss.detach())
        if not math.isfinite(lv):
            raise PretrainError(f"The loss became NaN/inf at step {step + 1}; lower the learning rate.")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        train_time += time.time() - t0
        done = step + 1
        r = row(done, loss=lv, lr=opt.param_groups[0]["lr"], grad_norm=gn, eval_loss=None)
        history.append({k: v for k, v in r.items() if k != "phase"})
        run.progress(r)
        if done in c_steps:
            keep(done)
        if done % eval_every == 0 or done == max_steps:
            do_eval(done)
    run.check_stop()
    run.phase("saving", max_steps)
    evals = [h for h in history if h.get("eval_loss") is not None]
    final_eval = evals[-1]["eval_loss"]
    train_losses = [h["loss"] for h in history if h.get("loss") is not None]
    metrics = {"steps": max_steps, "tokens": max_steps * tokens_per_step, "train_seconds": round(train_time, 2),
               "tokens_per_s": round(max_steps * tokens_per_step / max(train_time, 1e-9), 1),
               "first_eval_loss": first_eval, "final_eval_loss": final_eval,
               "final_eval_ppl": math.exp(min(final_eval, 50.0)), "bits_per_byte": final_eval / math.log(2),
               "final_train_loss": sum(train_losses[-10:]) / len(train_losses[-10:]),
               "training_flops": 6 * counts["total"] * max_steps * tokens_per_step}
    ckpt_list = run.checkpoint_list()
    info = {"parent": None, "from_scratch": True,
            "description": f"trained from scratch: d_model {s.width}, {s.layers} layers, "
                           f"{metrics['tokens']:,} tokens",
            "parameters": counts["total"], "non_embedding_parameters": counts["non_embedding"],
            "embedding_parameters": counts["embedding"], "training": s.to_json(),
            "dataset": {"source": "builtin", "note": data_note, "train_tokens": int(train_ids.numel()),
                        "heldout_tokens": int(held_ids.numel()), "eval_tokens": int(windows.shape[0] * s.context)},
            "metrics": metrics, "history": history, "checkpoints": ckpt_list, "created": time.time()}
    run.save(model, tok, info)
    for st in run.checkpoints:
        upto = [h for h in history if h["step"] <= st]
        ev = [h["eval_loss"] for h in upto if h.get("eval_loss") is not None]
        run.save_checkpoint_record(st, {
            **info, "checkpoint_of": name, "step": st, "max_steps": max_steps, "history": upto, "checkpoints": [],
            "description": f"{info['description']}; checkpoint at step {st}",
            "metrics": {"steps": st, "tokens": st * tokens_per_step, "last_eval_loss": ev[-1] if ev else None}})
    say(f"held-out loss {first_eval:.3f} -> {final_eval:.3f} nats/token ({metrics['bits_per_byte']:.3f} "
        f"bits/byte, perplexity {metrics['final_eval_ppl']:.2f}) in {train_time:.1f} s")
    path = run.register()
    return PretrainResult(name=name, path=path, info=info, history=history,
                          checkpoints=[{**c, "path": run.root / c["name"]} for c in ckpt_list])


# =============================================================================================
# Power-law fits

def fit_power_law(n, loss) -> dict:
    """Least squares on log L = log a - α log N. -> {alpha, a, r2, alpha_stderr (None with 2
    points), n_points, residuals (in log L)}. SettingsError for fewer than two distinct N or a
    non-positive / non-finite value."""
    xs = [float(v) for v in n]
    ys = [float(v) for v in loss]
    if len(xs) != len(ys):
        raise SettingsError("The fit needs one loss per parameter count.")
    if len(set(xs)) < 2:
        raise SettingsError("A power-law fit needs at least two different parameter counts.")
    if not all(math.isfinite(v) and v > 0 for v in xs + ys):
        raise SettingsError("A power-law fit needs positive, finite parameter counts and losses.")
    lx = [math.log(v) for v in xs]
    ly = [math.log(v) for v in ys]
    k = len(lx)
    mx, my = sum(lx) / k, sum(ly) / k
    sxx = sum((x - mx) ** 2 for x in lx)
    sxy = sum((x - mx) * (y - my) for x, y in zip(lx, ly))
    slope = sxy / sxx
    icpt = my - slope * mx
    res = [y - (icpt + slope * x) for x, y in zip(lx, ly)]
    ss_res = sum(r * r for r in res)
    ss_tot = sum((y - my) ** 2 for y in ly)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    se = math.sqrt(ss_res / (k - 2) / sxx) if k > 2 else None
    return {"form": "L = a · N^-α", "alpha": -slope, "a": math.exp(icpt), "log_a": icpt, "r2": r2,
            "alpha_stderr": se, "n_points": k, "residuals": res}


def fit_power_law_offset(n, loss, grid: int = 400) -> dict | None:
    """L = E + A · N^-α with an irreducible loss E: for each E on a grid in [0, min L), the log-log
    least-squares fit of L - E; the E with the smallest squared error in L wins. None with fewer
    than four points (three parameters need a residual to mean anything)."""
    xs = [float(v) for v in n]
    ys = [float(v) for v in loss]
    if len(xs) < 4:
        return None
    best = None
    lo = min(ys)
    for i in range(grid):
        e = lo * i / grid
        f = fit_power_law(xs, [y - e for y in ys])
        pred = [e + f["a"] * x ** -f["alpha"] for x in xs]
        sse = sum((p - y) ** 2 for p, y in zip(pred, ys))
        if best is None or sse < best[0]:
            best = (sse, e, f)
    sse, e, f = best
    return {"form": "L = E + A · N^-α", "E": e, "A": f["a"], "alpha": f["alpha"], "sse": sse, "n_points": len(xs)}


# =============================================================================================
# The sweep

def run_scaling(widths, tokens: int, base: PretrainSettings | dict | None, train_docs: list[str],
                heldout_docs: list[str], name_prefix: str, progress: ProgressFn | None = None,
                should_stop: Callable[[], bool] | None = None, log: Callable[[str], None] | None = None,
                data_note: str = "", depths=None, params: int | None = None) -> dict:
    """Train each shape for the same `tokens` (same settings and seed otherwise), one after another.

    Width sweep (`widths`): each width at base.layers, registered as '<name_prefix>-d<width>', and L(N)
    fitted on the final held-out losses. Depth sweep (`depths`, widths None): each depth at the width
    closest to `params` non-embedding parameters (default: those of base.width at base.layers),
    registered as '<name_prefix>-L<layers>-d<width>'; no fit (fit None, fit_note says why).
    progress rows are run_pretrain's plus {width, layers, width_index, n_widths}, and {phase: 'width
    done', point} after each shape. Returns {sweep, widths, depths, tokens, points: [...], fit,
    fit_offset, published, ...}."""
    b = validate_settings({**(asdict(base) if isinstance(base, PretrainSettings) else dict(base or {})),
                           "tokens": tokens, "max_steps": None})
    depth_sweep = depths is not None
    if depth_sweep and widths is not None:
        raise SettingsError("A sweep takes either widths or depths, not both.")
    if depth_sweep:
        ds = parse_depths(depths)
        target = parse_params(params) if params is not None else shape_params(b.width, b.layers)
        shapes = [(sh["layers"], sh["width"]) for sh in depth_shapes(ds, target)]
    else:
        ws = parse_widths(widths)
        shapes = [(b.layers, w) for w in ws]
    say, emit = log or (lambda m: None), progress or (lambda d: None)
    points, t0 = [], time.time()
    for i, (layers, w) in enumerate(shapes):
        name = point_name(name_prefix, w, layers if depth_sweep else None)
        s = validate_settings({**asdict(b), "width": w, "layers": layers, "output_name": name},
                              any_width=depth_sweep)

        def on_row(r, i=i, w=w, layers=layers):
            emit({**r, "width": w, "layers": layers, "width_index": i, "n_widths": len(shapes)})

        say(f"{layers} layers at width {w} ({i + 1} of {len(shapes)})" if depth_sweep
            else f"width {w} ({i + 1} of {len(shapes)})")
        res = run_pretrain(s, train_docs, heldout_docs, progress=on_row, should_stop=should_stop, log=say,
                           data_note=data_note, any_width=depth_sweep)
        m = res.info["metrics"]
        pt = {"width": w, "layers": s.layers, "n_non_embedding": res.info["non_embedding_parameters"],
              "n_total": res.info["parameters"], "final_eval_loss": m["final_eval_loss"],
              "first_eval_loss": m["first_eval_loss"], "final_train_loss": m["final_train_loss"],
              "tokens": m["tokens"], "steps": m["steps"], "train_seconds": m["train_seconds"],
              "model_name": res.name, "checkpoints": [c["name"] for c in res.checkpoints],
              "history": [{k: h.get(k) for k in ("step", "tokens_seen", "loss", "eval_loss")} for h in res.history
                          if h.get("eval_loss") is not None]}
        points.append(pt)
        emit({"phase": "width done", "width": w, "layers": s.layers, "width_index": i, "n_widths": len(shapes),
              "point": pt})
    d = points[0]["tokens"]
    common = {"tokens": d, "settings": b.to_json(), "points": points, "seconds": round(time.time() - t0, 2),
              "N": "non-embedding parameters (each tensor once)", "loss": "held-out nats per byte (byte tokenizer)"}
    if depth_sweep:
        ns = [p["n_non_embedding"] for p in points]
        note = (f"A depth sweep at equal N has nothing to fit: every shape has {min(ns):,} to {max(ns):,} "
                f"non-embedding parameters (target {target:,}), so the points are loss against depth.")
        say(note + " Loss by depth: " + ", ".join(f"{p['layers']} layers (width {p['width']}, N "
                                                  f"{p['n_non_embedding']:,}) {p['final_eval_loss']:.3f}" for p in points))
        return {"sweep": "depth", "depths": ds, "params": target, "widths": [p["width"] for p in points],
                "fit": None, "fit_offset": None, "fit_note": note, **common}
    fit = fit_power_law([p["n_non_embedding"] for p in points], [p["final_eval_loss"] for p in points])
    off = fit_power_law_offset([p["n_non_embedding"] for p in points], [p["final_eval_loss"] for p in points])
    say(f"fit: L = {fit['a']:.3g} · N^-{fit['alpha']:.4f} (R² {fit['r2']:.3f}"
        + (f", α ± {fit['alpha_stderr']:.4f}" if fit["alpha_stderr"] is not None else "") + f") over {len(points)} "
        f"widths at {d:,} tokens each; Kaplan et al. 2020 report α_N = 0.076, Hoffmann et al. 2022 α = 0.34")
    return {"sweep": "width", "widths": ws, "fit": fit, "fit_offset": off, **common,
            "published": {"kaplan_2020": KAPLAN_2020, "chinchilla_2022": CHINCHILLA_2022,
                          "kaplan_loss_at_points": [kaplan_loss(p["n_non_embedding"]) for p in points],
                          "chinchilla_loss_at_points": [chinchilla_loss(p["n_total"], d) for p in points]}}
