"""Edited generations on the shared engine (model_core.serving.engine_edits): steering vectors,
feature clamps and zero ablations run per row of a batched decode step.

Reference: transformers' own `generate(do_sample=False)` on the real default model with the same
edit written here as plain torch hooks on its modules (a pre-hook on the decoder layer adding the
vector, the clamp computed by hand from the autoencoder's weights, o_proj's input columns, the MLP's
output, down_proj's input column zeroed): lmscope's hooks, slots and engine are not in it. Every
row of a batch of four (plain, steered, clamped, ablated) must equal its own reference greedy
token for token, and its step logits must equal the reference's scores. The engine's counters prove
the four ran together, and on the second run from the CPU's recorded steps, not eagerly.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from model_core.core.row_edits import AddVector, RowEdit, RowSlot, engine_runnable
from model_core.core.sampling import SamplingSettings
from model_core.interp import features as F
from model_core.interp.feature_steering import feature_edits
from model_core.interp.interventions import Ablation, ablation_edits
from model_core.interp.steering import SteeringVector, steering_edits
from model_core.serving.engine import Engine, EngineRequest
from model_core.serving.generate import generate

PROMPTS = ["The capital of France is", "Once upon a time, there was a little",
           "def add(a, b):\n    return", "Water boils at"]
N_NEW = 10
STEER_LAYER, ALPHA, FROM = 12, 6.0, 2
CLAMP_LAYER, FEATURE, VALUE = 6, None, 30.0  # the feature: the one firing hardest on the prompt
ABLATION = Ablation(heads=[(3, 1), (3, 4)], mlps=[9], neurons=[(5, 17), (5, 400)])


@pytest.fixture(scope="module")
def feats(default_lm):
    sae = F.new_sae(default_lm.shape.d_model, num_latents=1152, k=16, seed=3, device=default_lm.device)
    with torch.no_grad():
        sae.encoder.bias.add_(0.05)
    return F.Features(sae=sae, model=default_lm.name, layer=CLAMP_LAYER, hook="resid_post", name="fresh")


@pytest.fixture(scope="module")
def vector(default_lm):
    v = torch.randn(default_lm.shape.d_model, generator=torch.Generator().manual_seed(1))
    return SteeringVector(model_name=default_lm.name, layer=STEER_LAYER, vector=v / v.norm() * 8, n_pairs=1,
                          position="last")


# --- the references: plain torch hooks on transformers' modules --------------------------------

def _hidden(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args, kwargs, h):
    return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})


def _ref_steer(model, vec: torch.Tensor):
    def pre(module, args, kwargs):
        h = _hidden(args, kwargs)
        add = vec.to(h.dtype)
        if h.shape[1] == 1:
            return _with_hidden(args, kwargs, h + add)
        h = h.clone()
        h[:, FROM:] += add
        return _with_hidden(args, kwargs, h)
    return [model.model.layers[STEER_LAYER].register_forward_pre_hook(pre, with_kwargs=True)]


def _ref_clamp(model, feats, feature: int):
    sae = feats.sae
    W, b, b_dec = sae.encoder.weight.detach(), sae.encoder.bias.detach(), sae.b_dec.detach()
    d_f = sae.W_dec.detach()[feature].float()

    def pre(module, args, kwargs):  # the block after CLAMP_LAYER reads its output
        h = _hidden(args, kwargs)
        lo = 0 if h.shape[1] == 1 else 1
        x = h[:, lo:].float()
        pre_act = torch.relu((x - b_dec) @ W.T + b)  # [B, T, M]
        top = torch.topk(pre_act, sae.cfg.k, dim=-1)
        a = (top.values * (top.indices == feature)).sum(-1)  # [B, T]
        out = h.clone()
        out[:, lo:] = (x + (VALUE - a)[..., None] * d_f).to(h.dtype)
        return _with_hidden(args, kwargs, out)
    return [model.model.layers[CLAMP_LAYER + 1].register_forward_pre_hook(pre, with_kwargs=True)]


def _ref_ablate(model, dh: int):
    handles = []
    for l in {l for l, _ in ABLATION.heads}:
        cols = [c for ll, h in ABLATION.heads if ll == l for c in range(h * dh, (h + 1) * dh)]
        handles.append(model.model.layers[l].self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, cols=cols: (a[0].index_fill(-1, torch.tensor(cols), 0.0),)))
    for l in ABLATION.mlps:
        handles.append(model.model.layers[l].mlp.register_forward_hook(lambda m, a, out: torch.zeros_like(out)))
    for l in {l for l, _ in ABLATION.neurons}:
        idx = torch.tensor([n for ll, n in ABLATION.neurons if ll == l])
        handles.append(model.model.layers[l].mlp.down_proj.register_forward_pre_hook(
            lambda m, a, idx=idx: (a[0].index_fill(-1, idx, 0.0),)))
    return handles


def _hf_greedy(lm, prompt: str, handles=()) -> tuple[list[int], torch.Tensor]:
    """(tokens, scores [N_NEW, V]) of transformers' greedy generate with the hooks in `handles` on."""
    ids = lm.tokenizer(prompt)["input_ids"]
    try:
        with torch.inference_mode():
            out = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=N_NEW, pad_token_id=lm.tokenizer.pad_token_id,
                                    output_scores=True, return_dict_in_generate=True)
    finally:
        for h in handles:
            h.remove()
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.scores)[:, 0].float()


def _hottest_feature(lm, feats) -> int:
    from model_core.interp.features import _encode
    from model_core.interp.trace import trace

    x = trace(lm, PROMPTS[2], layers=[CLAMP_LAYER + 1]).resid_pre[CLAMP_LAYER + 1][-1]  # [d]
    acts, idx = _encode(feats.sae, x[None].float())
    return int(idx[0, acts[0].argmax()])


def _run_together(eng, lm, edit_sets) -> list[list]:
    reqs = [EngineRequest(ids=lm.tokenizer(p)["input_ids"], n_steps=N_NEW, settings=SamplingSettings(temperature=0.0),
                          seed=0, eos=set(), keep_logits=True, edits=e) for p, e in zip(PROMPTS, edit_sets)]
    with eng.hold():
        for r in reqs:
            eng.submit(r)
    out = []
    for r in reqs:
        recs, deadline = [], time.monotonic() + 300
        while (rec := r.out.get(timeout=max(1.0, deadline - time.monotonic()))) is not None:
            recs.append(rec)
        assert r.error is None, r.error
        out.append(recs)
    return out


def test_plain_steered_clamped_and_ablated_rows_in_one_batch_equal_transformers_with_hooks(default_lm, feats, vector):
    lm = default_lm
    feature = _hottest_feature(lm, feats)
    edit_sets = [None, steering_edits(lm, vector, ALPHA, from_position=FROM),
                 feature_edits(lm, feats, feature, VALUE), ablation_edits(lm, ABLATION)]
    assert all(engine_runnable(e, lm.device) for e in edit_sets)
    refs = [_hf_greedy(lm, PROMPTS[0]),
            _hf_greedy(lm, PROMPTS[1], _ref_steer(lm.model, ALPHA * vector.vector)),
            _hf_greedy(lm, PROMPTS[2], _ref_clamp(lm.model, feats, feature)),
            _hf_greedy(lm, PROMPTS[3], _ref_ablate(lm.model, lm.shape.d_head))]
    plain = [_hf_greedy(lm, p)[0] for p in PROMPTS]
    assert all(refs[i][0] != plain[i] for i in (1, 2, 3)), "an edit that changes nothing proves nothing"

    eng = Engine(lm, slots=4, max_len=256, record_steps=True)
    assert eng.ready.wait(300)
    try:
        for attempt in ("eager", "recorded"):
            before = dict(eng.stats.batch_sizes), eng.stats.edited_eager_steps, dict(eng._recorded.replays)
            got = _run_together(eng, lm, edit_sets)
            together = eng.stats.batch_sizes.get(4, 0) - before[0].get(4, 0)
            assert together >= N_NEW - 1, eng.stats.batch_sizes  # every decode step ran all four rows
            for (tokens, scores), recs, prompt in zip(refs, got, PROMPTS):
                assert [int(r.packed[0]) for r in recs] == tokens, (attempt, prompt)
                torch.testing.assert_close(torch.stack([r.logits for r in recs]).float(), scores,
                                           atol=2e-3, rtol=1e-3)
            if attempt == "eager":
                assert eng.stats.edited_eager_steps > before[1]
                assert eng._recorded.wait_recorded(300), eng._recorded.stats()
            else:  # the edited bucket replayed from its recording, none eagerly
                assert eng.stats.edited_eager_steps == before[1]
                assert eng._recorded.replays.get("step", 0) > before[2].get("step", 0)
    finally:
        eng.close()


def test_a_steered_row_changes_no_bit_of_its_batch_mates(default_lm):
    """Rows batched with a steered row (in the prefill and in every decode step) get exactly the
    logits they get batched with plain rows: the slot's identity (zeros added) changes no bit, and a
    row's edit stays in its row. The steered row's tokens are its own generation's."""
    lm = default_lm
    eng = Engine(lm, slots=4, max_len=256, use_graphs=False, compile=False)
    assert eng.ready.wait(300)
    try:
        steer = {"blocks.4.hook_resid_pre": AddVector(torch.full((lm.shape.d_model,), 0.5), start=2)}
        base = _run_together(eng, lm, [None] * 4)
        mixed = _run_together(eng, lm, [None, steer, None, None])
        for i in (0, 2, 3):
            assert torch.equal(torch.stack([r.logits for r in mixed[i]]), torch.stack([r.logits for r in base[i]]))
        assert [int(r.packed[0]) for r in mixed[1]] != [int(r.packed[0]) for r in base[1]]
        alone = generate(lm, PROMPTS[1], max_new_tokens=N_NEW, ignore_eos=True, edits=steer)
        assert [int(r.packed[0]) for r in mixed[1]] == alone.token_ids
    finally:
        eng.close()


def test_a_mean_ablation_keeps_the_request_path(default_lm):
    """A mean is over one forward's positions, which a decode step's one position has not: no per-row
    form, so such a generation runs on the request's own forwards (and still generates)."""
    lm = default_lm
    edits = ablation_edits(lm, Ablation(mlps=[2], mode="mean"))
    assert not engine_runnable(edits, lm.device)
    g = generate(lm, PROMPTS[0], max_new_tokens=3, ignore_eos=True, edits=edits)
    assert len(g.token_ids) == 3


def _wait(cond, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_edited_generations_through_generate_batch_on_the_shared_engine(default_lm, vector):
    """generate(..., edits=steering) from several threads: the engine's steps ran them together."""
    from model_core.serving.engine import engine_for

    lm = default_lm
    eng = engine_for(lm)
    steer = steering_edits(lm, vector, ALPHA, from_position=FROM)
    out = [None] * 3
    before = dict(eng.stats.batch_sizes)
    with eng.hold():
        ts = [threading.Thread(target=lambda i=i: out.__setitem__(i, generate(
            lm, PROMPTS[i], max_new_tokens=N_NEW, ignore_eos=True, edits=steer if i != 1 else None)))
              for i in range(3)]
        for t in ts:
            t.start()
        _wait(lambda: eng.waiting() == 3)
    for t in ts:
        t.join(300)
    assert eng.stats.batch_sizes.get(3, 0) - before.get(3, 0) >= N_NEW - 1
    assert out[0].token_ids == _hf_greedy(lm, PROMPTS[0], _ref_steer(lm.model, ALPHA * vector.vector))[0]
    assert out[1].token_ids == _hf_greedy(lm, PROMPTS[1])[0]


def test_the_steered_and_unsteered_runs_of_the_panel_share_the_engines_steps(default_lm, vector):
    """steered_pair (the Generate tab's side by side): both runs batched on the engine, each equal to
    transformers' greedy generate with (and without) the vector as a plain hook."""
    from model_core.serving.engine import engine_for
    from model_core.serving.steered import steered_pair

    lm = default_lm
    eng = engine_for(lm)
    before = dict(eng.stats.batch_sizes)
    base, steered = steered_pair(lm, PROMPTS[1], vector, ALPHA, from_position=FROM, max_new_tokens=N_NEW,
                                 ignore_eos=True)
    assert eng.stats.batch_sizes.get(2, 0) - before.get(2, 0) >= N_NEW // 2, eng.stats.batch_sizes
    assert base.generation.token_ids == _hf_greedy(lm, PROMPTS[1])[0]
    assert steered.generation.token_ids == _hf_greedy(lm, PROMPTS[1], _ref_steer(lm.model, ALPHA * vector.vector))[0]
    assert base.alpha == 0.0 and steered.alpha == ALPHA


class _Probe(RowSlot):
    """A test's window into the engine's decode steps: keeps what reaches its hook, changes nothing."""

    def __init__(self, name, slots, seen):
        super().__init__(name, slots)
        self.seen = seen

    def tensors(self):
        return []

    def reset(self, row):
        pass

    def write(self, row, edit):
        pass

    def apply(self, x):
        self.seen.append(x.detach().clone())  # [B, 1, d]
        return x


class _ProbeEdit(RowEdit):
    def __init__(self, seen):
        self.seen = seen

    def __call__(self, name, x):
        return x

    def slot_key(self, name):
        return (name, "probe")

    def new_slot(self, name, slots, dtype, device):
        return _Probe(name, slots, self.seen)


def test_an_edit_at_layer_l_leaves_every_layer_before_it_bit_identical(default_lm):
    """In the engine's decode steps, with row 1 steered at layer 5 from its first generated token on:
    the residual stream entering layer 3 is bit for bit the plain run's in row 1 as long as its
    tokens are the same (they are at the first step: the prefill is not steered), and in every other
    row at every step; entering layer 8 it moved in row 1 at every step and nowhere else."""
    lm = default_lm
    eng = Engine(lm, slots=4, max_len=256, use_graphs=False, compile=False)
    assert eng.ready.wait(300)
    try:
        seen = {3: [], 8: []}
        probes = {f"blocks.{l}.hook_resid_pre": _ProbeEdit(seen[l]) for l in seen}
        n_prompt = len(lm.tokenizer(PROMPTS[1])["input_ids"])
        steer = {"blocks.5.hook_resid_pre": AddVector(torch.full((lm.shape.d_model,), 0.5), start=n_prompt)}

        def run(row1):
            for v in seen.values():
                v.clear()
            recs = _run_together(eng, lm, [probes, {**probes, **row1}, probes, probes])
            return [int(r.packed[0]) for r in recs[1]], {l: torch.stack(v) for l, v in seen.items()}  # [steps, B, 1, d]

        (plain_tokens, plain), (steered_tokens, steered) = run({}), run(steer)
        assert plain[3].shape == steered[3].shape and plain[3].shape[:2] == (N_NEW - 1, 4)
        same = next((i for i, (a, b) in enumerate(zip(plain_tokens, steered_tokens)) if a != b), N_NEW)
        assert same >= 1  # the first generated token comes from the unsteered prefill
        others = [0, 2, 3]
        assert torch.equal(plain[3][:, others], steered[3][:, others])
        assert torch.equal(plain[3][:same, 1], steered[3][:same, 1])
        moved = (plain[8] != steered[8]).flatten(2).any(-1)  # [steps, B]
        assert moved[:, 1].all() and not moved[:, others].any()
    finally:
        eng.close()
