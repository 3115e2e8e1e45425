"""A crosscoder between a tuned model and its base as a background job (kind 'crosscoder'; issue 43):
model_core.interp.crosscoder.train_crosscoder on one hook point of both models over the built-in
corpus's training split, scored on its held-out split; saved as crosscoder.json (latents shared,
base-only and tuned-only by relative decoder norm, variance explained per model, top latents with
contexts) and the weights (crosscoder/crosscoder.safetensors + crosscoder/cfg.json) in the job's folder.

Params: tuned (a fine-tuned or registry model), base (default: the tuned model's parent, from its
lmscope.json), layer (required; checked against the models when they load), hook (resid_pre,
resid_post, attn_out, mlp_out; default resid_post), max_tokens (training tokens, 256-5,000,000,
default 65,536), expansion_factor (latents per model dimension, 1-64, default 8) or num_latents,
l1_coeff (0-100, default 0.05), lr (default 1e-3), batch_size (windows per step, default 8), context
(tokens per window, default 128), seed, eval_tokens (held-out tokens scored, default 4,096).
Progress: 'loading models' (0-5 %), 'training' (5-85 %, per step), 'evaluating' (85-97 %), 'saving'.
Cancel: between steps and batches; nothing is saved. Claim, heartbeat and the job's ending are
tasks.lifecycle's.
"""

from __future__ import annotations

from model_core.core.errors import SettingsError
from model_core.interp import crosscoder as X
from model_core.interp.features_sae import HOOK_KINDS
from tasks import kinds
from tasks.celery_app import app
from tasks.diff_job import _known_model, parent_of
from tasks.lifecycle import Done, Job, JobTask, queue

ARTIFACT, WEIGHTS_DIR = "crosscoder.json", "crosscoder"
SETTINGS = ("tuned", "base", "layer", "hook", "dataset", "max_tokens", "expansion_factor", "num_latents",
            "l1_coeff", "lr", "batch_size", "context", "seed", "eval_tokens")


def _float_setting(p: dict, key: str, default: float, lo: float, hi: float) -> float:
    from model_core.training.sft import setting_number

    v = setting_number(p, key, float, lo, hi, allow_none=True)
    return default if v is None else v


def validate_params(params: dict, allow_paths: bool = False) -> dict:
    """The params as the worker will use them; SettingsError (one sentence) otherwise."""
    p = {k: v for k, v in dict(params or {}).items() if v is not None and v != ""}
    extra = sorted(set(p) - set(SETTINGS))
    if extra:
        raise SettingsError(f"Unknown setting(s) for a crosscoder job: {', '.join(extra)}.")
    p["tuned"] = _known_model(p.get("tuned"), "tuned model", allow_paths)
    base = p.get("base") or parent_of(p["tuned"])
    if not base:
        raise SettingsError(f"'{p['tuned']}' has no recorded parent; name the base model to compare it with.")
    p["base"] = _known_model(base, "base model", allow_paths)
    if "layer" not in p:
        raise SettingsError("A crosscoder job needs 'layer' (the block whose activations it reads).")
    p["layer"] = kinds.int_setting(p, "layer", 0, 0, 1023)
    p["hook"] = p.get("hook", "resid_post")
    if p["hook"] not in HOOK_KINDS:
        raise SettingsError(f"'hook' must be one of: {', '.join(HOOK_KINDS)}.")
    if p.get("dataset", "builtin") != "builtin":
        raise SettingsError("A crosscoder is trained on the built-in corpus ('builtin').")
    p["dataset"] = "builtin"
    p["max_tokens"] = kinds.int_setting(p, "max_tokens", X.DEFAULT_TOKENS, 256, 5_000_000)
    p["expansion_factor"] = kinds.int_setting(p, "expansion_factor", 8, 1, 64)
    p["num_latents"] = kinds.int_setting(p, "num_latents", 0, 0, 1 << 18)
    p["l1_coeff"] = _float_setting(p, "l1_coeff", X.DEFAULT_L1, 0.0, 100.0)
    p["lr"] = _float_setting(p, "lr", X.DEFAULT_LR, 1e-7, 1.0)
    p["batch_size"] = kinds.int_setting(p, "batch_size", 8, 1, 256)
    p["context"] = kinds.int_setting(p, "context", 128, 8, 2048)
    p["seed"] = kinds.int_setting(p, "seed", 0, 0, 2**31 - 1)
    p["eval_tokens"] = kinds.int_setting(p, "eval_tokens", 4096, 256, 1 << 20)
    if p["max_tokens"] < 2 * p["context"]:
        raise SettingsError(f"'max_tokens' ({p['max_tokens']:,}) must be at least two windows of "
                            f"{p['context']} tokens.")
    return p


def submit_crosscoder(params: dict, owner: str = "cli", files: list | None = None) -> dict:
    if files:
        raise SettingsError("A 'crosscoder' job takes no uploaded files.")
    return queue(run_crosscoder, "crosscoder", validate_params(params, allow_paths=owner == "cli"), owner)


@app.task(bind=True, base=JobTask, name="lmscope.crosscoder", cancelled_by=(X.CrosscoderCancelled,))
def run_crosscoder(self, job: Job) -> Done:
    from model_core import load_model

    p = job.params
    job.stage("loading models", 0.01, f"loading {p['base']} and {p['tuned']}")
    base, tuned = load_model(p["base"], allow_hub=False), load_model(p["tuned"], allow_hub=False)
    job.cancel_note = "cancelled; no crosscoder was saved"
    job.stage("training", 0.05, f"{p['max_tokens']:,} tokens of the built-in corpus through both models, "
                                f"{p['hook']} of layer {p['layer']}")
    tick = job.ticker("training", 0.05, 0.85, 0.5)

    def on_step(step: int, total: int, m: dict) -> None:
        if m.get("phase") == "training":
            tick(step / max(total, 1))
        else:
            job.stage(m["phase"], 0.85)

    cc, r = X.train_crosscoder(
        base, tuned, p["layer"], p["hook"], "builtin", p["max_tokens"], expansion_factor=p["expansion_factor"],
        num_latents=p["num_latents"], l1_coeff=p["l1_coeff"], lr=p["lr"], batch_size=p["batch_size"],
        context=p["context"], seed=p["seed"], eval_tokens=p["eval_tokens"], progress=on_step,
        should_stop=job.cancelled)
    job.check_cancel()
    job.stage("saving", 0.97)
    folder = X.save(cc, job.dir / WEIGHTS_DIR, {"base": r.base, "tuned": r.tuned, "layer": r.layer, "hook": r.hook,
                                                "hook_name": r.hook_name, "settings": r.settings})
    report = r.to_dict()
    report["weights"] = f"{WEIGHTS_DIR}/{X.WEIGHTS}"
    path = job.write_json(ARTIFACT, report)
    c = r.counts
    return job.done(f"done: {r.num_latents} latents on {r.hook_name}, {r.tokens:,} tokens in {r.seconds:.1f} s: "
                    f"{c['shared']} shared, {c['base_only']} base-only, {c['tuned_only']} tuned-only, {r.dead} dead; "
                    f"variance explained {r.fve['base']:.3f} (base), {r.fve['tuned']:.3f} (tuned)",
                    path, folder / X.WEIGHTS, folder / X.CFG)


# ---- CLI: `lmscope jobs submit crosscoder ...` ---------------------------------------------

def add_arguments(s) -> None:
    add = kinds.options(s, "crosscoder (kind 'crosscoder': one dictionary over a tuned model and its base)")
    add("--tuned", default=None, help="crosscoder: the fine-tuned model")
    add("--base", default=None, help="crosscoder: the model it is paired with (default: its parent)")
    add("--layer", type=int, default=None, help="crosscoder: the block whose activation is read")
    add("--hook", default=None, help=f"crosscoder: {', '.join(HOOK_KINDS)} (default resid_post)")
    add("--max-tokens", type=int, default=None, help=f"crosscoder: training tokens (default {X.DEFAULT_TOKENS:,})")
    add("--expansion-factor", type=int, default=None, help="crosscoder: latents per model dimension (default 8)")
    add("--num-latents", type=int, default=None, help="crosscoder: latents (instead of --expansion-factor)")
    add("--l1-coeff", type=float, default=None, help=f"crosscoder: L1 weight (default {X.DEFAULT_L1})")
    add("--lr", type=float, default=None)
    add("--batch-size", type=int, default=None)
    add("--context", type=int, default=None, help="tokens per window")
    add("--seed", type=int, default=None)
    add("--eval-tokens", type=int, default=None, help="held-out tokens evaluated")


def params_from_args(args) -> tuple[dict, list]:
    g = lambda k: getattr(args, k, None)  # noqa: E731
    p = {k: g(k) for k in ("tuned", "base", "layer", "hook", "max_tokens", "expansion_factor", "num_latents",
                           "l1_coeff", "lr", "batch_size", "context", "seed", "eval_tokens")}
    return {k: v for k, v in p.items() if v is not None}, []


kinds.register(kinds.JobKind("crosscoder", validate=validate_params, task=run_crosscoder, submit=submit_crosscoder,
                             add_arguments=add_arguments, params_from_args=params_from_args,
                             flags=("--tuned", "--base", "--layer", "--hook", "--max-tokens", "--expansion-factor",
                                    "--num-latents", "--l1-coeff", "--lr", "--batch-size", "--context", "--seed",
                                    "--eval-tokens"),
                             help="a crosscoder over a tuned model and its base: shared / base-only / "
                                  "tuned-only latents"))
