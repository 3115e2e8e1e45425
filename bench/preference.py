"""DPO, GRPO and a reward model on the real default model (SmolLM2-135M-Instruct, CPU fp32): the
held-out numbers before and after a short built-in run, training tokens/s and wall time.

  python bench/preference.py                        # DPO (full) and GRPO (LoRA), the defaults below
  python bench/preference.py --kinds dpo --dpo-method lora
  python bench/preference.py --kinds grpo --grpo-loss dr_grpo --grpo-steps 40
  python bench/preference.py --kinds reward
  python bench/preference.py --device cuda          # on a GPU (bf16 autocast through TRL)

Each run goes through the same functions the jobs call (model_core.training.preference.train_*), registers
its model in a scratch data folder (removed at the end unless --keep), and prints:
  DPO     held-out chosen-vs-rejected pairs (date + style): implicit-reward accuracy and margin
          beta * ((log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected)), and the policy's own
          log-prob accuracy / margin, before and after, per pair kind too
  GRPO    mean verifiable reward of greedy answers to held-out prompts (arithmetic, 'number'
          verifier) and their mean length, before and after; reward mean/std per step
  reward  held-out accuracy and margin of the reward model's scores, before (fresh head) and after
Not part of the test suite: each run takes minutes on two shared cores.

Measured (CPU, 2 threads shared with other jobs, torch 2.13 CPU, TRL 1.16.0, transformers 5.24, peft 0.21;
tokens/s varied 3-7x with the machine's load, so compare within a run):
  DPO full, beta 0.1, lr 1e-5, 12 steps x 4 pairs (48 train pairs, date + style), 24 held-out pairs:
    implicit-reward accuracy 0.000 -> 1.000, margin 0.000 -> 2.540; log-prob accuracy 0.792 -> 1.000
    (date/swap 0 -> 1, date/iso 0 -> 1), log-prob margin 38.9 -> 64.3; train 135 s, 47 tokens/s; wall 255 s
  DPO LoRA r 8, lr 2e-4, same data: implicit 0.000 -> 1.000, margin 0.000 -> 1.370; log-prob accuracy
    0.792 -> 0.917 (swap 0 -> 0.75, iso 0 -> 0); train 413 s, 15 tokens/s (loaded); wall 567 s
  reward model full, lr 2e-5, 12 steps x 4 pairs: held-out accuracy 0.625 -> 1.000, margin 0.19 -> 4.21;
    train 437 s, 14 tokens/s (loaded); wall 479 s
  GRPO LoRA r 8, lr 2e-4, 20 steps x 2 prompts x 8 completions, T 0.7, 12 tokens, beta 0.04, arithmetic
    ('number' verifier), 20 held-out prompts, greedy: mean reward 0.550 -> 1.000, answer length
    8.6 -> 7.7 tokens ("To solve this, we need to..." -> "6 + 4 = 10"); sampled reward over the first /
    last 5 steps 0.41 -> 0.76; train 1076 s, 16 tokens/s (loaded); wall 1143 s
  GRPO as above with loss dr_grpo: 0.550 -> 1.000; sampled 0.40 -> 0.80; ~8 s a step (~100 tokens/s)
    while the machine was idle; train 524 s, 32 tokens/s; wall 563 s
Measured (H200, `--device cuda`, torch 2.11, transformers 5.17, same defaults): DPO full 17 s, 375
  tokens/s, implicit accuracy 0.000 -> 1.000, margin 0 -> 2.11; GRPO LoRA 32 s, 528 tokens/s
  (generation included), greedy reward 0.550 -> 1.000 (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import device_info  # noqa: E402

MODEL = "smollm2-135m-instruct"


def _fmt(x, nd=3):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def _printer(kind: str):
    t0 = time.time()

    def progress(step, total, m):
        if "phase" in m:
            print(f"  [{time.time() - t0:6.1f}s] {kind}: {m['phase']}", flush=True)
            return
        keys = {"dpo": ("loss", "accuracy", "margin", "logp_chosen", "logp_rejected"),
                "grpo": ("loss", "reward_mean", "reward_group_std", "kl", "completion_length"),
                "reward": ("loss", "accuracy", "margin")}[kind]
        vals = "  ".join(f"{k} {_fmt(m.get(k))}" for k in keys)
        print(f"  [{time.time() - t0:6.1f}s] step {step}/{total}  {vals}  tok/s {_fmt(m.get('tokens_per_s'), 0)}",
              flush=True)

    return progress


def run_dpo(args) -> dict:
    from model_core.training import preference as P

    s = P.DPOSettings(method=args.dpo_method, max_steps=args.dpo_steps, batch_size=args.dpo_batch,
                      beta=args.beta, learning_rate=args.dpo_lr, builtin_train_size=args.dpo_train,
                      eval_examples=args.dpo_eval, seed=args.seed, output_name="bench-dpo", overwrite=True)
    t = time.time()
    r = P.train_dpo(args.model, "builtin", s, progress=_printer("dpo"))
    wall = time.time() - t
    b, a = r.before, r.after
    print(f"\nDPO ({s.method}, beta {s.beta}, lr {r.info['training']['learning_rate']:g}, {s.max_steps} steps x "
          f"{s.batch_size} pairs) on {args.model}: {b['n']} held-out pairs")
    print(f"  implicit-reward accuracy  {b['accuracy']:.3f} -> {a['accuracy']:.3f}")
    print(f"  implicit-reward margin    {b['margin']:.3f} -> {a['margin']:.3f}")
    print(f"  log-prob accuracy         {b['logp_accuracy']:.3f} -> {a['logp_accuracy']:.3f}")
    print(f"  log-prob margin           {b['logp_margin']:.2f} -> {a['logp_margin']:.2f}")
    for k in sorted(a["accuracy_by_kind"]):
        print(f"    {k:18s} implicit acc {a['accuracy_by_kind'][k]:.3f}   log-prob acc "
              f"{b['logp_accuracy_by_kind'][k]:.3f} -> {a['logp_accuracy_by_kind'][k]:.3f}")
    print(f"  train {r.metrics['train_seconds']:.0f} s, {r.metrics['tokens_seen']} tokens, "
          f"{_fmt(r.metrics['tokens_per_s'], 0)} tokens/s; wall {wall:.0f} s (load + evals + save)")
    return {"kind": "dpo", "settings": r.info["training"], "before": _strip(b), "after": _strip(a),
            "metrics": r.metrics, "wall_s": wall}


def run_grpo(args) -> dict:
    from model_core.training import preference as P

    s = P.GRPOSettings(method=args.grpo_method, max_steps=args.grpo_steps, loss_type=args.grpo_loss,
                       learning_rate=args.grpo_lr, num_generations=args.generations,
                       prompts_per_step=args.prompts_per_step, max_completion_length=args.completion_tokens,
                       temperature=args.temperature, beta=args.grpo_beta, builtin_train_size=args.grpo_train,
                       eval_examples=args.grpo_eval, seed=args.seed, output_name="bench-grpo", overwrite=True)
    t = time.time()
    r = P.train_grpo(args.model, args.grpo_data, s, progress=_printer("grpo"))
    wall = time.time() - t
    b, a = r.before, r.after
    print(f"\nGRPO ({s.method}, {s.loss_type}, lr {r.info['training']['learning_rate']:g}, {s.max_steps} steps x "
          f"{s.prompts_per_step} prompts x {s.num_generations} completions, T={s.temperature}, beta {s.beta}) on "
          f"{args.model}, {args.grpo_data}: {b['n']} held-out prompts, greedy, {s.max_completion_length} tokens")
    print(f"  mean verifiable reward    {b['mean_reward']:.3f} -> {a['mean_reward']:.3f}")
    print(f"  mean answer length        {b['mean_length']:.1f} -> {a['mean_length']:.1f} tokens")
    for ex_b, ex_a in zip(b["examples"], a["examples"]):
        print(f"    {ex_b['prompt'][:40]!r}: {ex_b['completion']!r} ({ex_b['reward']:.0f}) -> "
              f"{ex_a['completion']!r} ({ex_a['reward']:.0f})")
    rows = [h for h in r.history if "reward_mean" in h]
    if rows:
        k = max(1, len(rows) // 4)
        first = sum(h["reward_mean"] for h in rows[:k]) / k
        last = sum(h["reward_mean"] for h in rows[-k:]) / k
        print(f"  sampled reward (mean of the first / last {k} steps)  {first:.3f} -> {last:.3f}")
    print(f"  train {r.metrics['train_seconds']:.0f} s, {r.metrics['tokens_seen']} tokens, "
          f"{_fmt(r.metrics['tokens_per_s'], 0)} tokens/s (generation included); wall {wall:.0f} s")
    return {"kind": "grpo", "settings": r.info["training"], "before": _strip(b), "after": _strip(a),
            "metrics": r.metrics, "wall_s": wall,
            "per_step": [{k: h.get(k) for k in ("step", "reward_mean", "reward_group_std", "kl", "completion_length")}
                         for h in r.history]}


def run_reward(args) -> dict:
    from model_core.training import preference as P

    s = P.RewardSettings(method=args.rm_method, max_steps=args.rm_steps, batch_size=args.dpo_batch,
                         builtin_train_size=args.dpo_train, eval_examples=args.dpo_eval, seed=args.seed,
                         output_name="bench-rm", overwrite=True)
    t = time.time()
    r = P.train_reward(args.model, "builtin", s, progress=_printer("reward"))
    wall = time.time() - t
    b, a = r.before, r.after
    print(f"\nReward model ({s.method}, lr {r.info['training']['learning_rate']:g}, {s.max_steps} steps x "
          f"{s.batch_size} pairs) on {args.model}: {b['n']} held-out pairs")
    print(f"  accuracy  {b['accuracy']:.3f} -> {a['accuracy']:.3f}")
    print(f"  margin    {b['margin']:.3f} -> {a['margin']:.3f}")
    print(f"  train {r.metrics['train_seconds']:.0f} s, {_fmt(r.metrics['tokens_per_s'], 0)} tokens/s; wall {wall:.0f} s")
    return {"kind": "reward", "settings": r.info["training"], "before": _strip(b), "after": _strip(a),
            "metrics": r.metrics, "wall_s": wall}


def _strip(ev: dict | None) -> dict | None:
    return None if ev is None else {k: v for k, v in ev.items() if k != "examples"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--kinds", nargs="+", default=["dpo", "grpo"], choices=["dpo", "grpo", "reward"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dpo-method", default="full", choices=["full", "lora"])
    ap.add_argument("--dpo-steps", type=int, default=12)
    ap.add_argument("--dpo-batch", type=int, default=4)
    ap.add_argument("--dpo-lr", type=float, default=None, help="default: model_core.training.preference.default_lr")
    ap.add_argument("--dpo-train", type=int, default=48)
    ap.add_argument("--dpo-eval", type=int, default=24)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--rm-method", default="full", choices=["full", "lora"])
    ap.add_argument("--rm-steps", type=int, default=12)
    ap.add_argument("--grpo-method", default="lora", choices=["full", "lora"])
    ap.add_argument("--grpo-steps", type=int, default=20)
    ap.add_argument("--grpo-loss", default="grpo", choices=["grpo", "dr_grpo", "dapo"])
    ap.add_argument("--grpo-lr", type=float, default=None)
    ap.add_argument("--grpo-beta", type=float, default=0.04)
    ap.add_argument("--grpo-data", default="builtin")
    ap.add_argument("--grpo-train", type=int, default=64)
    ap.add_argument("--grpo-eval", type=int, default=20)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--completion-tokens", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the jobs' own default picks cuda when present)")
    ap.add_argument("--json", help="also write the numbers to this file")
    ap.add_argument("--keep", action="store_true", help="keep the scratch data folder with the registered models")
    args = ap.parse_args()

    os.environ["LMSCOPE_DEVICE"] = args.device
    torch.set_num_threads(args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="lmscope-bench-pref-"))
    os.environ["LMSCOPE_DATA_DIR"] = str(scratch)
    print(f"{device_info(args.device)}; data folder {scratch}")
    import trl

    print(f"trl {trl.__version__}")
    out = []
    try:
        for kind in args.kinds:
            out.append({"dpo": run_dpo, "grpo": run_grpo, "reward": run_reward}[kind](args))
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps({"device": device_info(args.device), "runs": out}, indent=1))
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
