""""What changed" from a finished fine-tuning run (issue 43), in real headless Chromium with a real
Valkey and Celery worker on the real default model: the run's page opens from its link, the button
queues a diff job over the built-in corpus and shows its contexts ranked by KL(base ‖ tuned), and a
context clicked opens the per-prompt view of exactly that context, whose last KL is the table's."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import launch_browser, plot_data, screenshot, server_with_jobs, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.real_model]

MODEL = "smollm2-135m-instruct"
# a short LoRA run that moves the model enough to rank contexts (tests/integration/test_model_diff.py)
RUN = {"model": MODEL, "method": "lora", "lora_rank": 8, "learning_rate": 2e-3, "max_steps": 6, "batch_size": 4,
       "builtin_train_size": 24, "accuracy_examples": 2, "eval_fraction": 0.25}


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    with server_with_jobs(tmp_path_factory.mktemp("diff") / "data") as pair:
        yield pair


def _table_rows(page) -> list[list[str]]:
    """The rows of the contexts table in view (a gr.Dataframe's rows are virtual), in order."""
    return page.evaluate("""() => [...document.querySelectorAll('#diff-contexts [role=grid] .virtual-row[role=row]')]
        .sort((a, b) => +a.dataset.index - +b.dataset.index)
        .map(r => [...r.querySelectorAll('[role=gridcell]')].map(c => c.innerText.trim()))""")


def test_what_changed_from_a_finished_run(loop):
    from tasks import jobs

    svc, server = loop
    rec = jobs.submit("sft", RUN, owner="local")
    done = jobs.wait_job(rec["id"], timeout=600)
    assert done["state"] == "succeeded", (done.get("error"), svc.worker_log()[-2000:])
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
        rows = _table_rows(page)
        kls = [float(r[0]) for r in rows]
        assert kls == sorted(kls, reverse=True) and kls[0] > 0, kls
        assert plot_data(page, "diff-heads") and plot_data(page, "diff-layers")
        page.locator("#diff-contexts").scroll_into_view_if_needed()
        screenshot(page, "what-changed-contexts")

        # the top context, clicked: token by token, and its last position's KL is the table's
        page.locator("#diff-contexts [role=grid] .virtual-row[role=row]").first.locator("[role=gridcell]").nth(2).click()
        wait_until(lambda: "KL" in page.inner_text("#diff-prompt-changes"), 120, "the per-prompt view")
        shown = float(re.search(r"KL ([0-9.]+) nats", page.inner_text("#diff-prompt-changes")).group(1))
        assert abs(shown - kls[0]) < 2e-4, (shown, kls[0])
        bars = plot_data(page, "diff-prompt-kl")[0]["y"]
        assert abs(bars[-1] - kls[0]) < 2e-4 and len(bars) > 1
        page.locator("#diff-prompt-kl").scroll_into_view_if_needed()
        screenshot(page, "what-changed-context")

        # a second press shows the finished diff at once, not a new job
        n_jobs = len([r for r in jobs.list_jobs() if r["kind"] == "diff"])
        page.click("#sft-what-changed")
        wait_until(lambda: "mean KL" in page.inner_text("#diff-status"), 60, "the same diff again")
        assert len([r for r in jobs.list_jobs() if r["kind"] == "diff"]) == n_jobs == 1
        browser.close()
