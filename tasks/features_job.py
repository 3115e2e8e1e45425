"""Sparse-autoencoder features as a background job (kind 'features'; issue 19): model_core.interp.features.
train_features on one hook point of a model over the built-in corpus (the standard library's
docstrings), evaluated on its held-out split, saved under <data dir>/features/<name>/.

Params: model, layer, hook (resid_pre, resid_post, attn_out, mlp_out; default resid_post), dataset
('builtin'), max_tokens (default 100,000), expansion_factor (default 8) or num_latents, k (default 32),
batch_size (windows per step, default 8), context (tokens per window, default 128), optimizer (adam
or signum), lr (default: 1e-3 for Adam, sparsify's rule for signum), auxk_alpha, seed, eval_tokens, context_tokens (tokens scanned for top contexts),
name (default '<model>-L<layer>-<hook>-<latents>x<k>', numbered when taken). Checked before queueing.

Progress: 'loading model' (0-3 %), 'training' (3-85 %, per step: loss, FVU, dead-feature share,
tokens/s), 'evaluating' (85-93 %), 'contexts' (93-98 %), 'saving'. The record gets `features`:
{history, latest, name, quality (FVU, explained, CE clean / with features / zero-ablated, CE
recovered), memory (the activation bound), path}; features.json (the saved record) is the artifact.
Cancel: polled between steps and batches; nothing is saved. Claim, heartbeat and the job's ending are
tasks.lifecycle's.
"""

from __future__ import annotations

from model_core.core.errors import SettingsError
from model_core.interp import features as F
from tasks import kinds
from tasks.celery_app import app
from tasks.lifecycle import CurvesProgress, Done, Job, JobTask

_PUSH_EVERY_S = 0.5
PHASES = {"evaluating": 0.85, "contexts": 0.93, "saving": 0.98}


def validate_params(params: dict) -> dict:
    """The params as the worker will use them; SettingsError (one sentence) otherwise. The layer is
    checked against the model when the job loads it (a sentence in the record)."""
    from model_core.core.registry import DEFAULT_MODEL

    p = {k: v for k, v in dict(params or {}).items() if v is not None and v != ""}
    model = p.pop("model", DEFAULT_MODEL)
    if not isinstance(model, str) or not model.strip():
        raise SettingsError("A features job needs 'model'.")
    if "layer" not in p:
        raise SettingsError("A features job needs 'layer' (the block whose activations it reads).")
    layer = p.pop("layer")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise SettingsError("'layer' must be a whole number from 0.")
    hook = p.pop("hook", "resid_post")
    if hook not in F.HOOK_KINDS:
        raise SettingsError(f"'hook' must be one of: {', '.join(F.HOOK_KINDS)}.")
    known = set(F.FeatureSettings.__dataclass_fields__) - {"model", "layer", "hook"}
    extra = sorted(set(p) - known)
    if extra:
        raise SettingsError(f"Unknown setting(s) for a features job: {', '.join(extra)}.")
    s = F.validate_settings(F.FeatureSettings(model=model.strip(), layer=layer, hook=hook, **p))
    if s.name is not None and (F.features_dir() / s.name).exists():
        raise SettingsError(f"A feature set named '{s.name}' already exists; choose another name.")
    return dict(s.__dict__)


class FeaturesProgress(CurvesProgress):
    """Progress of a feature run: its curves and results in record['features']."""

    section = "features"

    def on_step(self, step: int, total: int, m: dict) -> None:
        phase = m.get("phase", "training")
        with self.lock:
            if phase == "training":
                self.stage, self.fraction, self.est = "training", 0.03 + 0.82 * step / max(1, total), None
                row = {k: v for k, v in m.items() if k != "phase"}
                self.history.append(row)
                self.latest = row
            else:
                self.stage, self.fraction, self.est = phase, PHASES.get(phase, self.fraction), None
        self.push_if_due(_PUSH_EVERY_S, force=phase != "training")


@app.task(bind=True, base=JobTask, name="lmscope.features", progress_cls=FeaturesProgress,
          cancelled_by=(F.FeaturesCancelled,))
def run_features(self, job: Job) -> Done:
    p = validate_params(job.params)
    job.cancel_note = "cancelled; no feature set was saved"
    job.stage("loading model", 0.01, f"loading {p['model']}")
    run = F.train_features(p["model"], p["layer"], p["hook"], p["dataset"], p["max_tokens"],
                           expansion_factor=p["expansion_factor"], num_latents=p["num_latents"], k=p["k"],
                           batch_size=p["batch_size"], context=p["context"], lr=p["lr"], auxk_alpha=p["auxk_alpha"],
                           optimizer=p["optimizer"],
                           dead_tokens=p["dead_tokens"], seed=p["seed"], eval_tokens=p["eval_tokens"],
                           context_tokens=p["context_tokens"], name=p["name"], progress=job.progress.on_step,
                           should_stop=job.cancelled, log=job.say)
    r = run.record
    q = r["quality"]
    job.progress.report(name=r["name"], path=str(run.path), quality=q, memory=r["memory"],
                        num_latents=r["num_latents"], hook_name=r["hook_name"], tokens=r["tokens"],
                        tokens_per_s=r["tokens_per_s"], dead_share=r["dead_share"])
    path = job.write_json("features.json", r)
    quality = (f"explained {q['explained']:.3f} of the variance, CE recovered {q['ce_recovered']:.3f} "
               f"({q['ce_clean']:.3f} clean, {q['ce_sae']:.3f} with features, {q['ce_zero']:.3f} zero-ablated)"
               if q else "not evaluated")
    return job.done(f"done: {r['num_latents']} features on {r['hook_name']}, {r['tokens']:,} tokens at "
                    f"{r['tokens_per_s']:.0f} tokens/s; {quality}; saved as '{r['name']}'", path)


# ---- CLI: `lmscope jobs submit features ...` ------------------------------------------------

def add_arguments(s) -> None:
    add = kinds.options(s, "features (kind 'features': a sparse autoencoder on one hook point)")
    add("--model", default=None, help="model name (default: the default model)")
    add("--layer", type=int, default=None, help="features: the block whose activation is read")
    add("--hook", default=None, help=f"features: {', '.join(F.HOOK_KINDS)} (default resid_post)")
    add("--dataset", default="builtin", help="'builtin' (stdlib docstrings)")
    add("--max-tokens", type=int, default=None, help=f"features: training tokens (default {F.DEFAULT_TOKENS:,})")
    add("--expansion-factor", type=int, default=None, help="features: latents per model dimension (default 8)")
    add("--num-latents", type=int, default=None, help="features: latents (instead of --expansion-factor)")
    add("--k", type=int, default=None, help="features: active latents per token (default 32)")
    add("--batch-size", type=int, default=None)
    add("--context", type=int, default=None, help="tokens per window")
    add("--lr", type=float, default=None)
    add("--seed", type=int, default=None)
    add("--eval-tokens", type=int, default=None, help="held-out tokens evaluated")
    add("--context-tokens", type=int, default=None,
        help=f"features: corpus tokens scanned for top contexts (default {F.DEFAULT_CONTEXT_TOKENS:,})")
    add("--output-name", default=None, help="name of the saved model or feature set")


def params_from_args(args) -> tuple[dict, list]:
    from model_core.core.registry import DEFAULT_MODEL

    g = lambda k: getattr(args, k, None)  # noqa: E731
    p = {"model": g("model") or DEFAULT_MODEL, "layer": g("layer"), "hook": g("hook"), "dataset": g("dataset"),
         "max_tokens": g("max_tokens"), "expansion_factor": g("expansion_factor"), "num_latents": g("num_latents"),
         "k": g("k"), "batch_size": g("batch_size"), "context": g("context"), "lr": g("lr"), "seed": g("seed"),
         "eval_tokens": g("eval_tokens"), "context_tokens": g("context_tokens"), "name": g("output_name")}
    return {k: v for k, v in p.items() if v is not None}, []


kinds.register(kinds.JobKind("features", validate=validate_params, task=run_features, add_arguments=add_arguments,
                             params_from_args=params_from_args,
                             help="sparse-autoencoder features on one hook point"))
