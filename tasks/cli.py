"""`lmscope jobs ...`: submit, list, show and cancel background jobs from the command line.

The CLI talks to the same queue as the app: REDIS_URL, else <data dir>/redis.url (written by the
embedded server that `lmscope serve` / `make run` starts). The data dir must be the one the workers
use (same machine, or a shared volume), because uploaded corpora and artifacts live there.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from tasks import kinds

log = logging.getLogger(__name__)

class KindParser(argparse.ArgumentParser):
    """`lmscope jobs submit <kind>`'s parser for one kind. A flag the kind does not take, or a bad
    value, is one line on stderr (exit 2) instead of argparse's usage block; the line names the
    kinds that do take the flag (`takers`: flag -> kind names, filled in by add_jobs_parser)."""

    kind: str = ""
    kind_flags: tuple[str, ...] | None = None  # JobKind.flags, read by kinds.options
    takers: dict[str, list[str]] | None = None

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        if extra:  # argparse would hand them up to `lmscope` (a usage block, no kind named)
            self.error(self.not_taken(extra))
        return ns, extra

    def not_taken(self, extra: list[str]) -> str:
        flag = next((a.split("=", 1)[0] for a in extra if a.startswith("-")), None)
        if flag is None:
            return f"unexpected argument {extra[0]!r}; a '{self.kind}' job takes options only."
        others = [k for k in (self.takers or {}).get(flag, []) if k != self.kind]
        where = f"; {_and(others)} jobs take it" if others else ""
        return f"{flag} is not an option of a '{self.kind}' job{where} (see {self.prog} --help)."

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def add_jobs_parser(subparsers, func) -> None:
    j = subparsers.add_parser("jobs", help="background jobs (tokenizer training, fine-tuning, sweeps...): "
                                           "submit, list, show, cancel")
    js = j.add_subparsers(dest="jobs_command", required=True)

    s = js.add_parser("submit", help="queue a job", description="Queue a background job of one kind.",
                      epilog="`lmscope jobs submit KIND --help` lists that kind's options.")
    s.set_defaults(func=func)
    registered = kinds.all_kinds()  # the registry is the one list of kinds (and their order)
    per_kind = s.add_subparsers(dest="kind", metavar="KIND", required=True, parser_class=KindParser,
                                title="kinds")
    takers: dict[str, list[str]] = {}  # shared by every kind's parser
    for k in registered:
        p = per_kind.add_parser(k.name, help=k.help, description=k.help or None)
        p.kind, p.kind_flags, p.takers = k.name, k.flags, takers
        if k.add_arguments is not None:
            k.add_arguments(p)
        job = p.add_argument_group("job")
        job.add_argument("--owner", default="cli")
        job.add_argument("--wait", action="store_true", help="wait for the job to finish and print its record")
        job.add_argument("--timeout", type=float, default=None, help="with --wait: give up after N seconds")
        job.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
        for flag in (f for act in p._actions for f in act.option_strings if f.startswith("--")):
            takers.setdefault(flag, []).append(k.name)

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


# ---- output: results on stdout (_out, _dump); diagnostics (progress, errors) through `log` ----

def _out(*lines: str) -> None:
    sys.stdout.write("".join(line + "\n" for line in lines))


def _dump(obj) -> None:
    _out(json.dumps(obj, ensure_ascii=False, indent=2))


def _ts(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _line(r: dict) -> str:
    p = r["progress"]
    return (f"{r['id']}  {r['kind']:9s} {r['state']:9s} {p['fraction'] * 100:5.1f}%  {p['stage'][:16]:16s} "
            f"{_ts(r['created'])}  {r['owner']}" + (f"  error: {r['error']}" if r.get("error") else ""))


def _show(r: dict) -> None:
    _out(_line(r), "params: " + json.dumps(r["params"], ensure_ascii=False))
    _out(*(f"artifact: {a['path']} ({a['bytes']} bytes)" for a in r.get("artifacts", [])))
    fit = (r.get("pretrain") or {}).get("fit")
    if fit:  # a scaling sweep: the fitted exponent
        _out(f"fit: L = {fit['a']:.4g} * N^-{fit['alpha']:.4f}  (alpha {fit['alpha']:.4f}"
             + (f" +/- {fit['alpha_stderr']:.4f}" if fit.get("alpha_stderr") is not None else "")
             + f", R^2 {fit['r2']:.3f}, {fit['n_points']} widths)")
    _out(*("  " + line for line in r.get("log", [])[-20:]))


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
                    log.info("  %-9s %5.1f%% %s", r["state"], r["progress"]["fraction"] * 100, r["progress"]["stage"])

            rec = jobs.wait_job(rec["id"], timeout=args.timeout, on_update=show_progress)
        if args.json:
            _dump(rec)
        elif args.wait:
            _show(rec)
        else:
            _out(f"queued job {rec['id']}")
        return 0 if rec["state"] in ("queued", "running", "succeeded") else 1
    if cmd == "list":
        rows = jobs.list_jobs(owner=args.owner, limit=args.limit)
        if args.json:
            _dump(rows)
        else:
            _out(*map(_line, rows))
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
            _out(f"job {rec['id']}: {rec['state']}")
        return 0
    log.error("error: unknown jobs command %s", cmd)
    return 2
