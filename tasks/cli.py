"""`lmscope jobs ...`: submit, list, show and cancel background jobs from the command line.

The CLI talks to the same queue as the app: REDIS_URL, else <data dir>/redis.url (written by the
embedded server that `lmscope serve` / `make run` starts). The data dir must be the one the workers
use (same machine, or a shared volume), because uploaded corpora and artifacts live there.
"""

from __future__ import annotations

import json
import sys
import time

from tasks import tokenizer_train as tt


def add_jobs_parser(subparsers, func) -> None:
    j = subparsers.add_parser("jobs", help="background jobs (tokenizer training): submit, list, show, cancel")
    js = j.add_subparsers(dest="jobs_command", required=True)

    s = js.add_parser("submit", help="queue a job")
    s.add_argument("kind", choices=["tokenizer", "patching", "sft", "pretrain", "scaling", "neurons"])
    s.add_argument("--algorithm", choices=list(tt.ALGORITHMS), default="byte-level-bpe")
    s.add_argument("--vocab-size", type=int, default=4000,
                   help=f"{tt.VOCAB_MIN}..{tt.VOCAB_MAX} (default 4000)")
    s.add_argument("--min-frequency", type=int, default=2)
    s.add_argument("--special-tokens", default=None, help="comma-separated (default depends on the algorithm)")
    s.add_argument("--corpus", default="builtin", help="'builtin' (stdlib docstrings) or a .txt/.jsonl path")
    s.add_argument("--corpus-max-mb", type=float, default=None, help="train on the first N MB only")
    _add_patching_args(s)
    from tasks.sft_job import add_sft_arguments  # kind 'sft' (tasks/sft_job.py)

    add_sft_arguments(s)
    from tasks.pretrain_job import add_pretrain_arguments  # kinds 'pretrain' and 'scaling' (tasks/pretrain_job.py)

    add_pretrain_arguments(s)
    s.add_argument("--owner", default="cli")
    s.add_argument("--wait", action="store_true", help="wait for the job to finish and print its record")
    s.add_argument("--timeout", type=float, default=None, help="with --wait: give up after N seconds")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=func)

    ls = js.add_parser("list", help="list jobs, newest first")
    ls.add_argument("--owner", default=None)
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=func)

    sh = js.add_parser("show", help="show one job")
    sh.add_argument("id")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=func)

    c = js.add_parser("cancel", help="cancel a queued or running job")
    c.add_argument("id")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=func)


# ---- patching jobs (tasks/patching_job.py) --------------------------------------------------

def _add_patching_args(s) -> None:
    g = s.add_argument_group("patching (kind 'patching': activation-patching sweep, clean -> corrupted)")
    g.add_argument("--model", default=None, help="model name (default: the default model)")
    g.add_argument("--clean", default=None, help="clean prompt")
    g.add_argument("--corrupted", default=None, help="corrupted prompt")
    g.add_argument("--target", default=None, help="target token, one token, mind the leading space: ' Paris'")
    g.add_argument("--other", default=None, help="second token: the metric becomes logit[target] - logit[other]")
    g.add_argument("--kind", dest="sweep", choices=["residual", "heads"], default="residual",
                   help="residual: layers x positions; heads: layers x heads (default residual)")
    g.add_argument("--align", choices=["error", "right"], default="error",
                   help="prompts of different lengths: refuse (error) or align at the last token (right)")
    g.add_argument("--batch-size", type=int, default=None, help="patched runs per forward pass")


def _patching_params(args) -> dict:
    from model_core.registry import DEFAULT_MODEL

    return {"model": args.model or DEFAULT_MODEL, "clean": args.clean, "corrupted": args.corrupted,
            "target": args.target, "other": args.other, "sweep": args.sweep, "align": args.align,
            "batch_size": args.batch_size}


# ---- shared ---------------------------------------------------------------------------------

def _dump(obj) -> None:
    json.dump(obj, sys.stdout, ensure_ascii=False, indent=2)
    sys.stdout.write("\n")


def _ts(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _line(r: dict) -> str:
    p = r["progress"]
    return (f"{r['id']}  {r['kind']:9s} {r['state']:9s} {p['fraction'] * 100:5.1f}%  {p['stage'][:16]:16s} "
            f"{_ts(r['created'])}  {r['owner']}" + (f"  error: {r['error']}" if r.get("error") else ""))


def _show(r: dict) -> None:
    print(_line(r))
    print("params:", json.dumps(r["params"], ensure_ascii=False))
    for a in r.get("artifacts", []):
        print(f"artifact: {a['path']} ({a['bytes']} bytes)")
    fit = (r.get("pretrain") or {}).get("fit")
    if fit:  # a scaling sweep: the fitted exponent
        print(f"fit: L = {fit['a']:.4g} * N^-{fit['alpha']:.4f}  (alpha {fit['alpha']:.4f}"
              + (f" +/- {fit['alpha_stderr']:.4f}" if fit.get("alpha_stderr") is not None else "")
              + f", R^2 {fit['r2']:.3f}, {fit['n_points']} widths)")
    for line in r.get("log", [])[-20:]:
        print("  " + line)


def jobs_command(args) -> int:
    from tasks import jobs

    cmd = args.jobs_command
    if cmd == "submit":
        if args.kind == "sft":
            from tasks.sft_job import sft_params_from_args

            params, files = sft_params_from_args(args)
        elif args.kind == "patching":
            params, files = _patching_params(args), []
        elif args.kind in ("pretrain", "scaling"):
            from tasks.pretrain_job import pretrain_params_from_args

            params, files = pretrain_params_from_args(args), []
        elif args.kind == "neurons":  # top contexts over the built-in corpus: --model, --tokens, --context
            from model_core.registry import DEFAULT_MODEL

            params = {"model": args.model or DEFAULT_MODEL, "tokens": args.tokens, "window": args.context}
            files = []
        else:
            params = {"algorithm": args.algorithm, "vocab_size": args.vocab_size,
                      "min_frequency": args.min_frequency, "special_tokens": args.special_tokens,
                      "corpus": "builtin", "corpus_max_mb": args.corpus_max_mb}
            files = [] if args.corpus == "builtin" else [args.corpus]
        rec = jobs.submit(args.kind, params, owner=args.owner, files=files)
        if args.wait:
            last = [None]

            def show_progress(r):
                key = (r["state"], r["progress"]["stage"], round(r["progress"]["fraction"], 2))
                if not args.json and key != last[0]:
                    last[0] = key
                    print(f"  {r['state']:9s} {r['progress']['fraction'] * 100:5.1f}% {r['progress']['stage']}",
                          file=sys.stderr)

            rec = jobs.wait_job(rec["id"], timeout=args.timeout, on_update=show_progress)
        if args.json:
            _dump(rec)
        elif args.wait:
            _show(rec)
        else:
            print(f"queued job {rec['id']}")
        return 0 if rec["state"] in ("queued", "running", "succeeded") else 1
    if cmd == "list":
        rows = jobs.list_jobs(owner=args.owner, limit=args.limit)
        if args.json:
            _dump(rows)
        else:
            for r in rows:
                print(_line(r))
        return 0
    if cmd == "show":
        rec = jobs.get_job(args.id)
        _dump(rec) if args.json else _show(rec)
        return 0
    if cmd == "cancel":
        rec = jobs.cancel_job(args.id)
        if args.json:
            _dump(rec)
        else:
            print(f"job {rec['id']}: {rec['state']}")
        return 0
    print(f"error: unknown jobs command {cmd}", file=sys.stderr)
    return 2
