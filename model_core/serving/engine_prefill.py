"""Admission into the engine: each taken request's prefill and first token, then its row.

Every request admitted in one engine loop is prefilled in one right-padded forward (causal
attention never sees the padding after a row's last token, so each row's keys, values and last
logits are its solo ones up to float rounding): a captured prefill where one fits
(`model_core.serving.cuda_prefill_graphs`), one recorded row at a time on a CPU with recordings
(`model_core.serving.engine_cpu_replay`), else eagerly. The first token is drawn from the
prefill's logits with the same sampling as a decode step, and the row starts in its slot.

A batch with edited requests (model_core.serving.engine_edits) is prefilled eagerly, each row's
edits on its own row, and every row's edit slots are written before it first steps.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch

from model_core.core.hooks import Recorder, instrument, recording
from model_core.serving.batch_sampling import RowSettings, sample_rows, stages_in_use
from model_core.serving.cuda_prefill_graphs import CPU_LENGTHS, PrefillGraphs, eager_prefill
from model_core.serving.engine_cpu_replay import CpuReplay
from model_core.serving.engine_edits import EditSlots, prefill_edits
from model_core.serving.engine_step import RECORDED, StepBuffers
from model_core.serving.engine_types import EngineRequest, EngineStats, Row
from model_core.serving.scheduler import Scheduler


class Admission:
    """Prefills admitted requests into free slots of the live buffers and starts their rows."""

    def __init__(self, lm, live: StepBuffers, scheduler: Scheduler, replay: CpuReplay | None,
                 stats: EngineStats, max_len: int, vocab: int, edit_slots: EditSlots):
        self._lm = weakref.ref(lm)  # as the engine holds it: an unloaded model is freed
        self.live, self.scheduler, self.replay, self.stats = live, scheduler, replay, stats
        self.edit_slots = edit_slots
        self.max_len, self.vocab, self.device = max_len, vocab, lm.device
        self.prefill_graphs: PrefillGraphs | None = None  # short prompts' prefills (CUDA)

    def admit_all(self, reqs: list[EngineRequest]) -> None:
        """Prefill every admitted request in one forward, draw each first token, and start the
        rows. If the batch fails, each request is tried alone and fails only with its own error."""
        live = []
        for r in reqs:
            self.stats.queue_wait_s += time.perf_counter() - r.submitted
            self.stats.admitted += 1
            if r.cancelled.is_set():
                r.out.put(None)
            elif len(r.ids) + r.n_steps > self.max_len:
                self.scheduler.fail(r, ValueError(f"The prompt plus new tokens exceed this server's {self.max_len}-token slots."))
            else:
                live.append(r)
        if len(live) > 1:
            try:
                self.prefill(live)
                return
            except Exception:  # noqa: BLE001 - retried one by one below
                rows = self.scheduler.rows
                for slot in [s for s, row in rows.items() if row.req in live]:
                    self.scheduler.free(rows[slot])
        for r in live:
            try:
                self.prefill([r])
            except BaseException as e:  # noqa: BLE001 - this request fails alone
                self.scheduler.fail(r, e)

    def prefill(self, reqs: list[EngineRequest]) -> None:
        lm, b, dev = self._lm(), self.live, self.device
        t0 = time.perf_counter()
        slots = self.scheduler.free_slots(len(reqs))
        edits = prefill_edits([r.edits for r in reqs]) if any(r.edits for r in reqs) else None
        for slot, r in zip(slots, reqs):  # first: a request the slots cannot take fails before it starts
            self.edit_slots.admit(slot, r.edits)
        lens = [len(r.ids) for r in reqs]
        ids = torch.tensor([r.ids + [0] * (max(lens) - n) for r, n in zip(reqs, lens)]).to(dev)  # [N, T]
        idx = torch.tensor(slots, device=dev)
        if edits:
            instrument(lm.adapter)
        if self.replay is not None and max(lens) <= CPU_LENGTHS[-1] and not edits:
            logits = self.replay.prefill_rows(ids, lens, idx, b.cache)  # [N, V]
        else:
            captured = None if self.prefill_graphs is None or edits else self.prefill_graphs.run(ids, lens)
            if captured is not None:
                pre, logits = captured  # [N, V]
                self.stats.captured_prefills += 1
            else:
                with recording(Recorder(capture=False, edits=edits)) if edits else contextlib.nullcontext():
                    pre, logits = eager_prefill(lm, ids, lens)  # [N, V]
            # every row at once (one copy per layer and per settings field: 32 users arriving together
            # would otherwise be ~2,000 small copies before anyone's first token)
            b.cache.load_rows(idx, pre, max(lens))
            del pre
        b.row_settings.set_rows(idx, [r.settings for r in reqs], [r.seed for r in reqs])
        in_prompt = (torch.arange(ids.shape[1], device=dev)[None, :]
                     < torch.tensor(lens, device=dev)[:, None])  # [N, T]: not padding
        b.seen[idx] = torch.zeros(len(reqs), self.vocab, dtype=torch.int32, device=dev).scatter_add_(
            1, ids, in_prompt.int()) > 0
        st = RowSettings(*(getattr(b.row_settings, f)[idx] for f in RowSettings.__dataclass_fields__))
        chosen, packed, final = sample_rows(logits, st, b.seen[idx], RECORDED,
                                            stages_in_use(r.settings for r in reqs))
        b.tok_in[idx] = chosen
        b.pos[idx] = torch.tensor(lens, device=dev)
        b.limit[idx] = torch.tensor([r.n_steps for r in reqs], device=dev)
        b.row_settings.step[idx] = 1
        host = packed.tolist()
        now = time.perf_counter()
        going_on, puts = [], []
        try:
            for i, (r, slot, n) in enumerate(zip(reqs, slots, lens)):
                row = Row(req=r, slot=slot, launched=1, tokens=n, t_last=t0)
                self.scheduler.rows[slot] = row
                r.first_token_at = now
                self.scheduler.emit(row, host[i], puts, logits[i], final[i])
                if not row.done and row.launched < r.n_steps:
                    going_on.append(slot)
        finally:
            self.scheduler.deliver(puts)
        if going_on:
            b.active[torch.tensor(going_on, device=dev)] = True
        self.stats.prefills += 1
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.recent_prefills.append((len(reqs), sum(lens), round(1000 * (time.perf_counter() - t0), 1)))
