"""Held-out evaluation of preference training, usable on any registered model too: log-probabilities
of completions from a plain forward pass (tokenised as TRL does), the DPO view (implicit reward
against a reference), reward models (built, loaded, scored) and verifiable tasks. Re-exported by
model_core.training.preference.

  preference_eval   chosen-vs-rejected accuracy and mean margin of the policy's implicit reward
                    against a reference, and of the policy's own summed log-probs
  reward_eval       the same under a reward model's scores; reward_scores for typed responses
  task_eval         mean verifiable reward of greedy answers
  token_logratios   log pi(y_t | ...) - log pi_ref(y_t | ...) per completion token: which tokens
                    training pushed up or down; they sum to the sequence log-ratio
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch

from model_core.core import paths
from model_core.training.preference_data import PreferencePair, Task, score
from model_core.training.preference_settings import PreferenceError, TrainingCancelled
from model_core.training.sft_data import ensure_chat_template
from model_core.training.sft_eval import greedy_answers

# =============================================================================================
# Tokenisation as TRL does it, and log-probabilities from a plain forward pass

def _unwrap(m):
    """A LoadedModel (registry) or a bare module -> (module, tokenizer or None)."""
    if hasattr(m, "model") and hasattr(m, "tokenizer") and not isinstance(m, torch.nn.Module):
        return m.model, m.tokenizer
    return m, None


def _device(model) -> torch.device:
    return next(model.parameters()).device


def encode_completion(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a user prompt and an assistant answer, split the way TRL's
    DPOTrainer splits them: the chat template renders the prompt with the generation prompt and the
    whole conversation; the completion starts where the two token lists part (for SmolLM2 the
    completion is the answer, <|im_end|> and the newline after it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PreferenceError("The tokenizer has no chat template; call ensure_chat_template first.")
    msgs = [{"role": "user", "content": prompt}]
    p = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    full = list(tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": completion}],
                                              tokenize=True, return_dict=False))
    k = 0
    while k < min(len(p), len(full)) and p[k] == full[k]:
        k += 1
    return full[:k], full[k:]


@torch.no_grad()
def token_logps(model, sequences: list[tuple[list[int], list[int]]], batch_size: int = 8,
                should_stop: Callable[[], bool] | None = None) -> list[torch.Tensor]:
    """log p(completion token t | everything before it) for each (prompt ids, completion ids), from
    one plain forward pass per batch (right padding, fp32 log-softmax): one 1-D tensor per item."""
    model, _ = _unwrap(model)
    dev = _device(model)
    was_training = model.training
    model.eval()
    out: list[torch.Tensor | None] = [None] * len(sequences)
    # similar lengths batched together (less padding); rows right-padded, so positions are the
    # unpadded ones; only the completion positions go through the output head
    order = sorted(range(len(sequences)), key=lambda i: -(len(sequences[i][0]) + len(sequences[i][1])))
    try:
        for i in range(0, len(order), batch_size):
            if should_stop and should_stop():
                raise TrainingCancelled()
            idx = order[i:i + batch_size]
            chunk = [sequences[k] for k in idx]
            T = max(len(p) + len(c) for p, c in chunk)
            ids = torch.zeros((len(chunk), T), dtype=torch.long)
            att = torch.zeros_like(ids)
            for j, (p, c) in enumerate(chunk):
                ids[j, :len(p) + len(c)] = torch.tensor(p + c)
                att[j, :len(p) + len(c)] = 1
            first = min(len(p) for p, _ in chunk) - 1  # earliest position that predicts a completion token
            logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev),
                           logits_to_keep=torch.arange(first, T - 1, device=dev)).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, first + 1:].to(dev).unsqueeze(-1)).squeeze(-1)
            for j, (k, (p, c)) in enumerate(zip(idx, chunk)):
                out[k] = lp[j, len(p) - 1 - first: len(p) + len(c) - 1 - first].cpu()
    finally:
        model.train(was_training)
    return out


def sequence_logps(model, tokenizer, items: list[tuple[str, str]], batch_size: int = 8,
                   should_stop=None) -> list[float]:
    """Summed completion log-probs log pi(y | x) of (prompt, completion) pairs (DPO's log pi)."""
    seqs = [encode_completion(tokenizer, p, c) for p, c in items]
    return [float(t.sum()) for t in token_logps(model, seqs, batch_size, should_stop)]


# =============================================================================================
# What training changed

def token_logratios(policy, reference, prompt: str, completion: str, tokenizer=None) -> dict:
    """Per completion token: log pi(y_t | x, y_<t) - log pi_ref(y_t | x, y_<t) (> 0: training pushed the
    token up). policy / reference: LoadedModels (or modules, with `tokenizer`) sharing a vocabulary.

    Returns {"tokens": [{id, text, display, logp, logp_ref, logratio}], "total": sum of the log-ratios
    (= log pi(y|x) - log pi_ref(y|x)), "logp": log pi(y|x), "logp_ref", "prompt_tokens": n}."""
    from model_core.core.tokenization import describe_tokens

    pm, ptok = _unwrap(policy)
    rm, rtok = _unwrap(reference)
    tok = tokenizer or ptok or rtok
    if tok is None:
        raise PreferenceError("token_logratios needs a tokenizer (pass LoadedModels or tokenizer=).")
    if pm.get_output_embeddings().weight.shape[0] != rm.get_output_embeddings().weight.shape[0]:
        raise PreferenceError("These two models have different vocabularies; compare a trained model with its "
                              "parent.")
    if not getattr(tok, "chat_template", None):
        tok = copy.deepcopy(tok)  # never change a cached tokenizer
        ensure_chat_template(tok)
    p_ids, c_ids = encode_completion(tok, prompt, completion)
    lp = token_logps(pm, [(p_ids, c_ids)])[0]
    lr = token_logps(rm, [(p_ids, c_ids)])[0]
    rows = describe_tokens(tok, c_ids)
    out = []
    for r, a, b in zip(rows, lp.tolist(), lr.tolist()):
        out.append({"id": r["id"], "text": r["text"], "display": r["display"], "logp": a, "logp_ref": b,
                    "logratio": a - b})
    return {"tokens": out, "total": float((lp - lr).sum()), "logp": float(lp.sum()), "logp_ref": float(lr.sum()),
            "prompt_tokens": len(p_ids)}


def _by_kind(kinds: list[str], values: list[float]) -> dict:
    acc: dict[str, list[float]] = {}
    for k, v in zip(kinds, values):
        acc.setdefault(k or "upload", []).append(v)
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


def pair_logps(model, tokenizer, pairs: list[PreferencePair], batch_size: int = 8,
               should_stop=None) -> tuple[list[float], list[float]]:
    """([log pi(chosen | prompt)], [log pi(rejected | prompt)]) summed over completion tokens."""
    lp = sequence_logps(model, tokenizer, [(p.prompt, p.chosen) for p in pairs]
                        + [(p.prompt, p.rejected) for p in pairs], batch_size, should_stop)
    return lp[:len(pairs)], lp[len(pairs):]


def preference_eval(policy, tokenizer, pairs: list[PreferencePair], reference=None, beta: float = 0.1,
                    batch_size: int = 8, should_stop=None, n_show: int = 5) -> dict | None:
    """Held-out chosen-vs-rejected preference of a policy. `reference`: a model, or its pair_logps
    on these pairs (a frozen reference's log-probs never change, so a run computes them once).

    logp_accuracy / logp_margin: share of pairs with log pi(chosen) > log pi(rejected), and the mean
    of their difference (summed completion log-probs; the policy alone, meaningful before training).
    With a reference, the DPO view: implicit reward r = beta * (log pi - log pi_ref); accuracy = share
    with r_chosen > r_rejected (strict, as TRL's rewards/accuracies; 0 when policy = reference),
    margin = mean(r_chosen - r_rejected)."""
    if not pairs:
        return None
    n = len(pairs)
    c, r = pair_logps(policy, tokenizer, pairs, batch_size, should_stop)
    d = [a - b for a, b in zip(c, r)]
    kinds = [p.kind for p in pairs]
    out = {"n": n, "logp_accuracy": sum(x > 0 for x in d) / n, "logp_margin": sum(d) / n,
           "logp_accuracy_by_kind": _by_kind(kinds, [float(x > 0) for x in d])}
    margins = None
    if reference is not None:
        ref_c, ref_r = (reference if isinstance(reference, tuple)
                        else pair_logps(reference, tokenizer, pairs, batch_size, should_stop))
        rc = [beta * (a - b) for a, b in zip(c, ref_c)]
        rr = [beta * (a - b) for a, b in zip(r, ref_r)]
        margins = [a - b for a, b in zip(rc, rr)]
        out.update({"beta": beta, "accuracy": sum(m > 0 for m in margins) / n, "margin": sum(margins) / n,
                    "reward_chosen": sum(rc) / n, "reward_rejected": sum(rr) / n,
                    "accuracy_by_kind": _by_kind(kinds, [float(m > 0) for m in margins])})
    out["examples"] = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "kind": p.kind,
                        "logp_chosen": c[i], "logp_rejected": r[i],
                        **({"margin": margins[i]} if margins is not None else {})}
                       for i, p in enumerate(pairs[:n_show])]
    return out


# ---- reward models -----------------------------------------------------------------------------

def init_reward_model(causal_lm, tokenizer, seed: int = 0):
    """A sequence-classification model (one score) with the causal LM's body and a fresh score head
    (normal(0, initializer_range), seeded), as TRL's RewardTrainer builds one from a checkpoint. The
    score is read at the last token that is not padding."""
    from transformers import AutoModelForSequenceClassification

    cfg = copy.deepcopy(causal_lm.config)
    cfg.num_labels = 1
    cfg.architectures = None
    cfg.pad_token_id = tokenizer.pad_token_id
    cfg.problem_type = "regression"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rm = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    missing, _unexpected = rm.load_state_dict(causal_lm.state_dict(), strict=False)
    missing = [k for k in missing if not k.startswith("score.")]
    if missing:
        raise PreferenceError(f"Cannot build a reward model on this architecture ({len(missing)} body weights do not "
                              "match its causal LM).")
    return rm.to(_device(causal_lm))


def load_reward_model(name: str, device: str | None = None):
    """A registered reward model (or a local reward-model folder) -> (model, tokenizer), eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from model_core.core.registry import resolve_device

    p = paths.finetuned_dir() / name if "/" not in name and not name.startswith(".") else Path(name)
    if not (p / "config.json").exists():
        raise PreferenceError(f"No reward model named '{name}'.")
    info = json.loads((p / "lmscope.json").read_text()) if (p / "lmscope.json").exists() else {}
    if info.get("kind") != "reward":
        raise PreferenceError(f"'{name}' is not a reward model (it was made by {info.get('kind', 'something else')}).")
    dev, _ = resolve_device(device)
    model = AutoModelForSequenceClassification.from_pretrained(str(p), dtype=torch.float32).to(dev).eval()
    tok = AutoTokenizer.from_pretrained(str(p))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _conversation_ids(tokenizer, prompt: str, response: str) -> list[int]:
    """The ids TRL's RewardTrainer scores: the whole conversation through the chat template."""
    msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False))


@torch.no_grad()
def reward_scores(reward_model, tokenizer, items: list[tuple[str, str]], batch_size: int = 8,
                  should_stop=None) -> list[float]:
    """The reward model's score of each (prompt, response); right-padded batches, the score at the
    last real token (the model's own pooling)."""
    model, _ = _unwrap(reward_model)
    dev = _device(model)
    was = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[float] = []
    try:
        for i in range(0, len(items), batch_size):
            if should_stop and should_stop():
                raise TrainingCancelled()
            seqs = [_conversation_ids(tokenizer, p, r) for p, r in items[i:i + batch_size]]
            T = max(map(len, seqs))
            ids = torch.full((len(seqs), T), pad, dtype=torch.long)
            att = torch.zeros_like(ids)
            for j, s in enumerate(seqs):
                ids[j, :len(s)] = torch.tensor(s)
                att[j, :len(s)] = 1
            out += model(input_ids=ids.to(dev), attention_mask=att.to(dev)).logits[:, 0].float().cpu().tolist()
    finally:
        model.train(was)
    return out


def reward_eval(reward_model, tokenizer, pairs: list[PreferencePair], batch_size: int = 8, should_stop=None,
                n_show: int = 5) -> dict | None:
    """Held-out accuracy (share with score(chosen) > score(rejected)) and mean margin of a reward model."""
    if not pairs:
        return None
    s = reward_scores(reward_model, tokenizer, [(p.prompt, p.chosen) for p in pairs]
                      + [(p.prompt, p.rejected) for p in pairs], batch_size, should_stop)
    n = len(pairs)
    m = [a - b for a, b in zip(s[:n], s[n:])]
    return {"n": n, "accuracy": sum(x > 0 for x in m) / n, "margin": sum(m) / n,
            "score_chosen": sum(s[:n]) / n, "score_rejected": sum(s[n:]) / n,
            "accuracy_by_kind": _by_kind([p.kind for p in pairs], [float(x > 0) for x in m]),
            "examples": [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "kind": p.kind,
                          "score_chosen": s[i], "score_rejected": s[n + i]} for i, p in enumerate(pairs[:n_show])]}


# ---- verifiable tasks -------------------------------------------------------------------------------

def task_eval(model, tokenizer, tasks: list[Task], max_new_tokens: int = 16, should_stop=None,
              n_show: int = 5) -> dict | None:
    """Mean verifiable reward of greedy answers to held-out prompts (the same verifiers GRPO trains with)."""
    if not tasks:
        return None
    m, _ = _unwrap(model)
    got = greedy_answers(m, tokenizer, [[{"role": "user", "content": t.prompt}] for t in tasks],
                             max_new_tokens, should_stop=should_stop)
    rewards = [score(g, t.answer, t.verifier) for g, t in zip(got, tasks)]
    lengths = [len(tokenizer(g, add_special_tokens=False)["input_ids"]) for g in got]
    return {"n": len(tasks), "mean_reward": sum(rewards) / len(rewards), "mean_length": sum(lengths) / len(lengths),
            "reward_by_kind": _by_kind([t.kind for t in tasks], rewards), "max_new_tokens": max_new_tokens,
            "examples": [{"prompt": t.prompt, "answer": t.answer, "verifier": t.verifier, "completion": g,
                          "reward": r} for t, g, r in list(zip(tasks, got, rewards))[:n_show]]}
