"""The train-then-inspect loop in real headless Chromium, with a real Valkey and Celery worker: a
fine-tuning run of the real default model registers a model, and - without restarting the server -
an already-open page lists it in its model menu, a `?model=` link opens it, the run is labelled by
how it was trained, two runs overlay in the comparison, and the downloaded Hugging Face folder loads
with transformers and gives the registered model's logits."""

from __future__ import annotations

import zipfile

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import (
    launch_browser,
    plot_data,
    plot_title,
    screenshot,
    server_with_jobs,
    set_number,
    wait_title,
    wait_until,
)

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.real_model]

MODEL = "smollm2-135m-instruct"
# As small as a real run gets: a couple of optimizer steps on the built-in date task.
TINY_RUN = {"max_steps": 2, "batch_size": 2, "max_length": 256, "builtin_train_size": 8, "accuracy_examples": 2,
            "eval_fraction": 0.25, "eval_every": 1}


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    with server_with_jobs(tmp_path_factory.mktemp("loop") / "data") as pair:
        yield pair


def _menu_options(page, elem_id: str) -> str:
    """The option labels a dropdown offers right now (opened as a user would, then closed)."""
    page.locator(f"#{elem_id} input").click()
    try:
        page.locator(f"#{elem_id} [role=option]").first.wait_for(timeout=3000)  # the list opens
    except Exception:  # noqa: BLE001 - an empty menu has no options to wait for
        pass
    text = "\n".join(page.locator(f"#{elem_id} [role=option]").all_inner_texts())
    _close(page, elem_id)
    return text


def _close(page, elem_id: str) -> None:
    """Close the menu and leave it, as a user clicking elsewhere (a focused menu does not reopen on click)."""
    page.keyboard.press("Escape")
    page.locator(f"#{elem_id} input").evaluate("e => e.blur()")


def _pick(page, elem_id: str, text: str) -> None:
    """Choose an option as a user does: type to filter the menu, click the option."""
    box = page.locator(f"#{elem_id} input")
    box.click()
    box.fill(text)
    page.locator(f"#{elem_id} [role=option]", has_text=text).first.click()
    _close(page, elem_id)


def _same_answers_in_both_tables(page) -> None:
    """The held-out accuracy's 'before' answers and the samples' step 0 are the same greedy answers at
    two lengths: each table says how far it generates, and where the accuracy's answer is shorter it
    is the sample's beginning, marked cut (…)."""
    wait_until(lambda: page.locator(".lmscope-sft-examples td[data-cut]").count() > 0
               and page.locator(".lmscope-samples-table td[data-step='0']").count() > 0, 60, "both answer tables")
    note = page.inner_text(".lmscope-sft-examples-note")
    assert "length + 4 tokens" in note and "samples below run to" in note, note
    assert "tokens" in page.inner_text(".lmscope-samples-note")
    accuracy = page.evaluate("""() => [...document.querySelectorAll('.lmscope-sft-examples tr')].slice(1).map(
        r => [r.cells[0].innerText, r.cells[2].querySelector('code').innerText, r.cells[2].dataset.cut])""")
    samples = dict(page.evaluate("""() => [...document.querySelectorAll('.lmscope-samples-table tr')].map(
        r => [r.cells[0].innerText, (r.querySelector("td[data-step='0'] code") || {}).innerText])
        .filter(r => r[1] !== undefined)"""))
    shared = [(prompt, " ".join(got.split()), cut) for prompt, got, cut in accuracy if prompt in samples]
    assert shared, (accuracy, samples)
    for prompt, got, cut in shared:
        longer = " ".join(samples[prompt].split())
        assert longer.startswith(got), (prompt, got, longer)  # one answer, not two
        assert cut == ("1" if len(longer) > len(got) else "0"), (prompt, got, longer, cut)
    screenshot(page, "finetune-before-answers-agree")


def test_finetuned_model_opens_without_a_restart(loop):
    from tasks import jobs

    svc, server = loop
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        page.wait_for_selector("#model input")

        full = jobs.submit("sft", {"model": MODEL, "method": "full", **TINY_RUN}, owner="local")
        lora = jobs.submit("sft", {"model": "random-llama-tiny", "method": "lora", "lora_rank": 4, **TINY_RUN},
                           owner="local")
        for rec in (full, lora):
            done = jobs.wait_job(rec["id"], timeout=600)
            assert done["state"] == "succeeded", (done.get("error"), svc.worker_log()[-2000:])
        name = full["sft"]["model_name"]
        assert "-sft-full-" in name and "-sft-lora-" in lora["sft"]["model_name"]

        # the page opened before the run lists the new model within a few seconds, no reload
        wait_until(lambda: name in _menu_options(page, "model"), 30, f"{name} in the header's model menu")
        screenshot(page, "finetune-menu-has-new-model")

        # a link naming it opens it: the trace runs on the fine-tuned model
        page2 = browser.new_page(viewport={"width": 1400, "height": 1000})
        page2.goto(server.url + f"?model={name}&prompt=2024-03-15")
        wait_until(lambda: name in page2.inner_text("#explore-status"), 120, "the trace on the fine-tuned model")
        assert "not in the list of choices" not in page2.inner_text("body")

        # a link to the run opens its tab and the run itself (what a reload or a teammate gets)
        page3 = browser.new_page(viewport={"width": 1400, "height": 1000})
        page3.goto(server.url + f"?tab=fine-tune&job={full['id']}")
        wait_until(lambda: f"Job {full['id']}" in page3.inner_text("#sft-info"), 60, "the linked run")
        _same_answers_in_both_tables(page3)
        page3.close()

        # the Fine-tune tab: runs labelled by method, overlaid in the comparison
        page.get_by_role("tab", name="Fine-tune").click()
        seen = []

        def labelled_full():
            seen.append(_menu_options(page, "sft-job"))
            return "(full)" in seen[-1]
        try:
            wait_until(labelled_full, 60, "the run labelled full")
        except AssertionError:
            screenshot(page, "finetune-job-menu")
            raise AssertionError(f"the job menu offers {seen[-1:]!r}") from None
        # nothing picked by hand: the comparison opens on the newest finished runs, the two above
        wait_until(lambda: len(plot_data(page, "sft-runs-plot")) >= 4, 60, "two runs' train and eval curves")
        table = page.inner_text("#sft-runs-table")
        assert "full" in table and "LoRA r4" in table
        screenshot(page, "finetune-runs-compared")

        # the fine-tuned model against its parent: headline numbers first, and both models' answers;
        # no empty plot boxes before there is anything to show
        result_plots = ["sft-next", "sft-kl", "sft-lens", "sft-attn", "sft-delta"]
        assert not [p for p in result_plots if page.locator(f"#{p}").is_visible()]
        page.locator("#prompt textarea").fill("Convert 2024-03-15 to DD/MM/YYYY.")
        _pick(page, "sft-tuned", name)
        page.click("#sft-compare")
        wait_until(lambda: "KL(tuned ‖ base)" in page.inner_text("#sft-headline"), 120, "the comparison headline")
        assert MODEL in page.inner_text("#sft-headline") and name in page.inner_text("#sft-headline")
        page.click("#sft-generate-both")
        wait_until(lambda: page.locator("#sft-both td").count() == 2, 120, "two generations side by side")
        assert all(page.locator(f"#{p}").is_visible() for p in result_plots[:4])
        page.click("#sft-weight-delta")
        wait_until(lambda: "max" in plot_title(page, "sft-delta"), 120, "the weight-change heatmap")
        assert page.locator("#sft-delta").is_visible()
        screenshot(page, "finetune-compare-with-base")

        # take the model away: the zip is a Hugging Face folder that transformers loads, same logits
        # (540 MB for a full fp32 copy: streamed to disk, not through the browser's memory)
        import httpx

        zpath = svc.data_dir / "model.zip"
        with httpx.stream("GET", server.url + f"download/model/{name}.zip", timeout=300) as resp:
            assert resp.status_code == 200
            with open(zpath, "wb") as f:
                for chunk in resp.iter_bytes(1 << 20):
                    f.write(chunk)
        with zipfile.ZipFile(zpath) as z:
            names = z.namelist()
            assert any(n.endswith("config.json") for n in names) and any(n.endswith("README.md") for n in names)
            out = svc.data_dir / "unzipped"
            z.extractall(out)
        browser.close()

    import torch
    from transformers import AutoModelForCausalLM

    from model_core import load_model

    root = next(p.parent for p in out.rglob("config.json"))
    theirs = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    ours = load_model(name)
    ids = ours.tokenizer("Convert 2024-03-15 to DD/MM/YYYY.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours.model(ids).logits)


def test_pretrain_form_and_curves(loop):
    """Training from scratch (the accordion under Fine-tune): a scaling sweep of two tiny widths
    started from the form draws its loss/perplexity curves and the L(N) plot with the fitted α and
    the published laws, and its models join the model menu."""
    svc, server = loop
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url + "?tab=fine-tune")
        page.locator("#pt-accordion").get_by_text("Train from scratch").first.click()
        page.wait_for_selector("#pt-submit")
        page.wait_for_selector("#sc-submit")
        page.locator("#sc-widths textarea, #sc-widths input").first.fill("32,48")
        set_number(page, "sc-layers", 1)
        set_number(page, "sc-tokens", 20480)
        page.click("#sc-submit")
        wait_until(lambda: "Queued sweep" in page.inner_text("#pt-status"), 30, "the sweep queued")
        wait_until(lambda: "fitted α" in page.inner_text("#pt-info"), 240, "the sweep's fitted exponent")
        wait_title(page, "pt-scaling", "our α")
        assert not page.locator("#pt-cancel").is_visible()  # a finished job has nothing to cancel
        names = [t.get("type") for t in plot_data(page, "pt-scaling")]
        assert len(names) == 5  # our points, our fit, Kaplan, Chinchilla, Kaplan's slope through our point
        curve = plot_data(page, "pt-curve")
        assert len(curve) == 6 and all(len(t["x"]) >= 2 for t in curve)  # per width: train, held-out, perplexity
        table = page.inner_text("#pt-points")
        assert "scaling-" in table and "-d32" in table and "-d48" in table
        text = page.inner_text("#pt-accordion")
        assert "Kaplan et al. 2020" in text and "Hoffmann et al. 2022" in text
        page.locator("#pt-accordion").scroll_into_view_if_needed()
        screenshot(page, "pretrain-scaling-sweep")
        name = next(line for line in table.split() if line.startswith("scaling-") and line.endswith("-d48"))
        wait_until(lambda: name in _menu_options(page, "model"), 30, f"{name} in the header's model menu")
        browser.close()


def test_depth_sweep_from_the_form(loop):
    """The sweep form over depths: two depths at the parameters of width 32 x 1 layer draw loss
    against depth, each point labelled with its width and counted N, and say there is no fit."""
    svc, server = loop
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url + "?tab=fine-tune")
        page.locator("#pt-accordion").get_by_text("Train from scratch").first.click()
        page.wait_for_selector("#sc-submit")
        page.locator("#pretrain-sweep-axis").get_by_text("depths", exact=True).click()
        page.wait_for_selector("#pretrain-depths")
        wait_until(lambda: not page.locator("#sc-widths").is_visible(), 10, "the widths box hidden")
        page.locator("#pretrain-depths textarea, #pretrain-depths input").first.fill("1,2")
        set_number(page, "pretrain-params", 13408)  # width 32 x 1 layer
        set_number(page, "sc-layers", 1)
        set_number(page, "sc-tokens", 10240)
        page.click("#sc-submit")
        wait_until(lambda: "Queued sweep" in page.inner_text("#pt-status"), 30, "the depth sweep queued")
        status = page.inner_text("#pt-status")
        assert "-L1-d32" in status and "-L2-d24" in status, status
        wait_until(lambda: "2 finished" in page.inner_text("#pt-info"), 240, "both depths trained")
        assert "nothing to fit" in page.inner_text("#pt-info")
        wait_title(page, "pt-scaling", "Loss against depth")
        [pts] = plot_data(page, "pt-scaling")
        assert list(pts["x"]) == [1, 2] and pts["text"][0].startswith("d=32, N=")
        table = page.inner_text("#pt-points")
        assert "-L1-d32" in table and "-L2-d24" in table
        browser.close()
