"""PPO's formulas (model_core.training.ppo) against hand computations on fixed tensors, every number
written out below: GAE (Schulman et al. 2016), the clipped surrogate and its gradient (Schulman et
al. 2017), the clipped value loss, the per-token KL estimators k1/k2/k3 (and that k1 and k3 average
to the exact KL under the policy), the InstructGPT per-token reward r_t = -beta KL_t + score at the
last token, whitening, and Ziegler et al.'s adaptive KL coefficient. Then the rollout's log-probs
(left-padded prompts, position ids counting real tokens) against preference_eval.token_logps'
independent right-padded forward, on a random-weight tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from model_core.training import ppo


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_equals_the_recursion_by_hand():
    # two responses; the second is one token shorter (its last column is padding)
    rewards = _t([[0.0, 0.0, 1.0], [0.5, 2.0, 0.0]])
    values = _t([[0.1, 0.2, 0.3], [0.4, 0.5, 7.0]])  # the 7.0 sits on padding and must not count
    mask = _t([[1, 1, 1], [1, 1, 0]])
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    # row 0: delta_2 = 1 + 0 - 0.3 = 0.7 (the episode ends: V_3 = 0)            A_2 = 0.7
    #        delta_1 = 0 + 0.9 * 0.3 - 0.2 = 0.07,  A_1 = 0.07 + 0.72 * 0.7   = 0.574
    #        delta_0 = 0 + 0.9 * 0.2 - 0.1 = 0.08,  A_0 = 0.08 + 0.72 * 0.574 = 0.49328
    # row 1: delta_1 = 2 + 0 - 0.5 = 1.5 (last real token)                       A_1 = 1.5
    #        delta_0 = 0.5 + 0.9 * 0.5 - 0.4 = 0.55, A_0 = 0.55 + 0.72 * 1.5  = 1.63
    want_adv = _t([[0.49328, 0.574, 0.7], [1.63, 1.5, 0.0]])
    want_ret = _t([[0.49328 + 0.1, 0.574 + 0.2, 0.7 + 0.3], [1.63 + 0.4, 1.5 + 0.5, 0.0]])  # R = A + V
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, want_adv, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, want_ret, atol=1e-12, rtol=0)


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    rewards = _t([[0.2, -0.1, 0.4, 3.0]])
    values = _t([[1.0, 2.0, 0.5, -1.0]])
    mask = torch.ones_like(rewards)
    adv, ret = ppo.gae(rewards, values, mask, 1.0, 1.0)
    # reward to go: 3.5, 3.3, 3.4, 3.0
    torch.testing.assert_close(ret, _t([[3.5, 3.3, 3.4, 3.0]]), atol=1e-12, rtol=0)
    torch.testing.assert_close(adv, _t([[2.5, 1.3, 2.9, 4.0]]), atol=1e-12, rtol=0)
    # lambda = 0: one-step TD errors r_t + V_{t+1} - V_t
    adv0, _ = ppo.gae(rewards, values, mask, 1.0, 0.0)
    torch.testing.assert_close(adv0, _t([[0.2 + 2.0 - 1.0, -0.1 + 0.5 - 2.0, 0.4 - 1.0 - 0.5, 3.0 + 1.0]]),
                               atol=1e-12, rtol=0)


def test_clipped_policy_loss_value_clip_fraction_and_gradient_by_hand():
    ratio = _t([[1.5, 0.5, 1.1, 0.7]])
    logp = ratio.log().requires_grad_(True)
    old = torch.zeros_like(ratio)  # so rho = exp(logp - 0) = ratio
    adv = _t([[2.0, 1.0, -1.0, -3.0]])
    eps = 0.2
    # token: rho A, clip(rho, 0.8, 1.2) A, the min
    #   0:  3.0,  1.2 * 2  =  2.4  -> 2.4  (clipped: no gradient)
    #   1:  0.5,  0.8 * 1  =  0.8  -> 0.5
    #   2: -1.1,  1.1 * -1 = -1.1  -> -1.1 (inside the range)
    #   3: -2.1,  0.8 * -3 = -2.4  -> -2.4 (clipped: no gradient)
    # loss = -(2.4 + 0.5 - 1.1 - 2.4) / 4 = 0.15; clipped on 2 of 4 tokens
    loss, stats = ppo.clipped_policy_loss(logp, old, adv, torch.ones_like(ratio), eps)
    assert loss.item() == pytest.approx(0.15, abs=1e-12)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    loss.backward()
    # d(-rho A / 4) / d logp = -rho A / 4 where unclipped: token 1 -0.5 / 4, token 2 +1.1 / 4
    torch.testing.assert_close(logp.grad, _t([[0.0, -0.125, 0.275, 0.0]]), atol=1e-12, rtol=0)
    # the last token masked out: -(2.4 + 0.5 - 1.1) / 3 = -0.6, 1 of 3 clipped
    loss, stats = ppo.clipped_policy_loss(logp.detach(), old, adv, _t([[1, 1, 1, 0]]), eps)
    assert float(loss) == pytest.approx(-0.6, abs=1e-12) and stats["clip_fraction"] == pytest.approx(1 / 3)


def test_clipped_value_loss_by_hand():
    values, old, returns = _t([[1.0, 0.0, 2.0, 5.0]]), _t([[0.5, 0.5, 2.1, 0.0]]), _t([[2.0, 1.0, 1.0, 0.0]])
    mask = _t([[1, 1, 1, 0]])
    # 0: V - V_old = 0.5 -> 0.2, V_clip = 0.7: (1 - 2)^2 = 1, (0.7 - 2)^2 = 1.69 -> 1.69 (the clipped one)
    # 1: -0.5 -> -0.2, V_clip = 0.3: (0 - 1)^2 = 1, (0.3 - 1)^2 = 0.49 -> 1
    # 2: -0.1 inside, V_clip = 2.0: 1, 1 -> 1
    # loss = 0.5 * (1.69 + 1 + 1) / 3 = 0.615
    loss, stats = ppo.clipped_value_loss(values, old, returns, mask, 0.2)
    assert float(loss) == pytest.approx(0.615, abs=1e-12)
    assert stats["value_clip_fraction"] == pytest.approx(1 / 3)


def test_kl_estimators_by_hand_and_unbiased_under_the_policy():
    logp, ref = _t([math.log(0.5), math.log(0.2)]), _t([math.log(0.25), math.log(0.4)])
    ln2 = math.log(2)
    # r = pi / pi_ref = 2 and 0.5: k1 = log r, k2 = (log r)^2 / 2, k3 = 1/r - 1 + log r
    torch.testing.assert_close(ppo.kl_estimate(logp, ref, "k1"), _t([ln2, -ln2]), atol=1e-12, rtol=0)
    torch.testing.assert_close(ppo.kl_estimate(logp, ref, "k2"), _t([ln2 ** 2 / 2, ln2 ** 2 / 2]), atol=1e-12, rtol=0)
    torch.testing.assert_close(ppo.kl_estimate(logp, ref, "k3"), _t([0.5 - 1 + ln2, 2 - 1 - ln2]), atol=1e-12, rtol=0)
    # over a whole vocabulary, E_pi[k1] = E_pi[k3] = KL(pi || pi_ref) = sum pi log(pi / pi_ref)
    pi, pr = _t([0.5, 0.3, 0.2]), _t([0.25, 0.25, 0.5])
    kl = 0.5 * math.log(2) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4)
    for kind in ("k1", "k3"):
        assert float((pi * ppo.kl_estimate(pi.log(), pr.log(), kind)).sum()) == pytest.approx(kl, abs=1e-12), kind
    assert float(ppo.kl_estimate(_t([-3.0, -0.1]), _t([-0.2, -5.0]), "k3").min()) >= 0
    with pytest.raises(ValueError):
        ppo.kl_estimate(logp, ref, "k4")


def test_token_rewards_put_the_score_on_the_last_real_token():
    scores = _t([3.0, -1.0])
    kl = _t([[0.1, 0.2, 0.3], [0.4, -0.2, 9.0]])  # 9.0 on padding
    mask = _t([[1, 1, 1], [1, 1, 0]])
    # beta 0.5: -0.5 kl_t, plus the score at the last real token
    want = _t([[-0.05, -0.1, -0.15 + 3.0], [-0.2, 0.1 - 1.0, 0.0]])
    torch.testing.assert_close(ppo.token_rewards(scores, kl, mask, 0.5), want, atol=1e-12, rtol=0)


def test_whitening_by_hand():
    # mean 2, population variance 2/3 over the three real entries
    out = ppo.masked_whiten(_t([[1.0, 2.0, 3.0, 100.0]]), _t([[1, 1, 1, 0]]), eps=0.0)
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(out, _t([[-1 / s, 0.0, 1 / s, 0.0]]), atol=1e-12, rtol=0)


def test_adaptive_kl_controller_by_hand():
    fixed = ppo.KLController(0.1)
    assert fixed.update(50.0, 8) == 0.1  # no target: beta stays
    c = ppo.KLController(0.1, target=6.0, horizon=10_000)
    # KL 9: error 9/6 - 1 = 0.5, clipped to 0.2: beta = 0.1 (1 + 0.2 * 8 / 10000)
    assert c.update(9.0, 8) == pytest.approx(0.1 * 1.00016, rel=1e-12)
    # KL 5.4: error -0.1: beta *= 1 - 0.1 * 100 / 10000
    assert c.update(5.4, 100) == pytest.approx(0.1 * 1.00016 * 0.999, rel=1e-12)


def test_rollout_logprobs_equal_an_independent_forward():
    """The left-padded rollout forward (forward_stats) gives each response token the log-prob that
    preference_eval.token_logps' right-padded, unpadded-position forward gives it."""
    from model_core.core.registry import load_uncached
    from model_core.training.preference_eval import token_logps
    from model_core.training.sft_data import ensure_chat_template

    lm = load_uncached("random-llama-tiny", torch.device("cpu"), torch.float32)
    tok, model = lm.tokenizer, lm.model.eval()
    ensure_chat_template(tok)
    prompts = ["What is 2 + 3?", "Rewrite the date 2024-03-15 in the format DD/MM/YYYY."]
    torch.manual_seed(0)
    batch = ppo.rollout(model, tok, [ppo._prompt_ids(tok, p) for p in prompts], 8, 1.0, torch.device("cpu"))
    head = torch.nn.Linear(model.config.hidden_size, 1)
    with torch.no_grad():
        lp, values, ent = ppo.forward_stats(model, head, batch, 1.0, torch.device("cpu"), entropy=True)
    seqs = []
    for i, p in enumerate(prompts):
        m = int(batch["response_mask"][i].sum())
        seqs.append((ppo._prompt_ids(tok, p), batch["response"][i, :m].tolist()))
    want = token_logps(model, seqs)
    for i, w in enumerate(want):
        torch.testing.assert_close(lp[i, :len(w)], w, atol=1e-4, rtol=0)
    assert values.shape == lp.shape and bool((ent >= 0).all())


@pytest.fixture()
def tiny_reward_model(tmp_path, monkeypatch):
    """A reward-model folder for random-llama-tiny (its body, a fresh score head), registered as the
    reward job registers one (lmscope.json kind 'reward')."""
    import json

    from model_core.training import sft
    from model_core.training.preference_eval import init_reward_model

    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path / "data"))
    m, tok, _ = sft.load_trainable("random-llama-tiny", "cpu")
    sft.ensure_chat_template(tok)
    folder = tmp_path / "data" / "models" / "rm-tiny"
    init_reward_model(m, tok, 0).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "lmscope.json").write_text(json.dumps({"kind": "reward", "parent": "random-llama-tiny"}))
    return tmp_path / "data" / "models"


def test_a_cancelled_run_registers_nothing(tiny_reward_model):
    from model_core.training.preference import TrainingCancelled

    rows = []

    def progress(step, total, m):
        rows.append(m)

    stop = lambda: any("loss" in r for r in rows)  # noqa: E731  (after the first PPO step)
    with pytest.raises(TrainingCancelled):
        ppo.train_ppo("random-llama-tiny", "builtin", {"reward_model": "rm-tiny", "max_steps": 5, "eval_examples": 2,
                                                       "output_name": "ppo-cancelled"}, progress=progress,
                      should_stop=stop)
    assert sum("loss" in r for r in rows) == 1
    assert sorted(p.name for p in tiny_reward_model.iterdir()) == ["rm-tiny"]


def test_a_reward_model_on_another_tokenizer_is_one_sentence(tiny_reward_model):
    from model_core.core.errors import SettingsError
    from model_core.core.registry import REGISTRY, convert_gguf, is_ready

    if not is_ready("smollm2-135m-instruct"):  # the check reads the converted folder's tokenizer
        convert_gguf(REGISTRY["smollm2-135m-instruct"])
    with pytest.raises(SettingsError) as e:
        ppo.check_reward_model("smollm2-135m-instruct", "rm-tiny")
    assert str(e.value) == ("The reward model 'rm-tiny' uses another tokenizer than 'smollm2-135m-instruct'; train the "
                            "reward model from 'smollm2-135m-instruct' or a model of the same base.")
    assert ppo.check_reward_model("random-gpt2-tiny", "rm-tiny") == tiny_reward_model / "rm-tiny"  # same byte tokenizer
