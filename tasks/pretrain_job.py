"""Training from scratch as background jobs: kinds 'pretrain' (one tiny decoder) and 'scaling' (several
widths for the same token budget, then the fitted power law L(N)). model_core.training.pretrain does the work;
the text is the built-in corpus (tasks.corpus: the standard library's docstrings, train split, and its
held-out split of every 10th file).

Params ('pretrain'): model_core.training.pretrain.PretrainSettings fields (width, layers, context, batch_size,
max_steps or tokens, learning_rate, warmup_steps, eval_every, eval_tokens, seed, output_name,
keep_checkpoints). 'scaling': the same plus tokens (the budget each shape trains for) and either
widths ('64,128,256' or a list; width ignored; models '<prefix>-d<width>', then the fit of L(N)) or
depths ('1,2,4,8'; each at the width closest to `params` non-embedding parameters, by default those
of `width` at `layers`; models '<prefix>-L<layers>-d<width>'; no fit at equal N). output_name is the
prefix of the models it registers. Submission validates everything, picks the depth sweep's shapes
(stored as `shapes`) and checks the names are free; nothing is queued on bad input.

Progress: 'loading corpus' (0-2 %), 'training' (2-97 %, by step; a sweep weighs each width by its
cost per token), 'fitting' / 'saving' (97-100 %). The record gets `pretrain`: {history: [{step,
loss, eval_loss, eval_ppl, lr, tokens_seen, tokens_per_s, width}], latest, model_name, widths,
points (a sweep: one per finished width), fit, fit_offset, checkpoints}; app/tabs/finetune/pretrain_figures.py draws
it. A sweep also writes scaling.json (run_scaling's result) as an artifact.

Cancel: the runs poll the cancel flag between steps (and the revoke from jobs.cancel_job terminates
the process); the width being trained registers nothing, widths already finished stay registered
(each is a complete run) and the log says which. Claim, heartbeat, cancel and the job's ending are
tasks.lifecycle's.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict

from model_core.core.errors import SettingsError
from model_core.training import pretrain as pt
from tasks import kinds
from tasks.celery_app import app
from tasks.lifecycle import CurvesProgress, Done, Job, JobTask, queue, read_json_artifact

KINDS = ("pretrain", "scaling")
_PUSH_EVERY_S = 0.5
DEFAULT_WIDTHS = [64, 128, 256]
DEFAULT_SCALING_TOKENS = 400_000
DATA_NOTE = "Python standard-library docstrings (train split; held-out: every 10th file), byte tokens"


def validate_params(kind: str, params: dict) -> dict:
    """The params as the worker will use them (JSON-able); SettingsError for bad values."""
    p = {k: v for k, v in dict(params or {}).items() if v is not None and v != ""}
    widths = p.pop("widths", None)
    depths = p.pop("depths", None)
    n_target = p.pop("params", None)
    p.pop("shapes", None)  # derived below from depths and params, never taken as given
    if kind == "scaling":
        p.pop("max_steps", None)
        p.setdefault("tokens", DEFAULT_SCALING_TOKENS)
        if depths is not None:
            return _validate_depth_sweep(p, depths, n_target, widths)
        if n_target is not None:
            raise SettingsError("'params' belongs to a depth sweep (with 'depths'); a width sweep takes 'widths'.")
        p.pop("width", None)
        ws = pt.parse_widths(widths if widths is not None else DEFAULT_WIDTHS)
        s = pt.validate_settings({**p, "width": ws[0]})
        out = {k: v for k, v in asdict(s).items() if k not in ("width", "device", "max_steps")}
        out["widths"] = ws
        return out
    if widths is not None or depths is not None or n_target is not None:
        key = "widths" if widths is not None else "depths" if depths is not None else "params"
        raise SettingsError(f"'{key}' belongs to a scaling sweep; a pretrain job takes one 'width' and 'layers'.")
    s = pt.validate_settings(p)
    return {k: v for k, v in asdict(s).items() if k != "device"}


def _validate_depth_sweep(p: dict, depths, n_target, widths) -> dict:
    """A depth sweep's params: depths, the target N (given, or that of width x layers) and the shapes."""
    if widths is not None:
        raise SettingsError("A sweep takes either widths or depths, not both.")
    ds = pt.parse_depths(depths)
    if n_target is not None and p.get("width") is not None:
        raise SettingsError("Give a depth sweep either 'params' or a 'width' to take them from, not both.")
    s = pt.validate_settings(p)
    target = pt.parse_params(n_target) if n_target is not None else pt.shape_params(s.width, s.layers)
    shapes = pt.depth_shapes(ds, target)
    out = {k: v for k, v in asdict(s).items() if k not in ("width", "device", "max_steps")}
    out.update(depths=ds, params=target, shapes=shapes)
    return out


def model_names(kind: str, p: dict) -> list[str]:
    """Every model name the job will register (final models and checkpoints)."""
    from model_core.core.checkpoints import checkpoint_name

    base = {k: v for k, v in p.items() if k not in ("widths", "depths", "params", "shapes")}
    if kind == "scaling" and p.get("shapes"):
        finals = [(pt.point_name(p["output_name"], sh["width"], sh["layers"]),
                   pt.validate_settings({**base, "width": sh["width"], "layers": sh["layers"]}, any_width=True))
                  for sh in p["shapes"]]
    elif kind == "scaling":
        finals = [(pt.point_name(p["output_name"], w), pt.validate_settings({**base, "width": w})) for w in p["widths"]]
    else:
        finals = [(p["output_name"], pt.validate_settings(p))]
    out = []
    for name, s in finals:
        out.append(name)
        out += [checkpoint_name(name, st) for st in pt.checkpoint_steps(s.steps(), s.keep_checkpoints)]
    return out


def _check_names(names: list[str], overwrite: bool) -> None:
    from model_core.core.checkpoints import name_taken

    for n in names:
        if len(n) > 100:
            raise SettingsError(f"The model name '{n[:40]}…' would be longer than 100 characters; shorten the name.")
        why = name_taken(n, overwrite)
        if why:
            raise SettingsError(why)


def submit_pretrain(kind: str, params: dict, owner: str = "cli", files: list | None = None) -> dict:
    """Validate, record and queue a 'pretrain' or 'scaling' job (called by tasks.jobs.submit)."""
    if kind not in KINDS:
        raise SettingsError(f"Unknown kind '{kind}'.")
    if files:
        raise SettingsError(f"A '{kind}' job trains on the built-in corpus and takes no uploaded files.")
    v = validate_params(kind, params)

    def prepare(rec: dict) -> None:
        if not v.get("output_name"):
            v["output_name"] = (f"scaling-{rec['id'][:8]}" if kind == "scaling"
                                else pt.default_output_name(pt.validate_settings(v), rec["id"][:8]))
        names = model_names(kind, v)
        _check_names(names, bool(v.get("overwrite")))
        rec["pretrain"] = {"history": [], "latest": None, "model_name": v["output_name"], "widths": v.get("widths"),
                           "depths": v.get("depths"), "params": v.get("params"), "shapes": v.get("shapes"),
                           "points": [], "fit": None, "fit_offset": None, "checkpoints": [], "models": names}

    return queue(run_scaling_job if kind == "scaling" else run_pretrain_job, kind, v, owner, prepare)


def width_costs(widths: list[int], layers: int, context: int) -> list[float]:
    """Relative training cost per token of each width (matmuls + attention + the byte head)."""
    return shape_costs([(layers, w) for w in widths], context)


def shape_costs(shapes: list[tuple[int, int]], context: int) -> list[float]:
    """Relative training cost per token of each (layers, width) shape."""
    return [layers * (12 * w * w + 2 * context * w) + 258 * w for layers, w in shapes]


class PretrainProgress(CurvesProgress):
    """Progress of a run from scratch or a sweep: curves and the sweep's points in record['pretrain']."""

    section = "pretrain"

    def __init__(self, job_id: str, attempt: int):
        super().__init__(job_id, attempt)
        self.points: list[dict] = []
        self.weights: list[float] = [1.0]

    def on_row(self, row: dict) -> None:
        """run_pretrain / run_scaling's progress callback."""
        phase = row.get("phase", "training")
        i = row.get("width_index", 0)
        tot = sum(self.weights)
        done_before = sum(self.weights[:i]) / tot
        share = self.weights[min(i, len(self.weights) - 1)] / tot
        with self.lock:
            if phase == "width done":
                self.points.append(row["point"])
            elif phase == "training":
                f = 0.02 + 0.95 * (done_before + share * row["step"] / max(1, row["max_steps"]))
                self.stage, self.fraction, self.est = "training", max(self.fraction, f), None
                keep = {k: v for k, v in row.items() if k not in ("phase", "width_index", "n_widths", "max_steps",
                                                                  "elapsed_s", "eta_s")}
                self.history.append(keep)
                self.latest = {k: v for k, v in row.items() if k != "phase"}
        self.push_if_due(_PUSH_EVERY_S, force=phase != "training" or row.get("eval_loss") is not None)

    def snapshot(self) -> dict:
        return {**super().snapshot(), "points": list(self.points)}


def _corpus():
    from tasks import corpus

    return corpus.builtin_docs("train"), corpus.builtin_docs("heldout")


def _run(job: Job, kind: str) -> Done:
    registered: list[str] = []
    job.cancel_note = "cancelled between steps; no model was registered"

    def say(msg: str) -> None:
        if msg.startswith("registered model '"):  # model_core.training.run's line for a registered run
            registered.append(msg.split("'", 2)[1])
            job.cancel_note = f"cancelled between steps; kept the finished widths' models: {', '.join(registered)}"
        job.say(msg)

    p = dict(job.params)
    job.stage("loading corpus", 0.005, "loading the built-in corpus (stdlib docstrings)")
    train, held = _corpus()
    prog = job.progress
    if kind == "scaling" and p.get("depths"):
        ds, target, shapes = p.pop("depths"), p.pop("params"), p.pop("shapes")
        prog.weights = shape_costs([(sh["layers"], sh["width"]) for sh in shapes], p["context"])
        t0 = time.time()
        res = pt.run_scaling(None, p["tokens"], p, train, held, p["output_name"], progress=prog.on_row,
                             should_stop=job.cancelled, log=say, data_note=DATA_NOTE, depths=ds, params=target)
        job.stage("saving", 0.98)
        res["wall_seconds"] = round(time.time() - t0, 2)
        path = job.write_json("scaling.json", res)
        prog.report(fit=None, fit_offset=None, fit_note=res["fit_note"], wall_seconds=res["wall_seconds"],
                    tokens=res["tokens"])
        return job.done("done: held-out loss at ≈{:,} non-embedding parameters, by depth: {}; {} tokens each, "
                        "{:.0f} s; no L(N) fit at equal N".format(
                            res["params"], ", ".join(f"{q['layers']} layers (width {q['width']}) "
                                                     f"{q['final_eval_loss']:.3f}" for q in res["points"]),
                            f"{res['tokens']:,}", res["wall_seconds"]), path)
    if kind == "scaling":
        ws = p.pop("widths")
        prog.weights = width_costs(ws, p["layers"], p["context"])
        t0 = time.time()
        res = pt.run_scaling(ws, p["tokens"], p, train, held, p["output_name"], progress=prog.on_row,
                             should_stop=job.cancelled, log=say, data_note=DATA_NOTE)
        job.stage("fitting", 0.98)
        res["wall_seconds"] = round(time.time() - t0, 2)
        path = job.write_json("scaling.json", res)
        fit = res["fit"]
        prog.report(fit=fit, fit_offset=res["fit_offset"], wall_seconds=res["wall_seconds"],
                    published=res["published"], tokens=res["tokens"])
        se = f" ± {fit['alpha_stderr']:.3f}" if fit["alpha_stderr"] is not None else ""
        return job.done(f"done: α = {fit['alpha']:.4f}{se} (R² {fit['r2']:.3f}) over widths "
                        f"{', '.join(map(str, ws))} at {res['tokens']:,} tokens each, {res['wall_seconds']:.0f} s; "
                        "published: Kaplan et al. 2020 α_N = 0.076, Hoffmann et al. 2022 α = 0.34", path)
    res = pt.run_pretrain(p, train, held, progress=prog.on_row, should_stop=job.cancelled, log=say,
                          data_note=DATA_NOTE)
    m = res.info["metrics"]
    prog.report(metrics=m, parameters=res.info["parameters"],
                non_embedding_parameters=res.info["non_embedding_parameters"],
                checkpoints=[{"name": c["name"], "step": c["step"]} for c in res.checkpoints])
    return job.done(f"done: held-out loss {m['first_eval_loss']:.3f} -> {m['final_eval_loss']:.3f} nats/byte "
                    f"(perplexity {m['final_eval_ppl']:.2f}); model '{res.name}' registered"
                    + (f" with {len(res.checkpoints)} checkpoint(s)" if res.checkpoints else ""),
                    *[res.path / n for n in ("lmscope.json", "model.safetensors") if (res.path / n).exists()])


@app.task(bind=True, base=JobTask, name="lmscope.pretrain", progress_cls=PretrainProgress,
          cancelled_by=(pt.PretrainCancelled,))
def run_pretrain_job(self, job: Job) -> Done:
    return _run(job, "pretrain")


@app.task(bind=True, base=JobTask, name="lmscope.scaling", progress_cls=PretrainProgress,
          cancelled_by=(pt.PretrainCancelled,))
def run_scaling_job(self, job: Job) -> Done:
    return _run(job, "scaling")


def read_result(rec: dict) -> dict | None:
    """The scaling.json of a finished sweep, or None."""
    return read_json_artifact(rec, "scaling.json")


# ---- CLI: `lmscope jobs submit pretrain|scaling ...` (wired from tasks/cli.py) ----------------

def add_pretrain_arguments(s) -> None:
    """Options for kinds 'pretrain' and 'scaling'; flags other kinds already define are shared."""
    add = kinds.options(s, "pretrain / scaling (train a tiny decoder from scratch on the built-in corpus)")
    add("--width", type=int, default=None,
        help="pretrain: d_model (multiple of 16; default 128); scaling --depths: take --params from this width")
    add("--widths", default=None, help="scaling: comma-separated widths (default 64,128,256)")
    add("--depths", default=None,
        help="scaling: comma-separated depths (layers) at equal non-embedding parameters, e.g. 1,2,4,8 (not with --widths)")
    add("--params", type=int, default=None,
        help="scaling --depths: the non-embedding parameter count every shape should have "
             "(default: that of --width at --layers)")
    add("--layers", type=int, default=None, help="decoder layers (default 2)")
    add("--context", type=int, default=None, help="tokens (bytes) per training window (default 128)")
    add("--tokens", type=int, default=None,
        help=f"training tokens per model (scaling default {DEFAULT_SCALING_TOKENS:,}; pretrain: instead of --max-steps)")
    add("--eval-every", type=int, default=None, help="steps between held-out evaluations (default: 10 per run)")
    add("--eval-tokens", type=int, default=None, help="held-out tokens per evaluation (default 8192)")
    add("--max-steps", type=int, default=None)
    add("--lr", type=float, default=None)
    add("--seed", type=int, default=None)
    add("--batch-size", type=int, default=None)
    add("--output-name", default=None)
    add("--keep-checkpoints", type=int, default=None)


def pretrain_params_from_args(args) -> dict:
    """The settings given on the command line (a dict; see params_from_args for the registry)."""
    g = lambda k: getattr(args, k, None)  # noqa: E731
    params = {"width": g("width"), "widths": g("widths"), "depths": g("depths"), "params": g("params"),
              "layers": g("layers"), "context": g("context"),
              "tokens": g("tokens"), "eval_every": g("eval_every"), "eval_tokens": g("eval_tokens"),
              "max_steps": g("max_steps"), "learning_rate": g("lr"), "seed": g("seed"),
              "batch_size": g("batch_size"), "output_name": g("output_name"), "keep_checkpoints": g("keep_checkpoints")}
    return {k: v for k, v in params.items() if v is not None}


def params_from_args(args) -> tuple[dict, list]:
    return pretrain_params_from_args(args), []


for _kind, _task, _help in (("pretrain", run_pretrain_job, "train a tiny decoder from scratch"),
                            ("scaling", run_scaling_job,
                             "a scaling sweep: several widths and their power-law fit, or depths at equal parameters")):
    kinds.register(kinds.JobKind(_kind, validate=functools.partial(validate_params, _kind), task=_task,
                                 submit=functools.partial(submit_pretrain, _kind), add_arguments=add_pretrain_arguments,
                                 params_from_args=params_from_args, help=_help))
