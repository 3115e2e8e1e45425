"""`lmscope jobs ...`: submit, list, show and cancel background jobs from the command line.

The CLI talks to the same queue as the app: REDIS_URL, else <data dir>/redis.url (written by the
embedded server that `lmscope serve` / `make run` starts). The data dir must be the one the workers
use (same machine, or a shared volume), because uploaded corpora and artifacts live there.
"""

from __future__ import annotations

import json
import sys
import time

from tasks import kinds


def add_jobs_parser(subparsers, func) -> None:
    j = subparsers.add_parser("jobs", help="background jobs (tokenizer training, fine-tuning, sweeps...): "
                                           "submit, list, show, cancel")
    js = j.add_subparsers(dest="jobs_command", required=True)

    s = js.add_parser("submit", help="queue a job")
    registered = kinds.all_kinds()  # the registry is the one list of kinds
    s.add_argument("kind", choices=[k.name for k in registered],
                   help="; ".join(f"{k.name}: {k.help}" for k in registered if k.help))
    seen = []
    for k in registered:  # each kind's options (a module serving two kinds adds them once)
        if k.add_arguments is not None and k.add_arguments not in seen:
            seen.append(k.add_arguments)
            k.add_arguments(s)
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


# ---- output ---------------------------------------------------------------------------------

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
        k = kinds.find(args.kind)
        params, files = k.params_from_args(args) if k.params_from_args is not None else ({}, [])
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
