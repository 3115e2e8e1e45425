"""After SFT, in the Fine-tune tab: a self-contained accordion that submits reward-model, DPO, GRPO and
PPO jobs (tasks/preference_job.py), follows the selected run live (curves, GRPO's latest group of
completions with rewards and advantages, PPO's latest rollouts token by token coloured by advantage,
tokens/s and ETA, held-out numbers before and after: for PPO the reward model's score beside the task
score), and
shows what a finished run changed inside: the per-token log pi/pi_ref of a completion (checked
against the sequence log-ratio from a plain transformers forward of each model), or a reward
model's score of a typed response.

Jobs go through tasks.jobs like every other kind; owners come from the request (job_owner /
job_viewer). Settings and an uploaded file are checked with the job kind's own validation before
anything is queued, and a bad one is named in one sentence beside the form (app.shared.validation).
Figures: app/tabs/finetune/preference_figures.py.
"""

from __future__ import annotations

import copy
import math
import threading

import gradio as gr

from app.shared import job_views as jf
from app.shared import validation as V
from app.shared.context import (
    Shared,
    default_model,
    endpoint,
    get_model,
    job_owner,
    uploaded_file,
)
from app.tabs.finetune import preference_figures as pf
from model_core.core.errors import LmscopeError
from model_core.training import preference as P
from model_core.training import preference_data as D

REFRESH_S = 2.0
KINDS = (*P.KINDS, "ppo")  # P.KINDS are the TRL kinds; PPO (its own loop) is a job kind too
TASK_KINDS = ("grpo", "ppo")  # prompts with answers (a verifier), not preference pairs
TUNED_KINDS = ("dpo", "grpo", "ppo")  # language models trained against a reference
KIND_CHOICES = [("Reward model (Bradley-Terry score head)", "reward"), ("DPO", "dpo"), ("GRPO (verifiable rewards)", "grpo"),
                (pf.KIND_LABELS["ppo"], "ppo")]
DATASETS = {
    "reward": [("Built-in: dates + style", "builtin"), ("Built-in: dates only", "builtin:date"),
               ("Built-in: style only", "builtin:style"), ("Upload .jsonl (prompt, chosen, rejected)", "upload")],
    "grpo": [("Built-in: arithmetic", "builtin"), ("Built-in: dates", "builtin:date"),
             ("Built-in: arithmetic + dates", "builtin:arithmetic,date"),
             ("Upload .jsonl (prompt, answer)", "upload")],
}
DATASETS["dpo"] = DATASETS["reward"]
DATASETS["ppo"] = DATASETS["grpo"]  # the prompts are scored by the reward model; the answers give the task score
LOSS_TYPE_CHOICES = [
    ("GRPO: A = (r − mean)/std per group; each completion's loss averaged over its own length", "grpo"),
    ("Dr. GRPO: no std scaling of A, no per-sequence length normalisation (a constant instead)", "dr_grpo"),
    ("DAPO: clip-higher ε_high = 0.28 > ε = 0.2, token-level normalisation over the batch", "dapo"),
]
DPO_LOSS_CHOICES = [(text, key) for key, text in P.DPO_LOSS_TYPES.items()]
VERIFIER_CHOICES = [(f"{k}: {v.description}", k) for k, v in D.VERIFIERS.items()]
CHECK_TOLERANCE = {"float32": 1e-3, "other": 5e-2}  # |sum per-token - sequence log-ratio| (nats)


def _base_choices() -> list[tuple[str, str]]:
    from app.shared.context import model_choices

    return model_choices()


def _trained_rows(kinds: tuple[str, ...]) -> list[dict]:
    from model_core.core.registry import list_models

    return [r for r in list_models(include_random=True) if r.get("source") == "finetuned" and r.get("kind") in kinds]


def trained_choices() -> list[tuple[str, str]]:
    """Registered DPO / GRPO / PPO models (language models that have a reference to compare with)."""
    return [(f"{r['name']}  ({r['kind']}, from {r.get('parent') or '?'})", r["name"])
            for r in _trained_rows(TUNED_KINDS)]


def reward_choices() -> list[str]:
    return [r["name"] for r in _trained_rows(("reward",))]


def _records(request=None) -> list[dict]:
    return jf.user_jobs(request, KINDS)


def _choices(recs: list[dict]) -> list[tuple[str, str]]:
    return jf.job_menu(recs, pf.job_label)


def _num(v):
    """An empty box (or 0 where 0 means "default") is the kind's default; anything else goes to the
    kind's settings check as it is (one sentence for a bad value)."""
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    if isinstance(v, float) and math.isfinite(v) and v == int(v) and abs(v) < 2**53:
        return int(v)
    return v


def form_params(kind, model, dataset, verifier, method, beta, loss_type, group_size, steps, lr,
                lora_rank=None, reward_model=None) -> dict:
    """The job's params from the form (only the settings the kind has; the LoRA rank with LoRA only,
    the reward model with PPO only)."""
    p = {"model": model or default_model(), "dataset": dataset or D.BUILTIN, "method": method or None,
         "max_steps": _num(steps) or None, "learning_rate": _num(lr) or None}
    if method == "lora":
        p["lora_rank"] = _num(lora_rank)
    if kind in ("dpo", "grpo", "ppo"):
        p["beta"] = _num(beta)
    if kind == "dpo":
        p["loss_type"] = loss_type or "sigmoid"
    if kind == "grpo":
        p.update(loss_type=loss_type or "grpo", num_generations=_num(group_size),
                 verifier=verifier if dataset == "upload" else None)
    if kind == "ppo":
        p.update(num_generations=_num(group_size), verifier=verifier if dataset == "upload" else None,
                 reward_model=reward_model or None)
    return {k: v for k, v in p.items() if v is not None}


@endpoint
def submit(kind, model, dataset, upload, verifier, method, beta, loss_type, group_size, steps, lr, lora_rank=None,
           reward_model=None, request: gr.Request = None):
    """Check everything (settings, model name, every line of an upload) before queueing; a bad value
    answers one sentence beside the form and leaves the rest of the panel as it was."""
    from tasks import preference_job as pj

    skip = [gr.skip(), gr.skip(), gr.skip()]
    if kind not in KINDS:
        return [*skip, V.show("Choose reward model, DPO, GRPO or PPO.")]
    if kind == "ppo" and not reward_model:
        return [*skip, V.show("PPO needs a reward model: train one with the reward-model kind first, then pick it.")]
    params = form_params(kind, model, dataset, verifier, method, beta, loss_type, group_size, steps, lr, lora_rank,
                         reward_model)
    files = []
    try:
        if dataset == "upload":
            if not upload:
                return [*skip, V.show("Upload a .jsonl dataset, or choose a built-in one.")]
            path = uploaded_file(upload)
            checked = pj.validate_params(kind, params)
            pj.check_dataset(kind, path, checked)  # every malformed line by number; nothing queued
            files = [path]
        else:
            pj.validate_params(kind, params)
        rec = jf.job_store().submit(kind, params, owner=job_owner(request), files=files)
    except (LmscopeError, gr.Error) as e:
        return [*skip, V.show(str(getattr(e, "message", None) or e))]
    return [rec["id"], gr.update(choices=_choices(_records(request)), value=rec["id"]),
            f"Queued job **{rec['id']}**; it will register **{rec['preference']['model_name']}**.", V.clear()]


def _views(rec: dict | None) -> list:
    """status, curves, throughput, groups caption, groups table, held-out table, and PPO's rollouts
    caption, rollout tokens, score-versus-task sentence and held-out examples of one record (N_VIEWS)."""
    if rec is None:
        return [pf.status_markdown(None), pf.curves_figure(None, None), pf.throughput_figure(None),
                pf.groups_caption(None), pf.groups_table(None), pf.eval_table(None, None, None),
                pf.ppo_samples_caption(None), pf.ppo_tokens_figure(None), pf.ppo_gaming_note(None, None),
                pf.ppo_examples_table(None, None)]
    pr = rec.get("preference") or {}
    params = rec.get("params") or {}
    hist = pr.get("history")
    ppo = rec["kind"] == "ppo"
    samples = pf.ppo_samples(pr) if ppo else None
    before, after = (pr.get("before"), pr.get("after")) if ppo else (None, None)
    return [pf.status_markdown(rec), pf.curves_figure(rec["kind"], hist, params.get("beta")),
            pf.throughput_figure(hist), pf.groups_caption(pr.get("groups"), params.get("loss_type")),
            pf.groups_table(pr.get("groups")), pf.eval_table(rec["kind"], pr.get("before"), pr.get("after")),
            pf.ppo_samples_caption(samples), pf.ppo_tokens_figure(samples), pf.ppo_gaming_note(before, after),
            pf.ppo_examples_table(before, after)]


N_VIEWS = 10


def view_signature(rec: dict | None) -> str:
    """What the views of a record depend on: a tick whose record has not changed redraws nothing
    (a finished run's plots stay still instead of being re-sent every two seconds)."""
    if rec is None:
        return ""
    pr = rec.get("preference") or {}
    g = pr.get("groups") if isinstance(pr.get("groups"), dict) else {}
    smp = pf.ppo_samples(pr) or {}
    return "|".join(str(x) for x in (rec["id"], rec["state"], len(pr.get("history") or []),
                                      (rec.get("progress") or {}).get("stage"), g.get("step"), smp.get("step"),
                                      bool(pr.get("after")), rec.get("error")))


@endpoint
def refresh(selected, known, shown=None, request: gr.Request = None):
    """Timer tick: the selected run's views when its record changed; the job menu when its list changed."""
    recs = _records(request)
    choices = _choices(recs)
    selected = selected if isinstance(selected, str) else None
    menu = [gr.skip(), gr.skip()] if jf.menu_unchanged(choices, known) else [choices, gr.update(choices=choices)]
    if not selected:
        if shown == "":
            return [gr.skip()] * (1 + N_VIEWS) + [*menu, gr.skip(), gr.skip()]
        return [jf.progress_html(None), *_views(None), *menu, gr.update(visible=False), ""]
    try:
        rec = jf.selected_job(selected, recs, request)
    except LmscopeError as e:
        return [jf.progress_html(None), f"⚠️ {e}", *[gr.skip()] * (N_VIEWS - 1), *menu, gr.update(visible=False),
                None]
    sig = view_signature(rec)
    live = jf.cancellable(rec)
    if sig == shown:  # nothing new: only a running job's progress line (its ETA) moves
        return [jf.progress_html(rec) if live else gr.skip(), *[gr.skip()] * N_VIEWS, *menu, gr.skip(), gr.skip()]
    return [jf.progress_html(rec), *_views(rec), *menu, gr.update(visible=live), sig]


@endpoint
def cancel(selected, request: gr.Request = None):
    return jf.cancel_job(selected, request)


@endpoint
def job_choices(request: gr.Request = None):
    return gr.update(choices=_choices(_records(request)))


@endpoint
def pick_job(job):
    return jf.picked_job(job)


@endpoint
def kind_changed(kind):
    """The dataset menu, method default and the fields that belong to the kind (the reward-model menu
    with PPO only)."""
    kind = kind if kind in KINDS else "dpo"
    grpo, ppo = kind == "grpo", kind == "ppo"
    s = P.SETTINGS_CLASSES[kind]()
    beta_label = {"grpo": "β: KL penalty to the reference (0 = none)",
                  "ppo": "β: KL penalty coefficient (per-token reward −β·KL to the reference)"}
    return (gr.update(choices=DATASETS[kind], value="builtin"), gr.update(value=s.method),
            gr.update(visible=kind != "reward", value=getattr(s, "beta", None),
                      label=beta_label.get(kind, "β: implicit KL strength (higher: nearer the reference)")),
            gr.update(visible=kind in ("dpo", "grpo"), choices=LOSS_TYPE_CHOICES if grpo else DPO_LOSS_CHOICES,
                      value=getattr(s, "loss_type", None), label="GRPO loss" if grpo else "DPO loss"),
            gr.update(visible=kind in TASK_KINDS, label="Rollouts per prompt" if ppo
                      else "Group size: completions per prompt",
                      **({"value": s.num_generations} if kind in TASK_KINDS else {})),
            gr.update(visible=False), gr.update(visible=False),
            gr.update(value=s.max_steps), gr.update(visible=s.method == "lora"),
            gr.update(visible=ppo, choices=reward_choices()) if ppo else gr.update(visible=False))


@endpoint
def method_changed(method):
    """The LoRA rank belongs to the LoRA method."""
    return gr.update(visible=method == "lora")


@endpoint
def dataset_changed(kind, dataset):
    up = dataset == "upload"
    return gr.update(visible=up), gr.update(visible=up and kind in TASK_KINDS)


# ---- what changed inside ------------------------------------------------------------------------

def default_example(kind: str | None) -> tuple[str, str]:
    """A held-out built-in example: (prompt, chosen) of a preference pair, (prompt, answer) of a task."""
    if kind in TASK_KINDS:
        t = D.builtin_tasks(4, 2, 0).test[0]
        return t.prompt, t.answer
    p = D.builtin_preferences(4, 2, 0).test[0]
    return p.prompt, p.chosen


def _plain_tokenizer(tok):
    from model_core.training import sft

    if getattr(tok, "chat_template", None):
        return tok
    tok = copy.deepcopy(tok)  # never change a cached tokenizer
    sft.ensure_chat_template(tok)
    return tok


def sequence_logratio(policy, reference, prompt: str, completion: str) -> dict:
    """log pi(y|x) - log pi_ref(y|x) from one plain transformers forward of each model over the whole
    conversation (no batching, every position's logits), independent of token_logps: the completion
    is what the chat template adds after the prompt's generation prompt."""
    import torch

    tok = _plain_tokenizer(policy.tokenizer)
    msgs = [{"role": "user", "content": prompt}]
    head = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    full = list(tok.apply_chat_template(msgs + [{"role": "assistant", "content": completion}], tokenize=True,
                                        return_dict=False))
    k = next((i for i, (a, b) in enumerate(zip(head, full)) if a != b), min(len(head), len(full)))
    out = {}
    for name, lm in (("policy", policy), ("reference", reference)):
        dev = next(lm.model.parameters()).device
        ids = torch.tensor([full], device=dev)
        with torch.inference_mode():
            logits = lm.model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        out[name] = float(lp[k - 1:].sum())
    dtype = str(next(policy.model.parameters()).dtype).replace("torch.", "")
    return {"logp": out["policy"], "logp_ref": out["reference"], "sequence_logratio": out["policy"] - out["reference"],
            "completion_tokens": len(full) - k, "dtype": dtype}


def check_logratios(r: dict, seq: dict) -> dict:
    """How far the per-token view is from the independent sequence numbers (max over the three)."""
    diffs = [abs(sum(t["logratio"] for t in r["tokens"]) - seq["sequence_logratio"]),
             abs(r["logp"] - seq["logp"]), abs(r["logp_ref"] - seq["logp_ref"])]
    if len(r["tokens"]) != seq["completion_tokens"]:
        diffs.append(math.inf)
    tol = CHECK_TOLERANCE["float32" if seq["dtype"] == "float32" else "other"]
    return {**seq, "max_abs_diff": max(diffs), "tolerance": tol}


@endpoint(model=True)
def what_changed(tuned, reference, prompt, completion, request: gr.Request = None):
    """Per completion token, log pi/pi_ref of the trained model against its parent (or the chosen
    reference), and the check that they sum to the sequence log-ratio."""
    if not isinstance(tuned, str) or tuned not in {v for _, v in trained_choices()}:
        raise gr.Error("Pick a DPO-, GRPO- or PPO-trained model.")
    if not isinstance(completion, str) or not completion.strip():
        raise gr.Error("Type a completion to score.")
    t = get_model(tuned)
    ref_name = reference if isinstance(reference, str) and reference else (t.meta.get("parent") or default_model())
    ref = get_model(ref_name)
    try:
        r = P.token_logratios(t, ref, prompt or "", completion)
    except LmscopeError as e:
        raise gr.Error(str(e)) from None
    check = check_logratios(r, sequence_logratio(t, ref, prompt or "", completion))
    return pf.logratio_headline(r, check, t.name, ref.name), pf.logratio_html(r["tokens"]), pf.logratio_figure(r["tokens"])


@endpoint
def trained_picked(tuned):
    """A picked model: its parent as the reference, and a held-out built-in example of its kind."""
    row = next((r for r in _trained_rows(TUNED_KINDS) if r["name"] == tuned), None)
    if row is None:
        return gr.skip(), gr.skip(), gr.skip()
    prompt, completion = default_example(row.get("kind"))
    return gr.update(value=row.get("parent")) if row.get("parent") else gr.skip(), prompt, completion


@endpoint
def trained_menu():
    return gr.update(choices=trained_choices())


@endpoint
def reward_menu():
    return gr.update(choices=reward_choices())


_REWARD_CACHE: dict = {}
_REWARD_LOCK = threading.Lock()


def _reward_model(name: str):
    """One loaded reward model kept (the last one asked for)."""
    with _REWARD_LOCK:
        if name not in _REWARD_CACHE:
            _REWARD_CACHE.clear()
            _REWARD_CACHE[name] = P.load_reward_model(name)
        return _REWARD_CACHE[name]


@endpoint(model=True)
def score_response(name, prompt, response, request: gr.Request = None):
    if not isinstance(name, str) or name not in reward_choices():  # registered reward models only, never a path
        raise gr.Error("Pick a registered reward model.")
    if not isinstance(response, str) or not response.strip():
        raise gr.Error("Type a response to score.")
    model, tok = _reward_model(name)
    s = P.reward_scores(model, tok, [(prompt or "", response)])[0]
    return (f"Score of this response under **{name}**: **{s:+.4f}** (a Bradley-Terry score: only differences "
            f"between responses to the same prompt mean something; P(A preferred to B) = σ(s_A − s_B)).")


# ---- layout ---------------------------------------------------------------------------------------

def build(shared: Shared) -> None:
    selected = gr.State(None)
    known = gr.State(None)
    prompt0, completion0 = default_example("dpo")
    with gr.Accordion("After SFT: reward models, DPO, GRPO and PPO", open=False, elem_id="pref-accordion"):
        gr.Markdown(
            "Train on preferences instead of demonstrations (TRL's trainers, full or LoRA). A **reward model** learns "
            "to score the chosen answer above the rejected one; **DPO** moves the model itself toward chosen answers, "
            "kept near its starting point (the reference) by β; **GRPO** samples a group of answers per prompt, scores "
            "them with a verifier in plain code and pushes up those better than their group; **PPO** samples answers, "
            "scores them with a reward model you trained here, and pays each token −β·KL to the reference, with a "
            "value head for the advantage. Built-in data: dates "
            "written DD/MM/YYYY and plain versus rambling answers (pairs); arithmetic and dates (verifiable tasks).")
        with gr.Row():
            with gr.Column(scale=1, min_width=300):
                kind = gr.Radio(KIND_CHOICES, value="dpo", label="Kind", elem_id="pref-kind")
                model = gr.Dropdown(_base_choices(), value=default_model(), label="Model (language models, incl. "
                                    "fine-tuned)", elem_id="pref-model")
                ppo_rm = gr.Dropdown(reward_choices(), value=None, label="Reward model (PPO maximises its score)",
                                     info="Registered by the reward-model kind, on the same tokenizer as the model. "
                                          "CLI: lmscope jobs submit ppo --model M --reward-model R",
                                     visible=False, elem_id="pref-ppo-reward-model")
                dataset = gr.Dropdown(DATASETS["dpo"], value="builtin", label="Dataset", elem_id="pref-dataset")
                upload = gr.File(file_types=[".jsonl"], label="JSONL: one object per line", visible=False,
                                 elem_id="pref-upload")
                verifier = gr.Dropdown(VERIFIER_CHOICES, value="number", label="Verifier (for lines that name none)",
                                       visible=False, elem_id="pref-verifier")
                method = gr.Radio(["full", "lora"], value="full", label="Method", elem_id="pref-method")
                beta = gr.Number(P.DPOSettings.beta, label="β: implicit KL strength (higher: nearer the reference)",
                                 elem_id="pref-beta")
                lora_rank = gr.Number(P.DPOSettings.lora_rank, label="LoRA rank (adapter width; LoRA only)",
                                      precision=0, visible=P.DPOSettings.method == "lora", elem_id="pref-lora-rank")
                loss_type = gr.Radio(DPO_LOSS_CHOICES, value=P.DPOSettings.loss_type, label="DPO loss",
                                     elem_id="pref-loss-type")
                group_size = gr.Number(P.GRPOSettings.num_generations, label="Group size: completions per prompt",
                                       precision=0,
                                       visible=False, elem_id="pref-group-size")
                with gr.Row():
                    steps = gr.Number(P.DPOSettings.max_steps, label="Max steps", precision=0,
                                      elem_id="pref-steps")
                    lr = gr.Number(0, label="Learning rate (0: the default per kind and method)", elem_id="pref-lr")
                submit_btn = gr.Button("Start training", variant="primary", elem_id="pref-submit")
                msg = V.field_message("pref-msg")
                status = gr.Markdown(elem_id="pref-status")
            with gr.Column(scale=2):
                with gr.Row():
                    job = gr.Dropdown([], label="Reward / DPO / GRPO / PPO jobs", scale=4, elem_id="pref-job")
                    cancel_btn = gr.Button("Cancel job", variant="stop", scale=1, visible=False,
                                           elem_id="pref-cancel")
                progress = gr.HTML(elem_id="pref-progress")
                info = gr.Markdown(pf.status_markdown(None), elem_id="pref-info")
                curves = gr.Plot(pf.curves_figure(None, None), elem_id="pref-curves")
                tput = gr.Plot(pf.throughput_figure(None), elem_id="pref-throughput")
                gr.Markdown("#### Held-out, before → after training")
                evals = gr.Dataframe(pf.eval_table(None, None, None), interactive=False, wrap=True,
                                     elem_id="pref-eval")
                ppo_note = gr.Markdown(pf.ppo_gaming_note(None, None), elem_id="pref-ppo-gaming")
        groups_note = gr.Markdown(pf.groups_caption(None), elem_id="pref-groups-note")
        groups = gr.Dataframe(pf.groups_table(None), interactive=False, wrap=True, elem_id="pref-groups")
        ppo_caption = gr.Markdown(pf.ppo_samples_caption(None), elem_id="pref-ppo-samples-note")
        ppo_tokens = gr.Plot(pf.ppo_tokens_figure(None), elem_id="pref-ppo-tokens")
        gr.Markdown("#### PPO, held-out examples: reward-model score and task score, before → after")
        ppo_examples = gr.Dataframe(pf.ppo_examples_table(None, None), interactive=False, wrap=True,
                                    elem_id="pref-ppo-examples")

        gr.Markdown("### What changed inside")
        with gr.Row():
            tuned = gr.Dropdown(trained_choices(), label="DPO / GRPO / PPO-trained model", scale=2, elem_id="pref-tuned")
            reference = gr.Dropdown(_base_choices(), value=None, label="Reference π_ref (default: its parent)",
                                    scale=2, elem_id="pref-reference")
        with gr.Row():
            ex_prompt = gr.Textbox(prompt0, label="Prompt", scale=2, elem_id="pref-ex-prompt")
            ex_completion = gr.Textbox(completion0, label="Completion (the assistant's answer)", scale=2,
                                       elem_id="pref-ex-completion")
        inside_btn = gr.Button("Per-token log π/π_ref", variant="primary", elem_id="pref-inside")
        inside_head = gr.Markdown(elem_id="pref-inside-headline")
        inside_tokens = gr.HTML(elem_id="pref-inside-tokens")
        inside_plot = gr.Plot(pf.logratio_figure(None), elem_id="pref-inside-plot")
        gr.Markdown("#### A reward model's score of a response")
        with gr.Row():
            rm = gr.Dropdown(reward_choices(), label="Reward model", scale=1, elem_id="pref-rm")
            rm_prompt = gr.Textbox(prompt0, label="Prompt", scale=2, elem_id="pref-rm-prompt")
            rm_response = gr.Textbox(completion0, label="Response", scale=2, elem_id="pref-rm-response")
        rm_btn = gr.Button("Score", elem_id="pref-rm-score")
        rm_out = gr.Markdown(elem_id="pref-rm-out")
        # the picked DPO / GRPO / PPO run against its base over a corpus
        from app.tabs.finetune import diff_panel

        diff_panel.build(shared, selected, tuned, prefix="pref-diff", button_id="pref-what-changed")

    shared.pickers.extend([(model, "all"), (reference, "all")])  # kept current by app/server/page.py
    kind.change(kind_changed, [kind], [dataset, method, beta, loss_type, group_size, upload, verifier, steps,
                                        lora_rank, ppo_rm])
    method.change(method_changed, [method], [lora_rank])
    dataset.change(dataset_changed, [kind, dataset], [upload, verifier])
    shown = gr.State(None)
    outs = [progress, info, curves, tput, groups_note, groups, evals, ppo_caption, ppo_tokens, ppo_note, ppo_examples,
            known, job, cancel_btn, shown]
    submit_btn.click(submit, [kind, model, dataset, upload, verifier, method, beta, loss_type, group_size, steps, lr,
                              lora_rank, ppo_rm],
                     [selected, job, status, msg])
    job.change(pick_job, [job], [selected])
    job.focus(job_choices, None, [job])
    gr.Timer(REFRESH_S).tick(refresh, [selected, known, shown], outs, show_progress="hidden", queue=False)
    cancel_btn.click(cancel, [selected], [status]).then(refresh, [selected, known], outs)
    tuned.focus(trained_menu, None, [tuned])
    tuned.change(trained_picked, [tuned], [reference, ex_prompt, ex_completion])
    rm.focus(reward_menu, None, [rm])
    ppo_rm.focus(reward_menu, None, [ppo_rm])
    inside_btn.click(what_changed, [tuned, reference, ex_prompt, ex_completion],
                     [inside_head, inside_tokens, inside_plot], concurrency_id="model")
    rm_btn.click(score_response, [rm, rm_prompt, rm_response], [rm_out], concurrency_id="model")
