"""Launches of the engine's decode step for the running rows, and the hand-out of their records.

A launch runs `steps_per_launch` decode steps (`model_core.serving.engine_step.DecodeStep`) at a
bucket: a captured graph (`engine_cuda_graphs`), a recording (`engine_cpu_replay`), or eagerly. Its
records are copied to a ring of host buffers in one call; the engine thread hands them to the rows
(`model_core.serving.scheduler.Scheduler.emit`) once the device is done, `lookahead` launches
later on CUDA, so the host processes launch n's records while the device runs the next.
"""

from __future__ import annotations

import time

import torch

from model_core.serving.batch_sampling import ALL_STAGES, packed_width, stages_in_use
from model_core.serving.engine_cpu_replay import CpuReplay
from model_core.serving.engine_cuda_graphs import StepGraphs
from model_core.serving.engine_edits import EditSlots
from model_core.serving.engine_step import GREEDY_ONLY, RECORDED, DecodeStep, StepBuffers, StepLayout
from model_core.serving.engine_types import EngineStats, LaunchResult, Row
from model_core.serving.scheduler import Scheduler


class Launcher:
    """Launches of decode steps for the running rows and the hand-out of their records.

    A launch runs at a bucket: its rows bucket is its highest slot's, its length bucket the next
    one over the positions it attends (exact sizes where every step runs eagerly). A ring of host
    buffers, with a numpy view and an event each, holds the launches in flight: every torch call on
    the engine thread lets the request threads take the interpreter (they hold it while turning
    records into text), so a launch makes as few as it can."""

    def __init__(self, decode: DecodeStep, layout: StepLayout, live: StepBuffers, graphs: StepGraphs,
                 replay: CpuReplay | None, scheduler: Scheduler, stats: EngineStats, lookahead: int,
                 use_graphs: bool, request_turn, edit_slots: EditSlots):
        self.decode, self.layout, self.live = decode, layout, live
        self.edit_slots = edit_slots
        self.graphs, self.replay, self.scheduler, self.stats = graphs, replay, scheduler, stats
        self.request_turn = request_turn
        self._exact = not use_graphs and replay is None  # eager: no bucket is captured or recorded
        dev, K, S = layout.device, layout.steps_per_launch, layout.slots
        self._pinned = [torch.zeros(K, S, packed_width(RECORDED), pin_memory=dev.type == "cuda")
                        for _ in range(lookahead + 2)]
        self._pinned_np = [p.numpy() for p in self._pinned]
        self._events = [torch.cuda.Event() if dev.type == "cuda" else None for _ in self._pinned]
        self._launches = 0

    def bucket(self, rows: list[Row]) -> tuple[int, int]:
        top = max(r.slot for r in rows) + 1
        B = next(b for b in self.layout.rows_buckets if b >= top)
        need = min(max(r.tokens for r in rows) + self.layout.steps_per_launch, self.layout.max_len)  # positions the launch attends over
        if self._exact:
            return B, need  # eager: exactly the positions in use
        return B, next(b for b in self.layout.length_buckets if b >= need)

    def stages(self, rows: list[Row]) -> frozenset:
        used = stages_in_use(r.req.settings for r in rows)
        if self._exact and self.graphs.state != "ready":
            return used  # eager: exactly the stages in use (compiled: the two sets it was compiled for)
        return GREEDY_ONLY if not used else ALL_STAGES

    def launch(self, rows: list[Row]) -> LaunchResult:
        """Run one launch for `rows` (the launchable ones) and start the copy of its records."""
        t0 = time.perf_counter()
        B, L = self.bucket(rows)
        stages = self.stages(rows)
        signature = self.edit_slots.signature([r.slot for r in rows])
        fast = False
        if signature:
            fast = self._launch_edited(B, L, stages, signature)
        else:
            graph, fast = self.graphs.lookup((B, L, stages))
            if graph is not None:
                graph.replay()
            elif fast or self.replay is None or not self.replay.run_step(B, L, stages):
                self.decode.steps(B, L, self.live, stages, fast=fast)
        K = self.layout.steps_per_launch
        self.stats.compiled_steps += K * fast
        ring = self._launches % len(self._pinned)
        self._launches += 1
        self._pinned[ring].copy_(self.live.out_packed, non_blocking=True)  # every step and slot: one call
        event = self._events[ring]
        if event is not None:
            event.record()
        want = [r for r in rows if r.req.keep_logits or r.req.keep_probs]
        extra = {r.slot: (self.live.out_logits[:, r.slot].to("cpu", copy=True),
                          self.live.out_final[:, r.slot].to("cpu", copy=True)) for r in want}
        useful = []
        starts = [r.tokens for r in rows]
        for r in rows:
            n = min(K, r.req.n_steps - r.launched)
            useful.append(n)
            r.tokens += n
            r.launched += n
        self.stats.steps += K
        self.stats.tokens += sum(useful)
        self.stats.batch_sizes[len(rows)] = self.stats.batch_sizes.get(len(rows), 0) + K
        self.stats.launch_s += time.perf_counter() - t0
        return LaunchResult(rows=rows, useful=useful, starts=starts, rows_bucket=B, ring=ring, event=event, extra=extra)

    def _launch_edited(self, B: int, L: int, stages: frozenset, signature: tuple) -> bool:
        """A launch with edited rows: the step with the signature's slots as hook edits, captured
        (CUDA, on first use; from the compiled step once it is ready) or recorded (CPU) per bucket and
        signature, eager until then. Returns whether the compiled step ran it."""
        slots = self.edit_slots.slots_of(signature)
        edits = self.edit_slots.hook_edits(signature)

        def run(fast=False):
            self.decode.steps(B, L, self.live, stages, fast=fast, edits=edits)

        if self.graphs.use_graphs:
            for fast in (True, False) if self.graphs.edited_fast() else (False,):
                graph = self.graphs.edited((B, L, stages, signature, fast), run)
                if graph is not None:
                    graph.replay()
                    return fast
        elif self.replay is not None and self.replay.run_step(B, L, stages, signature, slots):
            return False
        run()
        self.stats.edited_eager_steps += self.layout.steps_per_launch
        return False

    def hand_out(self, launched: LaunchResult, gate: bool) -> None:
        """Wait for a launch's records (gate: the request threads' turn meanwhile) and give each of
        its rows the records of the steps it took."""
        t0 = time.perf_counter()
        event = launched.event
        if event is not None:
            if gate:  # the request threads' turn while the device works
                self.request_turn.set()
                event.synchronize()
                self.request_turn.clear()
            else:
                event.synchronize()
        t1 = time.perf_counter()
        host = self._pinned_np[launched.ring][:, :launched.rows_bucket].tolist()  # [K][B] records
        puts: list = []
        try:
            for r, n, start in zip(launched.rows, launched.useful, launched.starts):
                lg, fin = launched.extra.get(r.slot, (None, None))
                for k in range(n):
                    if r.done:
                        break  # finished at a step before (seen only now: EOS, a cancel)
                    self.scheduler.emit(r, host[k][r.slot], puts, None if lg is None else lg[k],
                                        None if fin is None else fin[k], tokens_cached=start + k + 1)
        finally:  # rows that ended here are no longer the engine's to fail: theirs go out whatever happens
            self.scheduler.deliver(puts)
        self.stats.wait_s += t1 - t0
        self.stats.hand_out_s += time.perf_counter() - t1
