"""Neuron and head pages (issue 15 item 9): promoted tokens against a hand computation from the
real default model's weights, and the top-contexts job (real Valkey + real Celery worker) against
a brute-force search on a tiny corpus."""

from __future__ import annotations

import time

import pytest
import torch

from model_core import load_model, trace
from model_core.interp import neurons as N
from tests.helpers.services import LiveServices


def test_promoted_tokens_equal_a_hand_computation(default_lm):
    lm, m = default_lm, default_lm.model
    g = m.model.norm.weight.float()  # the final RMSNorm's gain
    U = m.lm_head.weight.float()  # tied to the embedding: [V, d]
    for layer, n in ((12, 767), (29, 3)):
        want = U @ (m.model.layers[layer].mlp.down_proj.weight[:, n].float() * g)  # W_out[n] . W_U
        got = N.neuron_logits(lm, layer, n)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        top = N.top_tokens(lm, got, 10)
        assert [t["id"] for t in top["promoted"]] == torch.topk(want, 10).indices.tolist()
        assert [t["id"] for t in top["suppressed"]] == torch.topk(-want, 10).indices.tolist()
    # a head's OV circuit: embedding -> the layer's RMSNorm -> W_V (its key/value group) -> W_O slice -> g -> W_U
    layer, h, dh = 5, 4, 64
    blk = m.model.layers[layer]
    ids = lm.tokenizer(" Paris France the", add_special_tokens=False)["input_ids"]
    E = m.model.embed_tokens.weight[ids].float()
    x = E * torch.rsqrt(E.pow(2).mean(-1, keepdim=True) + blk.input_layernorm.variance_epsilon)
    x = x * blk.input_layernorm.weight.float()
    kv = h // (9 // 3)
    Wv = blk.self_attn.v_proj.weight.float()[kv * dh:(kv + 1) * dh]
    Wo = blk.self_attn.o_proj.weight.float()[:, h * dh:(h + 1) * dh]
    want = ((x @ Wv.T) @ Wo.T * g) @ U.T
    got = N.head_ov_logits(lm, layer, h, ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(Exception, match="Neuron 99999 is outside this model"):
        N.neuron_logits(lm, 0, 99999)


class Services(LiveServices):
    def env(self) -> dict[str, str]:
        return {**super().env(), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = Services(tmp_path_factory.mktemp("neuron-jobs"), stale_s=6.0).start()
    yield s
    s.stop()


TEXTS = ["The Eiffel Tower is in Paris.", "Colourless green ideas sleep furiously!",
         "def f(x):\n    return x * 2", "A quick brown fox jumps over the lazy dog; 12345 67890."]


def _wait(jobs, job_id, timeout=120.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        rec = jobs.get_job(job_id)
        if rec["state"] in ("succeeded", "failed", "cancelled"):
            return rec
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still {rec['state']}: {rec['log']}")


def test_job_top_contexts_contain_the_brute_force_argmax(svc):
    from tasks import jobs
    from tasks.neuron_job import shared_index_path

    model = "random-llama-tiny"  # 3 layers, 128 neurons, 4 heads, byte tokens
    rec = jobs.submit("neurons", {"model": model, "texts": TEXTS, "window": 16, "tokens": 4096, "k": 3,
                                  "batch_size": 4})
    rec = _wait(jobs, rec["id"])
    assert rec["state"] == "succeeded", (rec["log"], svc.worker_log())
    idx = N.ContextIndex.load(jobs.artifact_path(rec, "contexts.safetensors"))
    lm = load_model(model)
    windows = N.corpus_windows(lm.tokenizer, TEXTS, 4096, 16)
    assert torch.equal(idx.tokens, windows) and windows.shape[0] >= 8  # the corpus, cut into whole windows
    L, M, H = lm.shape.n_layers, lm.shape.d_mlp, lm.shape.n_heads
    acts = torch.zeros(L, M, *windows.shape)  # brute force: every window traced on its own
    norms = torch.zeros(L, H, *windows.shape)
    for w, ids in enumerate(windows.tolist()):
        tr = trace(lm, token_ids=ids)
        for l in range(L):
            acts[l, :, w] = tr.mlp_post(l).float().T
            for h in range(H):
                norms[l, h, w] = N.head_activity(tr, l, h)["norm"]
    for vals, top_i, top_v in ((acts, idx.neuron_idx, idx.neuron_vals), (norms, idx.head_idx, idx.head_vals)):
        vals[..., 0] = float("-inf")  # position 0 of a window has no context: skipped by the scan too
        flat = vals.flatten(2)
        best, where = flat.max(-1)  # [L, units]
        assert (top_i == where[..., None]).any(-1).all()  # the true argmax is among the stored top contexts
        torch.testing.assert_close(top_v[..., 0], best, atol=1e-4, rtol=1e-4)
    ctx = idx.contexts(lm.tokenizer, "neuron", 1, 7)
    assert len(ctx) == 3 and ctx[0]["value"] >= ctx[1]["value"] >= ctx[2]["value"]
    assert not shared_index_path(model).exists()  # inline texts are not shared

    # the built-in corpus: stored once where every page finds it
    rec = _wait(jobs, jobs.submit("neurons", {"model": model, "window": 32, "tokens": 256, "k": 2})["id"])
    assert rec["state"] == "succeeded", rec["log"]
    shared = N.ContextIndex.load(shared_index_path(model))
    assert shared.tokens.shape == (8, 32) and shared.meta["corpus"].startswith("stdlib-docstrings")
