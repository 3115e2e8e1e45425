"""Head search over a corpus as a background job (kind 'heads'; issue 19 part 3):
model_core.interp.head_search.search_heads over the built-in corpus (the standard library's docstrings) or
texts given inline, saved as heads.json in the job's folder. The Explore tab's "Head search over a
corpus" panel draws it: the layer x head map of a metric with its spread, each head a click away
from the prompts where it scored highest.

Params: model, prompts (1-512, default 64), max_tokens (tokens per prompt, 8-256, default 128),
repeat_length (the repeated-random induction test, 3-128, default 32), texts (optional: a list of
strings, at most 1 MB, instead of the built-in corpus). Progress: 'loading model' (0-3 %),
'scoring heads' (3-95 %, per prompt), 'induction on repeated random tokens', 'saving'. Cancel:
checked between prompts. Claim, heartbeat, cancel and the ending are tasks.lifecycle's.
"""

from __future__ import annotations

from model_core.core.errors import SettingsError
from tasks import kinds
from tasks.celery_app import app
from tasks.lifecycle import Done, Job, JobTask

ARTIFACT = "heads.json"
MAX_TEXT_BYTES = 1 << 20


def validate_params(params: dict) -> dict:
    from model_core.interp.head_search import MAX_PROMPTS, MAX_TOKENS

    p = dict(params or {})
    if not isinstance(p.get("model"), str) or not p["model"].strip():
        raise SettingsError("A head-search job needs 'model'.")
    p["model"] = p["model"].strip()
    p["prompts"] = kinds.int_setting(p, "prompts", 64, 1, MAX_PROMPTS)
    p["max_tokens"] = kinds.int_setting(p, "max_tokens", 128, 8, MAX_TOKENS)
    p["repeat_length"] = kinds.int_setting(p, "repeat_length", 32, 3, MAX_TOKENS // 2)
    texts = p.get("texts")
    if texts in (None, "", []):
        p["texts"] = None
    elif not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise SettingsError("'texts' must be a list of strings.")
    elif sum(len(t.encode()) for t in texts) > MAX_TEXT_BYTES:
        raise SettingsError(f"'texts' are over {MAX_TEXT_BYTES >> 20} MB; use the built-in corpus.")
    return p


@app.task(bind=True, base=JobTask, name="lmscope.head_search")
def run_head_search(self, job: Job) -> Done:
    from model_core import load_model
    from model_core.interp import head_search as HS

    params = validate_params(job.params)
    job.stage("loading model", 0.01, f"loading {params['model']}")
    lm = load_model(params["model"], allow_hub=False)
    if params["texts"]:
        texts, source = params["texts"], "texts"
    else:
        from tasks.corpus import BUILTIN_VERSION, builtin_docs

        texts, source = builtin_docs("heldout"), BUILTIN_VERSION
    job.stage("scoring heads", 0.03, f"{params['prompts']} prompts of up to {params['max_tokens']} tokens, "
                                     f"{lm.shape.n_layers} x {lm.shape.n_heads} heads")
    job.cancel_note = "cancelled between prompts"
    tick = job.ticker("scoring heads", 0.03, 0.95, 0.25)
    out = HS.search_heads(lm, texts, params["prompts"], params["max_tokens"], repeat_length=params["repeat_length"],
                          progress=lambda i, n: tick(i / n))
    job.check_cancel()
    out["settings"]["corpus"] = source
    job.stage("saving", 0.97)
    path = job.write_json(ARTIFACT, out)
    best = max(((v, layer, head) for layer, row in enumerate(out["induction_repeated"]) for head, v in enumerate(row)))
    return job.done(f"done: {out['settings']['n_prompts']} prompts; strongest induction head L{best[1]}H{best[2]} "
                    f"({best[0]:.2f} on repeated random tokens)", path)


# ---- CLI: `lmscope jobs submit heads ...` ------------------------------------------------

def add_arguments(s) -> None:
    add = kinds.options(s, "heads (kind 'heads': every head scored over a corpus)")
    add("--model", default=None, help="model name (default: the default model)")
    add("--prompts", type=int, default=None, help="heads: corpus prompts to score (default 64)")
    add("--prompt-tokens", type=int, default=None, help="heads: tokens per prompt (default 128)")


def params_from_args(args) -> tuple[dict, list]:
    from model_core.core.registry import DEFAULT_MODEL

    return {"model": args.model or DEFAULT_MODEL, "prompts": args.prompts, "max_tokens": args.prompt_tokens}, []


kinds.register(kinds.JobKind("heads", validate=validate_params, task=run_head_search,
                             add_arguments=add_arguments, params_from_args=params_from_args,
                             help="every head scored over a corpus (previous-token, induction, sink, ...)"))
