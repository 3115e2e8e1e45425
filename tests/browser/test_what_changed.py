""""What changed" from a finished fine-tuning run (issue 43), in real headless Chromium with a real
Valkey and Celery worker on the real default model: the run's page opens from its link, the button
shows the diff the SFT job computed when it finished (no diff job queued): contexts ranked by
KL(base ‖ tuned), and the KL at each checkpoint the run kept, 0 at the base; a context clicked opens
the per-prompt view of exactly that context, whose last KL is the table's; a feature set trained on
the base by a features job gives the features that changed, and a row clicked opens that feature's
page; the crosscoder button trains one over both models at a layer (a real crosscoder job) and shows
its latents by class."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import launch_browser, plot_data, screenshot, server_with_jobs, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.real_model]

MODEL = "smollm2-135m-instruct"
# a short LoRA run that moves the model enough to rank contexts (tests/integration/test_model_diff.py)
RUN = {"model": MODEL, "method": "lora", "lora_rank": 8, "learning_rate": 2e-3, "max_steps": 6, "batch_size": 4,
       "builtin_train_size": 24, "accuracy_examples": 2, "eval_fraction": 0.25, "keep_checkpoints": 2}
# a small feature set on the base (tests/conftest.py's feature_set settings), trained by the app's own job
FEATURES = {"model": MODEL, "layer": 6, "hook": "resid_post", "max_tokens": 512, "num_latents": 1152, "k": 16,
            "batch_size": 4, "context": 32, "eval_tokens": 256, "context_tokens": 512, "seed": 4, "name": "base-l6"}


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    with server_with_jobs(tmp_path_factory.mktemp("diff") / "data") as pair:
        yield pair


def _table_rows(page, elem_id: str = "diff-contexts") -> list[list[str]]:
    """The rows of a table in view (a gr.Dataframe's rows are virtual), in order."""
    return page.evaluate("""(id) => [...document.querySelectorAll('#' + id + ' [role=grid] .virtual-row[role=row]')]
        .sort((a, b) => +a.dataset.index - +b.dataset.index)
        .map(r => [...r.querySelectorAll('[role=gridcell]')].map(c => c.innerText.trim()))""", elem_id)


def test_what_changed_from_a_finished_run(loop):
    from tasks import jobs

    svc, server = loop
    rec = jobs.submit("sft", RUN, owner="local")
    feats = jobs.submit("features", FEATURES, owner="local")
    done = jobs.wait_job(rec["id"], timeout=600)
    assert done["state"] == "succeeded", (done.get("error"), svc.worker_log()[-2000:])
    assert any(a["name"] == "diff.json" for a in done["artifacts"]), done["log"][-3:]  # computed as it finished
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url + f"?tab=fine-tune&job={rec['id']}")
        wait_until(lambda: f"Job {rec['id']}" in page.inner_text("#sft-info"), 60, "the linked run")
        assert not page.locator("#diff-contexts").is_visible()  # no empty table before there is a diff
        page.click("#sft-what-changed")
        try:
            wait_until(lambda: len(_table_rows(page)) >= 10, 300, "the ranked contexts")
        except AssertionError:
            raise AssertionError(f"status: {page.inner_text('#diff-status')!r}; worker: {svc.worker_log()[-1500:]}") from None
        status = page.inner_text("#diff-status")
        assert done["sft"]["model_name"] in status and MODEL in status and "mean KL" in status, status
        assert f"job {rec['id']}" in status, status  # the run's own diff
        # when did it change: 0 at the base, then the two kept checkpoints and the final model
        wait_until(lambda: len(plot_data(page, "diff-run")) == 8, 60, "the curve of each followed context")
        run = plot_data(page, "diff-run")
        assert len(run) == 8 and all(t["x"] == [0, 2, 4, 6] for t in run), run
        assert all(t["y"][0] == 0 and t["y"][-1] > 0 for t in run), run
        rows = _table_rows(page)
        kls = [float(r[0]) for r in rows]
        assert kls == sorted(kls, reverse=True) and kls[0] > 0, kls
        wait_until(lambda: plot_data(page, "diff-heads") and plot_data(page, "diff-layers"), 60, "the two charts")
        page.locator("#diff-contexts").scroll_into_view_if_needed()
        screenshot(page, "what-changed-contexts")

        # the top context, clicked: token by token, and its last position's KL is the table's
        page.locator("#diff-contexts [role=grid] .virtual-row[role=row]").first.locator("[role=gridcell]").nth(2).click()
        wait_until(lambda: "KL" in page.inner_text("#diff-prompt-changes"), 120, "the per-prompt view")
        shown = float(re.search(r"KL ([0-9.]+) nats", page.inner_text("#diff-prompt-changes")).group(1))
        assert abs(shown - kls[0]) < 2e-4, (shown, kls[0])
        # the chart is drawn after the summary's text: wait for it, not for the text alone
        wait_until(lambda: plot_data(page, "diff-prompt-kl"), 60, "the per-prompt KL chart")
        bars = plot_data(page, "diff-prompt-kl")[0]["y"]
        assert abs(bars[-1] - kls[0]) < 2e-4 and len(bars) > 1
        page.locator("#diff-prompt-kl").scroll_into_view_if_needed()
        screenshot(page, "what-changed-context")

        # the run's own diff was shown: no diff job was queued for it
        assert not [r for r in jobs.list_jobs() if r["kind"] == "diff"]

        # features of a set trained on the base: what appeared, vanished or shifted; a row opens its page
        fdone = jobs.wait_job(feats["id"], timeout=600)
        assert fdone["state"] == "succeeded", (fdone.get("error"), svc.worker_log()[-2000:])
        page.locator("#diff-feature-set").scroll_into_view_if_needed()
        page.locator("#diff-feature-set input").click()
        page.get_by_role("option", name="base-l6").click()
        page.click("#diff-features-go")
        wait_until(lambda: len(_table_rows(page, "diff-features")) >= 3, 300, "the features that changed")
        assert "features fire under the base" in page.inner_text("#diff-features-summary")
        first = _table_rows(page, "diff-features")[0]
        assert first[0] in ("appeared", "vanished", "shifted"), first
        page.locator("#diff-features [role=grid] .virtual-row[role=row]").first.locator("[role=gridcell]").nth(1).click()
        wait_until(lambda: f"Feature #{first[1]} of base-l6" in page.inner_text("#diff-feature-title"), 120,
                   "the feature's page")
        wait_until(lambda: plot_data(page, "diff-feature-weights"), 30, "the tokens the feature promotes")
        page.locator("#diff-feature-title").scroll_into_view_if_needed()
        screenshot(page, "what-changed-feature")

        # a crosscoder of the pair at layer 6, trained by a job the button queues
        page.locator("#diff-cc-go").scroll_into_view_if_needed()
        page.click("#diff-cc-go")
        wait_until(lambda: len(_table_rows(page, "diff-cc-latents")) >= 1, 600, "the crosscoder's latents")
        cc_status = page.inner_text("#diff-cc-status")
        assert "Variance explained" in cc_status and "blocks.6" in cc_status, cc_status
        wait_until(lambda: plot_data(page, "diff-cc-hist"), 60, "the crosscoder's histogram")
        hist = plot_data(page, "diff-cc-hist")
        assert sum(hist[0]["y"]) > 0
        assert {r[0] for r in _table_rows(page, "diff-cc-latents")} <= {"shared", "base-only", "tuned-only"}
        cc = [r for r in jobs.list_jobs() if r["kind"] == "crosscoder"]
        assert len(cc) == 1 and cc[0]["state"] == "succeeded" and cc[0]["params"]["layer"] == 6
        page.locator("#diff-cc-hist").scroll_into_view_if_needed()
        screenshot(page, "what-changed-crosscoder")
        browser.close()
