"""Tokenizer training throughput per algorithm on the built-in corpus, and the job overhead.

For each algorithm: bare training time in this process (MB/s), then the same training as a job
through a real Valkey + Celery worker: submit-to-start latency (queue + worker pickup), job
run time (start to finish, incl. report) and total wall time; ratios job/bare printed.

    python bench/tokenizer.py [--vocab-size 4000] [--mb 1.0] [--algorithms bpe,unigram]

Uses REDIS_URL if set (and expects a worker), else starts a temporary Valkey + worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab-size", type=int, default=4000)
    ap.add_argument("--mb", type=float, default=None, help="slice of the training corpus (default: all of it)")
    ap.add_argument("--algorithms", default="bpe,byte-level-bpe,wordpiece,unigram")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from tasks import corpus
    from tasks import tokenizer_train as tt

    algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    max_bytes = int(args.mb * 2**20) if args.mb else None
    docs = corpus.builtin_docs("train", max_bytes)
    mb = sum(len(d.encode()) for d in docs) / 2**20
    print(f"built-in corpus: {len(docs)} docstrings, {mb:.2f} MB; vocab {args.vocab_size}; "
          f"cpus {os.cpu_count()}", flush=True)

    handle = None
    tmp = None
    if not os.environ.get("REDIS_URL"):
        from tests.jobs_helpers import LiveServices

        tmp = tempfile.mkdtemp(prefix="lmscope-bench-")
        handle = LiveServices(Path(tmp), stale_s=30)
        handle.start()
        for k in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
            os.environ.pop(k, None)
    from tasks import jobs

    rows = []
    try:
        # warm the worker (imports, corpus cache) so the first algorithm is not charged for it
        w = jobs.submit("tokenizer", {"algorithm": "byte-level-bpe", "vocab_size": 300, "corpus_max_mb": 0.05},
                        owner="bench")
        jobs.wait_job(w["id"], timeout=300, poll=0.02)
        for algo in algos:
            p = tt.validate_params({"algorithm": algo, "vocab_size": args.vocab_size})
            t0 = time.perf_counter()
            tt.train(p, docs)
            bare = time.perf_counter() - t0
            t_submit = time.time()
            rec = jobs.submit("tokenizer", {"algorithm": algo, "vocab_size": args.vocab_size,
                                            "corpus_max_mb": args.mb}, owner="bench")
            done = jobs.wait_job(rec["id"], timeout=1800, poll=0.02)
            t_end = time.time()
            assert done["state"] == "succeeded", done
            rep = jobs.read_report(done)
            job_train = rep["train"]["seconds"]
            row = {
                "algorithm": algo, "mb": round(mb, 3), "bare_train_s": round(bare, 3),
                "bare_mb_s": round(mb / bare, 3), "job_train_s": job_train,
                "submit_to_start_s": round(done["started"] - done["created"], 3),
                "job_run_s": round(done["finished"] - done["started"], 3),
                "submit_to_done_s": round(t_end - t_submit, 3),
            }
            row["overhead_ratio"] = round(row["submit_to_done_s"] / bare, 2)
            row["latency_vs_train"] = round(row["submit_to_start_s"] / bare, 3)
            rows.append(row)
            print(f"{algo:15s} bare {bare:7.2f} s = {row['bare_mb_s']:6.2f} MB/s | job: submit->start "
                  f"{row['submit_to_start_s']:.3f} s, train {job_train:.2f} s, run {row['job_run_s']:.2f} s "
                  f"(incl. report), submit->done {row['submit_to_done_s']:.2f} s | done/bare "
                  f"{row['overhead_ratio']:.2f}x, latency/bare {row['latency_vs_train']:.3f}", flush=True)
    finally:
        if handle:
            handle.stop()
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
