"""lmscope's search decoding (model_core/serving/search_decoding.py: beam, diverse / group beam, contrastive)
against transformers' own `generate` with the same settings, on the real default model, CPU fp32.

- beam: lmscope's `decode` against transformers 5's `generate(num_beams=...)` in this process (lmscope
  calls that same generate; the rest of `decode` is its own bookkeeping).
- diverse and contrastive: transformers 5 no longer has them; the reference is transformers 4.55.4's
  core `generate`, run in a subprocess with PYTHONPATH=/tmp/tf455 that loads the model once from its
  converted safetensors folder (as tests/data/make_decoding_reference.py does) and times its own repeats,
  answering median seconds as JSON. Skipped with a note when /tmp/tf455 is absent.

Per method: median seconds of lmscope's `decode(...)` as the app calls it (search + teacher-forced
rescoring + the greedy text it shows next to the beams), of its search alone, and of transformers'
generate; the ratios; whether the beams are equal token for token; where lmscope's time goes (the
model's forwards, counted by a hook on the model, against the search's own bookkeeping, the rescoring
and the greedy comparison). A JSON summary is the last line.

Usage:
    # transformers 4.55.4 in a side folder, once (the diverse / contrastive reference):
    .venv/bin/pip install --no-deps --target /tmp/tf455 transformers==4.55.4 tokenizers==0.21.4 \\
        huggingface-hub==0.34.4
    .venv/bin/python bench/search_decoding.py [--methods beam diverse contrastive] [--repeats 3]
        [--max-new-tokens 32] [--prompts 3] [--threads 1] [--tf455 /tmp/tf455]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    # prompt, chat
    ("The best thing about living in the city is", False),
    ("Once upon a time, in a small village by the sea,", False),
    ("What is the capital of France? Answer in one word.", True),
]
SETTINGS = {  # method -> DecodingSettings fields (max_new_tokens added from --max-new-tokens)
    "beam": {"num_beams": 4},
    "diverse": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
    "contrastive": {"top_k": 4, "penalty_alpha": 0.6},
}


class ForwardClock:
    """Seconds spent inside `model.forward` (hooks on the top-level module), so a search's time splits into
    the model's forwards and everything around them; `phase` says which part of a run they count to."""

    def __init__(self, model):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.phase = "other"
        self._t0 = 0.0
        self._hooks = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._t0 = time.perf_counter()

    def _post(self, *_):
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + time.perf_counter() - self._t0
        self.calls[self.phase] = self.calls.get(self.phase, 0) + 1

    def reset(self):
        self.seconds, self.calls = {}, {}

    def remove(self):
        for h in self._hooks:
            h.remove()


# ---------------------------------------------------------------------------------------------
# transformers 4.55.4, in its own process

def tf455_main(spec_path: str) -> None:
    """Runs in the subprocess: every case `repeats` times (after one warm-up), median seconds and forward
    seconds, the sequences it returned. JSON on stdout."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    assert transformers.__version__ == "4.55.4", transformers.__version__
    sp = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(sp["threads"])
    # transformers 5 writes the RoPE base as rope_parameters.rope_theta; 4.55 reads rope_theta (else 10,000)
    raw = json.loads((Path(sp["model_dir"]) / "config.json").read_text())
    config = AutoConfig.from_pretrained(sp["model_dir"])
    config.rope_theta = raw.get("rope_parameters", {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    model = AutoModelForCausalLM.from_pretrained(sp["model_dir"], config=config, torch_dtype=torch.float32).eval()
    clock = ForwardClock(model)
    out = {"version": transformers.__version__, "cases": []}
    for case in sp["cases"]:
        ids = torch.tensor([case["prompt_ids"]])
        kw = dict(case["generate"], attention_mask=torch.ones_like(ids))
        times, fwd = [], []
        for i in range(sp["repeats"] + 1):
            clock.reset()
            t0 = time.perf_counter()
            with torch.inference_mode():
                g = model.generate(ids, **kw)
            if i:  # the first run warms up
                times.append(time.perf_counter() - t0)
                fwd.append(sum(clock.seconds.values()))
        P = ids.shape[1]
        res = {"seconds": statistics.median(times), "forward_seconds": statistics.median(fwd),
               "forwards": sum(clock.calls.values()), "sequences": [row[P:].tolist() for row in g.sequences]}
        if getattr(g, "beam_indices", None) is not None:
            res["lengths"] = (g.beam_indices >= 0).sum(1).tolist()
            res["sequences_scores"] = g.sequences_scores.tolist()
        out["cases"].append(res)
    print(json.dumps(out))


def generate_kwargs(s, eos: list[int], pad: int) -> dict:
    """transformers 4.55 `generate` keywords for the same search as DecodingSettings `s`."""
    kw = dict(max_new_tokens=s.max_new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True,
              eos_token_id=eos, pad_token_id=pad)
    if s.method == "diverse":
        kw.update(num_beams=s.num_beams, num_beam_groups=s.num_beam_groups, diversity_penalty=s.diversity_penalty,
                  length_penalty=s.length_penalty, num_return_sequences=s.num_beams, early_stopping=False)
    else:
        kw.update(penalty_alpha=s.penalty_alpha, top_k=s.top_k)
    return kw


def run_tf455(tf455: str, model_dir: str, cases: list[dict], repeats: int, threads: int) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model_dir": model_dir, "cases": cases, "repeats": repeats, "threads": threads}, f)
    try:
        env = {**os.environ, "PYTHONPATH": tf455}
        r = subprocess.run([sys.executable, __file__, "--tf455-run", f.name], capture_output=True, text=True, env=env)
    finally:
        os.unlink(f.name)
    if r.returncode:
        raise RuntimeError(f"transformers 4.55 subprocess failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["cases"]


# ---------------------------------------------------------------------------------------------
# lmscope, in this process

SEARCH_FN = {"beam": "beam_search", "diverse": "group_beam_search", "contrastive": "contrastive_search"}
PHASE_FN = {"rescoring": "teacher_forced_logprobs", "greedy": "greedy"}


class Phases:
    """Wraps search_decoding's search, rescoring and greedy functions (decode looks them up by module
    name) so one `decode` call says how long each part took and how much of it was the model's forwards."""

    def __init__(self, sd, clock: ForwardClock, method: str):
        self.sd, self.clock, self.seconds = sd, clock, {}
        self.saved = {}
        for phase, name in [("search", SEARCH_FN[method]), *PHASE_FN.items()]:
            self.saved[name] = getattr(sd, name)
            setattr(sd, name, self._timed(phase, self.saved[name]))

    def _timed(self, phase, fn):
        def run(*a, **k):
            self.clock.phase = phase
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
                self.clock.phase = "other"
        return run

    def reset(self):
        self.seconds = {}
        self.clock.reset()

    def restore(self):
        for name, fn in self.saved.items():
            setattr(self.sd, name, fn)


def breakdown(total: float, phases: dict, fwd: dict, calls: dict) -> dict:
    """One decode's seconds by part: search forwards, search bookkeeping, rescoring, greedy, other."""
    search = phases.get("search", 0.0)
    return {"total": total, "search": search, "search_forwards": fwd.get("search", 0.0),
            "search_bookkeeping": search - fwd.get("search", 0.0), "search_forward_calls": calls.get("search", 0),
            "rescoring": phases.get("rescoring", 0.0), "rescoring_forwards": fwd.get("rescoring", 0.0),
            "greedy": phases.get("greedy", 0.0), "greedy_forwards": fwd.get("greedy", 0.0),
            "other": total - sum(phases.values())}


def median_dict(ds: list[dict]) -> dict:
    return {k: statistics.median(d[k] for d in ds) for k in ds[0]}


def time_lmscope(lm, sd, ids, s, repeats: int) -> tuple[dict, object]:
    clock = ForwardClock(lm.model)
    phases = Phases(sd, clock, s.method)
    try:
        runs, d = [], None
        for i in range(repeats + 1):
            phases.reset()
            t0 = time.perf_counter()
            d = sd.decode(lm, token_ids=ids, settings=s)
            if i:  # the first run warms up
                runs.append(breakdown(time.perf_counter() - t0, phases.seconds, clock.seconds, clock.calls))
    finally:
        phases.restore()
        clock.remove()
    return median_dict(runs), d


def time_tf5_beam(lm, sd, ids, s, repeats: int) -> dict:
    """transformers 5's generate with exactly the config lmscope's beam_search hands it."""
    import torch

    eos = sd._eos(lm)
    cfg = sd._generation_config(lm, s, eos)
    x = torch.tensor([ids])
    clock = ForwardClock(lm.model)
    times, fwd, out = [], [], None
    try:
        for i in range(repeats + 1):
            clock.reset()
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = lm.model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
            if i:
                times.append(time.perf_counter() - t0)
                fwd.append(sum(clock.seconds.values()))
    finally:
        clock.remove()
    P = len(ids)
    return {"seconds": statistics.median(times), "forward_seconds": statistics.median(fwd),
            "forwards": sum(clock.calls.values()), "sequences": [row[P:].tolist() for row in out.sequences],
            "lengths": (out.beam_indices >= 0).sum(1).tolist(), "sequences_scores": out.sequences_scores.tolist()}


def same_output(d, ref: dict, pad: int) -> tuple[bool, float | None]:
    """Token-for-token equality of lmscope's beams (best first) with the reference's returned sequences
    (cut at their length, or with nothing but padding past lmscope's), and the largest score difference."""
    seqs = ref["sequences"]
    if len(seqs) != len(d.beams):
        return False, None
    equal = True
    for i, (b, seq) in enumerate(zip(d.beams, seqs)):
        n = ref["lengths"][i] if "lengths" in ref else len(b.token_ids)
        equal &= b.token_ids == seq[:n] and all(t == pad for t in seq[n:])
    diff = None
    if "sequences_scores" in ref:
        diff = max(abs(b.score - r) for b, r in zip(d.beams, ref["sequences_scores"]))
    return bool(equal), diff


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads, both sides (1: a shared machine's other load cannot stall an OpenMP team)")
    ap.add_argument("--tf455", default="/tmp/tf455", help="folder holding transformers 4.55.4 (pip --target)")
    ap.add_argument("--tf455-run", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tf455_run:
        tf455_main(args.tf455_run)
        return 0

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    from common import device_info

    import model_core.serving.search_decoding as sd
    from model_core import load_model
    from model_core.core.prompts import encode_prompt
    from model_core.core.registry import DEFAULT_MODEL, converted_dir

    torch.set_num_threads(args.threads)
    lm = load_model(DEFAULT_MODEL, device="cpu", dtype="float32")
    eos, pad = sd._eos(lm), sd._pad(lm, sd._eos(lm))
    prompts = [(p, chat, encode_prompt(lm, p, chat=chat)) for p, chat in PROMPTS[:args.prompts]]
    settings = {m: sd.DecodingSettings(method=m, max_new_tokens=args.max_new_tokens, **SETTINGS[m]).validated()
                for m in args.methods}
    print(f"{DEFAULT_MODEL}, {device_info('cpu')}, {args.max_new_tokens} new tokens, "
          f"{args.repeats} repeats (median) after one warm-up, {len(prompts)} prompts", flush=True)

    # transformers 4.55 first, in one subprocess for every case (one model load)
    old = [(m, i) for m in args.methods if m != "beam" for i in range(len(prompts))]
    tf455: dict = {}
    if old and not (Path(args.tf455) / "transformers").is_dir():
        print(f"note: {args.tf455} has no transformers 4.55.4; diverse and contrastive run without a reference "
              "(see the usage in this file's docstring)", flush=True)
    elif old:
        cases = [{"prompt_ids": prompts[i][2], "generate": generate_kwargs(settings[m], eos, pad)} for m, i in old]
        t0 = time.perf_counter()
        tf455 = dict(zip(old, run_tf455(args.tf455, str(converted_dir(DEFAULT_MODEL)), cases, args.repeats,
                                        args.threads)))
        print(f"transformers 4.55.4 subprocess: {time.perf_counter() - t0:.1f} s for {len(old)} cases", flush=True)

    summary = {"model": DEFAULT_MODEL, "device": device_info("cpu"), "max_new_tokens": args.max_new_tokens,
               "repeats": args.repeats, "methods": {}}
    for m in args.methods:
        s = settings[m]
        print(f"\n== {m}: {json.dumps(SETTINGS[m])}", flush=True)
        print(f"{'prompt':>8} {'lmscope s':>9} {'search s':>9} {'hf s':>7} {'decode/hf':>9} {'search/hf':>9}  "
              f"{'fwd':>6} {'bookkeep':>8} {'rescore':>7} {'greedy':>6} {'hf fwd':>6}  same", flush=True)
        rows = []
        for i, (prompt, chat, ids) in enumerate(prompts):
            lms, d = time_lmscope(lm, sd, ids, s, args.repeats)
            ref = time_tf5_beam(lm, sd, ids, s, args.repeats) if m == "beam" else tf455.get((m, i))
            row = {"prompt": prompt, "chat": chat, "prompt_tokens": len(ids),
                   "new_tokens": [b.length for b in d.beams], "lmscope": lms}
            if ref is not None:
                same, diff = same_output(d, ref, pad)
                row.update(transformers={k: ref[k] for k in ("seconds", "forward_seconds", "forwards")},
                           decode_ratio=lms["total"] / ref["seconds"], search_ratio=lms["search"] / ref["seconds"],
                           same_tokens=same, max_score_diff=diff)
            rows.append(row)
            hf = f"{ref['seconds']:>7.3f} {row['decode_ratio']:>9.2f} {row['search_ratio']:>9.2f}" if ref else \
                f"{'-':>7} {'-':>9} {'-':>9}"
            print(f"{i:>8} {lms['total']:>9.3f} {lms['search']:>9.3f} {hf}  {lms['search_forwards']:>6.3f} "
                  f"{lms['search_bookkeeping']:>8.3f} {lms['rescoring']:>7.3f} {lms['greedy']:>6.3f} "
                  f"{ref['forward_seconds'] if ref else float('nan'):>6.3f}  "
                  f"{row.get('same_tokens', 'no reference')}"
                  + (f" (score diff {row['max_score_diff']:.1e})" if row.get("max_score_diff") is not None else ""),
                  flush=True)
        timed = [r for r in rows if "transformers" in r]
        agg = {"lmscope_s": statistics.median(r["lmscope"]["total"] for r in rows),
               "lmscope_search_s": statistics.median(r["lmscope"]["search"] for r in rows),
               "lmscope_breakdown_s": median_dict([r["lmscope"] for r in rows])}
        if timed:
            agg.update(transformers_s=statistics.median(r["transformers"]["seconds"] for r in timed),
                       transformers_forward_s=statistics.median(r["transformers"]["forward_seconds"] for r in timed),
                       decode_ratio=statistics.median(r["decode_ratio"] for r in timed),
                       search_ratio=statistics.median(r["search_ratio"] for r in timed),
                       all_same_tokens=all(r["same_tokens"] for r in timed))
        summary["methods"][m] = {**agg, "settings": SETTINGS[m], "rows": rows}
        b = agg["lmscope_breakdown_s"]
        print(f"{m}: lmscope decode {agg['lmscope_s']:.3f} s (search {b['search']:.3f} = forwards "
              f"{b['search_forwards']:.3f} + bookkeeping {b['search_bookkeeping']:.3f}; rescoring "
              f"{b['rescoring']:.3f} (forwards {b['rescoring_forwards']:.3f}); greedy {b['greedy']:.3f} (forwards "
              f"{b['greedy_forwards']:.3f}); other {b['other']:.3f})"
              + (f", transformers {agg['transformers_s']:.3f} s (forwards {agg['transformers_forward_s']:.3f}), "
                 f"decode/transformers {agg['decode_ratio']:.2f}, search/transformers {agg['search_ratio']:.2f}, "
                 f"same tokens: {agg['all_same_tokens']}" if timed else ", no transformers reference"), flush=True)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
