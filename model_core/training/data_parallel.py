"""A training run on every GPU of the machine: one process per GPU, data parallel.

`run(target, args, kwargs, processes, ...)` starts `torchrun --standalone --nproc_per_node N -m
model_core.training.data_parallel SPEC` (torch's launcher); in each process the Trainer's accelerate sees
WORLD_SIZE and wraps the model in DistributedDataParallel (NCCL on GPUs, gloo on the CPU, which
the tests use). Every process calls the same training function (`target`, e.g.
"model_core.training.sft:run_sft"); each takes batch_size / N examples of a step, so N processes compute
the step one process computes with the whole batch. The main process (rank 0) alone evaluates,
samples, saves and registers; its progress rows and log lines come back to the caller through a
JSON-lines file, its result (or its exception, re-raised here as itself) through a pickle.

A cancel reaches the processes as a file they all poll; `agreed(flag)` turns each process's
answer into one all-reduced answer, so every process stops after the same step (one stopping
alone would leave the others waiting in the next gradient all-reduce).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

POLL_S = 0.2
OTHERS_WAIT_S = 60.0


# ---- inside a training process -----------------------------------------------------------------

def world_size() -> int:
    """How many processes train together (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def per_process_batch(batch_size: int) -> int:
    """Each process's share of a step's examples (batch_size is the whole step's)."""
    n = world_size()
    if batch_size % n:
        raise ValueError(f"batch size {batch_size} does not split over {n} processes")
    return batch_size // n


def one_gpu_each(args):
    """Trainer wraps the model in torch.nn.DataParallel when one process sees several GPUs (one
    Python thread per GPU, slower than one GPU here, and refused by TRL's trainers): every lmscope
    training process keeps to one GPU; several GPUs mean several processes (run). Returns args."""
    if args.n_gpu > 1:  # n_gpu sets the device up first
        args._n_gpu = 1
    return args


def agreed(flag: bool) -> bool:
    """True in every process when it is true in any (an all-reduce of max); `flag` itself when
    training in one process. Every process must call it at the same point of every step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1.0 if flag else 0.0], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


# ---- the caller's side ------------------------------------------------------------------------

def processes_for(device: str | None, batch_size: int) -> int:
    """How many GPU processes a job with this device setting and step batch should use: every GPU
    when the device is unset or plain "cuda" (not "cuda:1", not the CPU), at most as many as split
    the batch evenly; 1 without two GPUs."""
    if device not in (None, "", "cuda", "auto") or not torch.cuda.is_available():
        return 1
    n = torch.cuda.device_count()
    while n > 1 and batch_size % n:
        n -= 1
    return max(1, n)


def train(target: str, settings: dict, *, before: tuple = (), kwargs: dict | None = None,
          processes: int | None = None, own_process: bool = False, progress: Callable | None = None,
          should_stop: Callable[[], bool] | None = None, log: Callable[[str], None] | None = None,
          error_cls: type = RuntimeError):
    """target(*before, settings, progress=..., should_stop=..., log=..., **kwargs) in this process, or
    in one process per GPU (processes: how many; default processes_for(settings' device and
    batch_size); the tests ask for 2 on the CPU). settings["batch_size"] is the whole step's.
    own_process: one process is launched too, rather than calling target here (a daemonic caller's
    run may then start loader processes)."""
    kwargs = kwargs or {}
    batch, device = int(settings["batch_size"]), settings.get("device")
    n = processes or processes_for(device, batch)
    if n <= 1 and not own_process:
        module, name = target.split(":")
        fn = getattr(importlib.import_module(module), name)
        return fn(*before, settings, progress=progress, should_stop=should_stop, log=log, **kwargs)
    if batch % n:
        raise error_cls(f"Batch size {batch} does not split over {n} processes; use a multiple of {n}.")
    if torch.cuda.is_available() and device in (None, "", "auto"):
        settings = {**settings, "device": "cuda"}  # each process's own GPU (_child sets it)
    if log and n > 1:
        log(f"training in {n} processes, {batch // n} examples each per step (data parallel)")
    elif log:
        log("training in a process of its own, which may start the loader's processes")
    return run(target, (*before, settings), kwargs, n, progress=progress, should_stop=should_stop, log=log,
               error_cls=error_cls)


def run(target: str, args: tuple, kwargs: dict, processes: int,
        progress: Callable | None = None, should_stop: Callable[[], bool] | None = None,
        log: Callable[[str], None] | None = None, error_cls: type = RuntimeError):
    """target(*args, progress=..., should_stop=..., log=..., **kwargs) in `processes` processes;
    returns the main process's result, or raises its exception. args and kwargs must be JSON-able."""
    stop = should_stop or (lambda: False)
    with tempfile.TemporaryDirectory(prefix="lmscope-dp-") as tmp:
        spec = Path(tmp)
        try:
            (spec / "spec.json").write_text(json.dumps({"target": target, "args": list(args), "kwargs": kwargs}))
        except TypeError:
            raise error_cls("A run in several processes takes its data by name or file path ('builtin' or a "
                            "JSONL file), not as objects in memory.") from None
        events = spec / "events.jsonl"
        events.touch()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc_per_node={processes}", "-m", "model_core.training.data_parallel", str(spec)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                            os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        stderr = open(spec / "stderr.txt", "w+b")  # noqa: SIM115 - read back below, closed with the folder
        proc = subprocess.Popen(cmd, env=env, stdout=stderr, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)
        try:
            with open(events) as ev:
                pending = ""  # a line the writer has not finished yet
                while True:
                    done = proc.poll() is not None
                    pending += ev.read()
                    *lines, pending = pending.split("\n")
                    for line in lines:
                        if line:
                            _deliver(json.loads(line), progress, log)
                    if done:
                        break
                    if stop() and not (spec / "stop").exists():
                        (spec / "stop").touch()
                    time.sleep(POLL_S)
        finally:
            if proc.poll() is None:  # the caller was interrupted: take the processes down with it
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        outcome = spec / "outcome.pkl"
        stderr.seek(0)
        tail = [ln for ln in stderr.read().decode(errors="replace").splitlines() if ln.strip()]
        stderr.close()
        if outcome.exists():
            kind, value = pickle.loads(outcome.read_bytes())
            if kind == "error":
                raise value
            return value
        # The last "SomethingError: message" line of a process's traceback, not torchrun's own summary.
        why = next((ln for ln in reversed(tail) if re.match(r"\s*[\w.]*(Error|Exception): ", ln)
                    and "ChildFailedError" not in ln), tail[-1] if tail else f"exit code {proc.returncode}")
        raise error_cls(f"Training on {processes} processes failed: {why.strip()[:300]}")


def _die_with_parent() -> None:
    """In the launcher, before it starts: SIGTERM it when the process that started it dies (a worker
    killed mid-job), so its training processes stop instead of training on and registering a model
    for a job that ended. Linux's prctl(PR_SET_PDEATHSIG); elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def _deliver(event: dict, progress, log) -> None:
    if "progress" in event and progress is not None:
        progress(*event["progress"])
    elif "log" in event and log is not None:
        log(event["log"])


def _child(spec_dir: Path) -> int:
    spec = json.loads((spec_dir / "spec.json").read_text())
    main = is_main_process()
    if torch.cuda.is_available():  # "cuda" in this process means its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    out = open(spec_dir / "events.jsonl", "a") if main else None

    def write(obj) -> None:
        out.write(json.dumps(obj, default=str) + "\n")
        out.flush()

    module, name = spec["target"].split(":")
    fn = getattr(importlib.import_module(module), name)
    stop_file = spec_dir / "stop"
    try:
        value = fn(*spec["args"], progress=(lambda *a: write({"progress": a})) if main else None,
                   should_stop=stop_file.exists, log=(lambda m: write({"log": m})) if main else None,
                   **spec["kwargs"])
        outcome, code = ("result", value), 0
    except BaseException as e:  # noqa: BLE001 - the caller re-raises it as itself
        if not main:
            # Endings every process shares (a cancel, a bad setting) reach the main process too: give it
            # time to write its outcome before this exit code makes torchrun stop it. A failure of this
            # process alone then takes the others down instead of leaving them in an all-reduce.
            deadline = time.time() + OTHERS_WAIT_S
            while time.time() < deadline and not (spec_dir / "outcome.pkl").exists():
                time.sleep(POLL_S)
            raise
        outcome, code = ("error", e), 1  # non-zero: torchrun stops the other processes
    if main:
        tmp = spec_dir / "outcome.pkl.tmp"
        tmp.write_bytes(pickle.dumps(outcome))
        tmp.rename(spec_dir / "outcome.pkl")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1])))
