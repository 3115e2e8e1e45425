"""Kind 'tokenizer': corpus -> tokenizers training -> tokenizer.json + report.json.

Params (tasks.tokenizer_train.validate_params): algorithm, vocab_size, min_frequency,
special_tokens (list or comma string), corpus ('builtin' or 'upload'), corpus_max_mb (optional
slice of the training corpus). Uploaded .txt/.jsonl files are checked before anything is queued
and copied into the job's input/ folder.

Progress: stages 'loading corpus' (0-5 %), 'training' (5-85 %: the corpus feed is measured, the
merge phase after it is estimated from measured throughput per algorithm), 'report' (85-100 %).
The corpus feed checks the cancel flag between chunks. Claim, heartbeat, cancel and the job's
ending are tasks.lifecycle's.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from tasks import config, corpus, kinds
from tasks import tokenizer_train as tt
from tasks.celery_app import app
from tasks.lifecycle import Done, Job, JobTask, queue

# Measured on a 2-core CPU machine (bench/tokenizer.py), used only for the ETA estimate.
EXPECTED_MB_S = {"bpe": 1.4, "byte-level-bpe": 2.6, "wordpiece": 3.0, "unigram": 0.11}


def submit_tokenizer(params: dict, owner: str = "cli", files: list[str | Path] | None = None) -> dict:
    """Validate, record and queue a tokenizer-training job. `files`: uploaded .txt/.jsonl paths
    (then corpus = 'upload'). Raises a LmscopeError with one sentence for bad input; nothing is
    queued then."""
    p = tt.validate_params(params)
    files = [Path(f) for f in (files or [])]
    if p.get("corpus") not in (None, "builtin", "upload"):
        files.append(Path(p["corpus"]))
    if files:
        for f in files:
            corpus.check_upload(f)
        p["corpus"] = "upload"
        names = []
        for f in files:
            n = f.name
            while n in names:
                n = "_" + n
            names.append(n)
        p["corpus_files"] = names
    else:
        if p.get("corpus") == "upload":
            raise corpus.CorpusError("No corpus file was uploaded.")
        p["corpus"] = "builtin"

    def copy_inputs(rec: dict) -> None:
        if files:
            inp = config.job_dir(rec["id"]) / "input"
            inp.mkdir(parents=True, exist_ok=True)
            for f, n in zip(files, p["corpus_files"]):
                shutil.copyfile(f, inp / n)

    return queue(train_tokenizer, "tokenizer", p, owner, copy_inputs)


def load_docs(params: dict, job_dir: Path) -> tuple[list[str], list[str], str]:
    """(train docs, held-out docs, held-out source) for a job's corpus parameter."""
    max_bytes = int(params["corpus_max_mb"] * 2**20) if params.get("corpus_max_mb") else None
    if params.get("corpus", "builtin") == "builtin":
        return (corpus.builtin_docs("train", max_bytes), corpus.builtin_docs("heldout"),
                "builtin held-out split (stdlib docstrings, every 10th file)")
    docs = []
    for name in params.get("corpus_files", []):
        docs.extend(corpus.file_docs(job_dir / "input" / name))
    if not docs:
        raise corpus.CorpusError("The corpus has no text to train on.")
    train, held = corpus.split_heldout(docs)
    train = corpus.first_bytes(train, max_bytes)
    if held:
        return train, held, "every 10th uploaded document"
    return train, corpus.builtin_docs("heldout"), "builtin held-out split (upload has < 10 documents)"


@app.task(bind=True, base=JobTask, name="lmscope.train_tokenizer")
def train_tokenizer(self, job: Job) -> Done:
    params = tt.validate_params(job.params)
    job.stage("loading corpus", 0.01, "loading corpus")
    train_docs, held, held_src = load_docs(params, job.dir)
    nbytes = sum(len(d.encode()) for d in train_docs)
    mb = nbytes / 2**20
    expected = mb / EXPECTED_MB_S[params["algorithm"]]
    job.stage("training", 0.05, f"training {params['algorithm']} (vocab {params['vocab_size']}) on "
                                f"{len(train_docs)} documents, {mb:.2f} MB", est=(time.time(), expected, 0.05, 0.8))
    t0 = time.time()
    tok = tt.train(params, train_docs, check_cancel=job.check_cancel)
    secs = time.time() - t0
    job.stage("report", 0.85, f"trained in {secs:.2f} s ({mb / max(secs, 1e-9):.2f} MB/s); writing report")
    tok_path = job.dir / "tokenizer.json"
    tok.save(str(tok_path))
    rep = tt.report(tok, params, held, held_src, {
        "seconds": round(secs, 4), "bytes": nbytes, "documents": len(train_docs),
        "mb_per_s": round(mb / max(secs, 1e-9), 4)})
    rep_path = job.dir / "report.json"
    rep_path.write_text(json.dumps(rep, indent=1, ensure_ascii=False), encoding="utf-8")
    c = rep["compression"]
    return job.done(f"done: vocab {rep['vocab_size']}, {c['chars_per_token']} chars/token on held-out text",
                    tok_path, rep_path)


# ---- CLI: `lmscope jobs submit tokenizer ...` ----------------------------------------------

def add_arguments(s) -> None:
    add = kinds.options(s, "tokenizer (kind 'tokenizer': train a tokenizer)")
    add("--algorithm", choices=list(tt.ALGORITHMS), default="byte-level-bpe")
    add("--vocab-size", type=int, default=4000, help=f"{tt.VOCAB_MIN}..{tt.VOCAB_MAX} (default 4000)")
    add("--min-frequency", type=int, default=2)
    add("--special-tokens", default=None, help="comma-separated (default depends on the algorithm)")
    add("--corpus", default="builtin", help="'builtin' (stdlib docstrings) or a .txt/.jsonl path")
    add("--corpus-max-mb", type=float, default=None, help="train on the first N MB only")


def params_from_args(args) -> tuple[dict, list]:
    params = {"algorithm": args.algorithm, "vocab_size": args.vocab_size, "min_frequency": args.min_frequency,
              "special_tokens": args.special_tokens, "corpus": "builtin", "corpus_max_mb": args.corpus_max_mb}
    return params, ([] if args.corpus == "builtin" else [args.corpus])


kinds.register(kinds.JobKind("tokenizer", validate=tt.validate_params, task=train_tokenizer, submit=submit_tokenizer,
                             add_arguments=add_arguments, params_from_args=params_from_args,
                             help="train a tokenizer (BPE, byte-level BPE, WordPiece, Unigram)"))
