"""A model split over every visible GPU (LMSCOPE_DEVICE=auto: accelerate, balanced) traces and
generates, and equals the same weights on one GPU.

  PYTHONPATH=. python bench/multi_gpu.py            # needs >= 2 GPUs
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from model_core import (
    load_model,  # noqa: E402
    trace,
)
from model_core.interp.lens import logit_lens  # noqa: E402
from model_core.serving.generate import generate  # noqa: E402


def main() -> int:
    n = torch.cuda.device_count()
    print(f"# bench/multi_gpu.py  GPUs: {n} x {torch.cuda.get_device_name(0) if n else '-'}")
    if n < 2:
        print("needs at least 2 GPUs")
        return 1
    name = "random-smollm2-135m"
    one = load_model(name, device="cuda:0", dtype="float32")
    split = load_model(name, device="auto", dtype="float32")
    devices = sorted({str(p.device) for p in split.model.parameters()})
    print("split over:", devices, "| layers per device:",
          {d: sum(1 for v in split.meta["device_map"].values() if v == d.split(":")[-1] or v == d)
           for d in devices})
    ids = torch.randint(300, 49000, (512,), generator=torch.Generator().manual_seed(0))
    a, b = trace(one, token_ids=ids), trace(split, token_ids=ids)
    dl = (a.next_logits - b.next_logits.to("cuda:0")).abs().max().item()
    dp = max((a.attention_pattern(l) - b.attention_pattern(l).to("cuda:0")).abs().max().item() for l in range(30))
    dr = max((a.resid_post(l) - b.resid_post(l).to("cuda:0")).abs().max().item() for l in range(30))
    la, lb = logit_lens(a, positions=[-1]), logit_lens(b, positions=[-1])
    same_lens = torch.equal(la.top_ids, lb.top_ids)
    ga = generate(one, token_ids=ids[:64], max_new_tokens=32, ignore_eos=True)
    gb = generate(split, token_ids=ids[:64], max_new_tokens=32, ignore_eos=True)
    print(f"trace: max |dlogits| {dl:.2e}, max |dpattern| {dp:.2e}, max |dresid| {dr:.2e}, logit lens top-5 equal: {same_lens}")
    print(f"greedy generation (32 tokens) equal: {ga.token_ids == gb.token_ids}")
    # Concurrent users on the split model: their traces share forwards (model_core.interp.trace_batching; a split
    # model's generations run one request at a time, not on the engine); each must still equal the
    # one-GPU model run alone.
    import threading

    from model_core.interp.trace_batching import batcher_for

    prompts = [ids[i * 16: i * 16 + 20 + 4 * i] for i in range(6)]
    before = batcher_for(split).stats.batched_requests
    gens, trs = [None] * 6, [None] * 6

    def user(i):
        trs[i] = trace(split, token_ids=prompts[i])
        gens[i] = generate(split, token_ids=prompts[i], max_new_tokens=16, ignore_eos=True).token_ids

    threads = [threading.Thread(target=user, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batched = batcher_for(split).stats.batched_requests - before
    solo_g = [generate(one, token_ids=p, max_new_tokens=16, ignore_eos=True).token_ids for p in prompts]
    d_tr = max((trs[i].next_logits.to("cuda:0") - trace(one, token_ids=p).next_logits).abs().max().item()
               for i, p in enumerate(prompts))
    same_g = gens == solo_g
    print(f"6 concurrent users on the split model: {batched} requests shared forwards; "
          f"max |dlogits| vs one GPU alone {d_tr:.2e}; greedy generations equal: {same_g}")
    ok = (dl < 1e-3 and dp < 1e-4 and same_lens and ga.token_ids == gb.token_ids and len(devices) >= 2
          and batched > 0 and d_tr < 1e-3 and same_g)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
