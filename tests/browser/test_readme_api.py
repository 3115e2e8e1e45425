"""Every example in the README's "Public API" table, run as written through gradio_client against a
live server with a real Valkey and Celery worker, after a fine-tuning run of the real default model
registered a model the server did not have when it started (the case a fresh API client meets: no
page event has refreshed any menu). The placeholders are filled in: `<fine-tuned name>` with that
model, `<job id>` with a finished job of the kind the endpoint compares. Each answer is checked for
what the endpoint is for, not only for the absence of an error."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.browser import ROOT, server_with_jobs

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.real_model]

MODEL = "smollm2-135m-instruct"
TINY_RUN = {"model": MODEL, "method": "full", "max_steps": 2, "batch_size": 2, "max_length": 256,
            "builtin_train_size": 8, "accuracy_examples": 2, "eval_fraction": 0.25, "eval_every": 1}


def readme_examples() -> list[tuple[str, str]]:
    """(endpoint, example code) for each row of the README's Public API table, in its order."""
    section = (ROOT / "README.md").read_text().split("## Public API", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `/(\w+)` \| .*? \| `(c\.predict\(.*\))` \|$", section, re.M)
    assert len(rows) >= 20, "the README's API table was not found"
    return rows


def _text(result) -> str:
    """Everything an answer holds, as one string (plots, tables and HTML included)."""
    return json.dumps(result, ensure_ascii=False, default=str)


def _plot(result) -> dict:
    """A gr.Plot's answer as gradio_client gives it: the Plotly figure."""
    fig = result.get("plot") if isinstance(result, dict) else None
    return json.loads(fig) if isinstance(fig, str) else {}


def _queued_id(result) -> str:
    """The job id a submission answered with ("Queued job **<id>**")."""
    m = re.search(r"Queued (?:background )?job \*\*(\w+)\*\*", _text(result))
    assert m, _text(result)[:300]
    return m.group(1)


def _table(result) -> list:
    return (result or {}).get("data") or [] if isinstance(result, dict) else []


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """(client, the fine-tuned model's name, its SFT job id, the worker's services)."""
    from gradio_client import Client

    from tasks import jobs

    with server_with_jobs(tmp_path_factory.mktemp("readme-api") / "data") as (svc, server):
        client = Client(server.url, verbose=False)  # connected before the model exists
        rec = jobs.submit("sft", TINY_RUN, owner="local")
        done = jobs.wait_job(rec["id"], timeout=600)
        assert done["state"] == "succeeded", (done.get("error"), svc.worker_log()[-2000:])
        yield client, done["sft"]["model_name"], rec["id"], svc


def test_every_readme_example_runs_as_written(api):
    from tasks import jobs

    client, tuned, sft_job, svc = api
    queued, failed = [], []
    results = {}
    for name, code in readme_examples():
        job = sft_job
        if name == "tokenize":  # its example compares a finished tokenizer job: the one queued above
            job = _queued_id(results["jobs_submit_tokenizer"])
            done = jobs.wait_job(job, timeout=300)
            assert done["state"] == "succeeded", (done.get("error"), svc.worker_log()[-2000:])
        filled = code.replace('"<fine-tuned name>"', repr(tuned)).replace('"<job id>"', repr(job))
        try:
            results[name] = out = eval(filled, {"c": client})  # noqa: S307 - the README's own example text
            assert "⚠️" not in _text(out), _text(out)[:600]
            CHECKS[name](out, tuned)
        except Exception as e:  # noqa: BLE001 - every example runs; the failures are named together
            failed.append(f"/{name}: {type(e).__name__}: {str(e)[:300]}")
            continue
        if name.startswith("jobs_submit_"):
            queued.append(_queued_id(out))
            if name != "jobs_submit_tokenizer":  # the worker stays free for the jobs this test waits on
                jobs.cancel_job(queued[-1])
    for job in queued:
        if jobs.get_job(job)["state"] in ("queued", "running"):
            jobs.cancel_job(job)
    assert not failed, "README examples that failed as written:\n" + "\n".join(failed)
    assert set(results) == set(CHECKS)


def test_model_menus_take_a_model_registered_after_start(api):
    """/model_info and the comparison endpoints with the fine-tuned model's name, from a client that
    no page event has told about it; a name the server does not have is still one sentence."""
    from gradio_client.exceptions import AppError

    client, tuned, _, _ = api
    info = client.predict(tuned, api_name="/model_info")
    assert tuned in info and "parameters" in info and "⚠️" not in info, info
    both = client.predict(MODEL, tuned, "2024-03-15", True, api_name="/generate_both")
    assert both.count("<td>") == 2 and tuned in both and MODEL in both, both
    for bad in ("no-such-model", "../../etc/passwd"):
        with pytest.raises(AppError) as e:
            client.predict(None, bad, api_name="/weight_change")
        msg = str(e.value)  # one sentence naming the menu, nothing of the server's
        assert "'Fine-tuned model' must be one of its choices" in msg and msg.count(". ") == 0, msg
        assert "Traceback" not in msg and "/root" not in msg and "http" not in msg, msg


def _plots(out) -> list[dict]:
    """Every Plotly figure in an answer (a gr.update's value included)."""
    items = out if isinstance(out, (list, tuple)) else [out]
    items = [x.get("value") if isinstance(x, dict) and x.get("__type__") == "update" else x for x in items]
    return [f for f in map(_plot, items) if f.get("data")]


def _title(fig: dict) -> str:
    t = (fig.get("layout") or {}).get("title")
    return (t.get("text") if isinstance(t, dict) else t) or ""


def _has(*needles):
    def check(out, tuned):
        text = _text(out).lower()
        missing = [n.replace("{tuned}", tuned) for n in needles if n.replace("{tuned}", tuned).lower() not in text]
        assert not missing, f"missing {missing} in {text[:300]}"
    return check


def _n_plots(n, *needles):
    def check(out, tuned):
        assert len(_plots(out)) >= n, f"{len(_plots(out))} plots, wanted {n}: {_text(out)[:300]}"
        _has(*needles)(out, tuned)
    return check


def _generated(out, tuned):
    text, tokens = out[0], out[1]
    assert isinstance(text, str) and text.strip() and len(tokens) >= 10, _text(out)[:300]


def _samples(out, tuned):
    rows = _table(out[0])  # one row per seed, then the tally
    assert [r[0] for r in rows[:4]] == [0, 1, 2, 3] and all(str(r[1]).strip() for r in rows[:4]), rows
    assert "distinct texts out of 4" in str(rows[4]), rows


def _queued(out, tuned):
    _queued_id(out)


def _tokenized(out, tuned):
    """The default model's tokenizer and the job's, each giving the prompt back; their compression chart."""
    html = out[0]
    assert MODEL in html and "byte-level-bpe" in html and html.count("round trip: exact") == 2, html[:600]
    assert _plots(out), _text(out)[:300]


def _runs(out, tuned):
    fig, table = _plots(out), _table(out[1])
    assert fig and len(fig[0]["data"]) >= 2 and any(tuned in str(r[0]) for r in table), _text(out)[:300]


def _both(out, tuned):
    assert out.count("<td>") == 2 and tuned in out and MODEL in out and "2024-03-15" in out, out[:300]


def _weights(out, tuned):
    figs = _plots(out)
    assert figs and "max" in _title(figs[0]), _text(out)[:300]


CHECKS = {
    "trace": _has("Paris"),
    "model_info": _has(MODEL, "parameters", "30 layers"),
    "generate": _generated,
    "sample": _samples,
    "speculative": _has("the same tokens as plain greedy", "target forwards", "drafted, kept"),
    "steer": _has("α = 4", "KL"),
    "ablate": _has("zero-ablated: L5H3", "Paris", "Rome"),
    "patch": _has("patched runs", "Strongest cell"),
    "attribute": _has("Sum of the parts"),
    "compare_prompts": _n_plots(2),
    "anatomy_card": _has("LlamaForCausalLM", "gpt2", "deepseek-v2"),
    "anatomy_tree": _has("LlamaForCausalLM", "embed_tokens"),
    "anatomy_attention": _n_plots(1),
    "anatomy_rope": _n_plots(1),
    "anatomy_positions": _n_plots(1),
    "anatomy_norm": _n_plots(1),
    "anatomy_mlp": _n_plots(1),
    "anatomy_output": _n_plots(1, "Paris"),
    "anatomy_embeddings": _n_plots(1, "Prague"),
    "jobs_list": _has("{tuned}", "succeeded"),
    "jobs_submit_tokenizer": _queued,
    "jobs_submit_sft": _queued,
    "jobs_submit_patching": _queued,
    "tokenize": _tokenized,
    "loss_mask": _has("in the loss", "masked"),
    "compare_runs": _runs,
    "generate_both": _both,
    "weight_change": _weights,
    "compare_models": _n_plots(3, "KL(tuned ‖ base)", "{tuned}", MODEL),
}
