"""Transcoders as a background job (kind 'transcoders'; issue 42): model_core.interp.transcoders.
train_transcoders for every layer (or the layers given) of a model over the built-in corpus, measured
on its held-out split, saved under <data dir>/transcoders/<name>/ (sparsify's layout).

Params: model, layers ('all' or a list), max_tokens, expansion_factor, k, batch_size, context, lr,
auxk_alpha, seed, eval_tokens, name. Checked before queueing.

Progress: 'training' (3-90 %, per step: mean and worst FVU over the layers, tokens/s), 'evaluating',
'saving'. The record gets `transcoders`: {history, latest, name, quality (per-layer variance
explained, the replacement model's CE loss, CE recovered and top-1 agreement), path}.
"""

from __future__ import annotations

from model_core.core.errors import SettingsError
from model_core.interp import transcoders as TC
from tasks import kinds
from tasks.celery_app import app
from tasks.lifecycle import CurvesProgress, Done, Job, JobTask

_PUSH_EVERY_S = 0.5
PHASES = {"evaluating": 0.9, "saving": 0.98}


def validate_params(params: dict) -> dict:
    """The params as the worker will use them; SettingsError (one sentence) otherwise. The layers
    are checked against the model when the job loads it (a sentence in the record)."""
    from model_core.core.registry import DEFAULT_MODEL

    p = {k: v for k, v in dict(params or {}).items() if v is not None and v != ""}
    model = p.pop("model", DEFAULT_MODEL)
    if not isinstance(model, str) or not model.strip():
        raise SettingsError("A transcoders job needs 'model'.")
    layers = TC.parse_layers(p.pop("layers", "all"))
    known = set(TC.TranscoderSettings.__dataclass_fields__) - {"model", "layers"}
    extra = sorted(set(p) - known)
    if extra:
        raise SettingsError(f"Unknown setting(s) for a transcoders job: {', '.join(extra)}.")
    s = TC.validate_settings(TC.TranscoderSettings(model=model.strip(), layers=layers, **p))
    if s.name is not None and (TC.transcoders_dir() / s.name).exists():
        raise SettingsError(f"A transcoder set named '{s.name}' already exists; choose another name.")
    return {**s.__dict__, "layers": list(s.layers)}


class TranscodersProgress(CurvesProgress):
    section = "transcoders"

    def on_step(self, step: int, total: int, m: dict) -> None:
        phase = m.get("phase", "training")
        with self.lock:
            if phase == "training":
                self.stage, self.fraction, self.est = "training", 0.03 + 0.87 * step / max(1, total), None
                row = {k: v for k, v in m.items() if k != "phase"}
                self.history.append(row)
                self.latest = row
            else:
                self.stage, self.fraction, self.est = phase, PHASES.get(phase, self.fraction), None
        self.push_if_due(_PUSH_EVERY_S, force=phase != "training")


@app.task(bind=True, base=JobTask, name="lmscope.transcoders", progress_cls=TranscodersProgress,
          cancelled_by=(TC.FeaturesCancelled,))
def run_transcoders(self, job: Job) -> Done:
    p = validate_params(job.params)
    job.cancel_note = "cancelled; no transcoder set was saved"
    job.stage("loading model", 0.01, f"loading {p['model']}")
    run = TC.train_transcoders(p["model"], p["layers"], p["max_tokens"], expansion_factor=p["expansion_factor"],
                               k=p["k"], batch_size=p["batch_size"], context=p["context"], lr=p["lr"],
                               auxk_alpha=p["auxk_alpha"], seed=p["seed"], eval_tokens=p["eval_tokens"],
                               name=p["name"], progress=job.progress.on_step, should_stop=job.cancelled,
                               log=job.say)
    r = run.record
    q = r["quality"]
    job.progress.report(name=r["name"], path=str(run.path), quality=q, layers=r["layers"],
                        num_latents=r["num_latents"], tokens=r["tokens"], tokens_per_s=r["tokens_per_s"])
    path = job.write_json("transcoders.json", r)
    quality = (TC.quality_line(q) if q else "not evaluated")
    return job.done(f"done: {len(r['layers'])} transcoders of {r['num_latents']} latents, {r['tokens']:,} tokens at "
                    f"{r['tokens_per_s']:.0f} tokens/s; {quality}; saved as '{r['name']}'", path)


# ---- CLI: `lmscope jobs submit transcoders ...` ---------------------------------------------

def add_arguments(s) -> None:
    add = kinds.options(s, "transcoders (kind 'transcoders': an MLP-replacing sparse coder per layer)")
    add("--model", default=None, help="model name (default: the default model)")
    add("--layers", default=None, help="transcoders: 'all' (default) or layer numbers separated by commas")
    add("--max-tokens", type=int, default=None, help=f"training tokens (default {TC.DEFAULT_TOKENS:,})")
    add("--expansion-factor", type=int, default=None, help="latents per model dimension")
    add("--k", type=int, default=None, help="active latents per token")
    add("--batch-size", type=int, default=None)
    add("--context", type=int, default=None, help="tokens per window")
    add("--lr", type=float, default=None)
    add("--seed", type=int, default=None)
    add("--eval-tokens", type=int, default=None, help="held-out tokens evaluated")
    add("--output-name", default=None, help="name of the saved set")


def params_from_args(args) -> tuple[dict, list]:
    from model_core.core.registry import DEFAULT_MODEL

    g = lambda k: getattr(args, k, None)  # noqa: E731
    p = {"model": g("model") or DEFAULT_MODEL, "layers": g("layers"), "max_tokens": g("max_tokens"),
         "expansion_factor": g("expansion_factor"), "k": g("k"), "batch_size": g("batch_size"),
         "context": g("context"), "lr": g("lr"), "seed": g("seed"), "eval_tokens": g("eval_tokens"),
         "name": g("output_name")}
    return {k: v for k, v in p.items() if v is not None}, []


kinds.register(kinds.JobKind("transcoders", validate=validate_params, task=run_transcoders,
                             add_arguments=add_arguments, params_from_args=params_from_args,
                             help="a transcoder for every layer (attribution graphs read them)"))
