"""Generate's step figures (distribution, KV cache, a step's attention) skip plotly's validators
(they are rebuilt on every finished generation and every step clicked), so
app/tabs/generate/figures.py writes every layout value the way the validators would leave it. The
reference is plotly validating the same dict: a key it would reject raises, and anything it would
rewrite (a bare title string, a missing default template) shows up as a difference. Inputs: real
generations of a tiny random-weight model, with the filters on (removed candidates), plain sampling
and greedy, labelled and stated as the Generate tab does (app/tabs/generate/tab.py)."""

from __future__ import annotations

import json

import plotly.graph_objects as go
import pytest

from app.tabs.generate import figures as F
from app.tabs.generate import tab
from app.tabs.generate.tab import _Labeller, _light_state
from model_core import load_model
from model_core.core.sampling import SamplingSettings
from model_core.core.tokenization import describe_tokens
from model_core.serving.generate import generate, step_attention, step_to_json

SETTINGS = {"filtered": SamplingSettings(temperature=0.8, top_k=5, top_p=0.9),
            "plain": SamplingSettings(temperature=1.0), "greedy": None}


@pytest.fixture(scope="module")
def generations():
    """name -> (lm, steps as the tab holds them, the tab's state after the run: kv report, growth)."""
    lm = load_model("random-llama-tiny", device="cpu")
    out = {}
    for name, settings in SETTINGS.items():
        gen = generate(lm, "Once upon a time", max_new_tokens=6, ignore_eos=True, settings=settings, seed=2)
        steps = [step_to_json(lm, s) for s in gen.steps]
        labeller = _Labeller(lm.tokenizer, gen.prompt_ids)
        for step in steps:
            labeller.add(step)
        labeller.label(steps)
        out[name] = (lm, steps, _light_state(lm, gen, steps))
    return out


def _figures(lm, steps: list[dict], state: dict) -> dict[str, go.Figure]:
    """Each unvalidated figure, with the inputs show_step and _finished give it."""
    out = {f"distribution_figure step {s['index']}": F.distribution_figure(s) for s in steps}
    # a drawn token past the recorded top 10 gets its own bar in both charts
    past_top = {**steps[0], "chosen": {**steps[0]["chosen"], "id": -1, "rank": 16}}
    out["distribution_figure chosen past the top 10"] = F.distribution_figure(past_top)
    out["kv_cache_figure"] = F.kv_cache_figure(state["kv"], state["growth"])
    out["kv_cache_figure no growth"] = F.kv_cache_figure(state["kv"])
    step = steps[3]
    attention = step_attention(lm, state["ids"], step["position"]).float().mean(1).tolist()  # [layers, context]
    labels = [t["display"] for t in describe_tokens(lm.tokenizer, state["ids"])][: step["position"]]
    out["attention_figure"] = F.attention_figure(attention, labels, step["index"], F.step_label(step))
    out["attention_figure no token label"] = F.attention_figure(attention, labels, step["index"])
    return out


def _json(fig: go.Figure) -> dict:
    return json.loads(fig.to_json())


def test_unvalidated_step_figures_equal_plotly_validated_builds(generations):
    removed = 0
    for run, (lm, steps, state) in generations.items():
        for name, fig in _figures(lm, steps, state).items():
            assert fig._validate is False, f"{run}: {name} was built with plotly's validators on"
            validated = go.Figure(fig.to_dict())  # raises on a key plotly does not know
            assert _json(fig) == _json(validated), f"{run}: {name}"
        # what the tab sends (tab._distribution, tab._kv_cache): the spec serialized by orjson
        sent = {f"step {s['index']}": tab._distribution(s) for s in steps}
        sent["kv cache"] = tab._kv_cache(state["kv"], state["growth"])
        for name, payload in sent.items():
            validated = go.Figure(json.loads(payload.plot))  # raises on a key plotly does not know
            assert json.loads(payload.plot) == _json(validated), f"{run}: sent {name}"
        removed += sum(bool(c.get("removed_by")) for s in steps for c in s["top_before"])
    assert removed, "no candidate removed by a filter: the removal colours and legend went untested"
