"""Chapters of the decoder textbook that one loaded model cannot show by itself, computed rather
than drawn: on tiny random-weight models built from transformers' own config classes (mechanics,
not learned behaviour: every result carries RANDOM) or from closed formulas with worked numbers.

(a) Attention variants and the KV cache: MHA, GQA and MQA (Llama) and MLA (DeepSeek-V2) at one
    width; KV bytes per token by formula next to the bytes of the real cache after a forward.
(b) Norms: LayerNorm vs RMSNorm on the same vector; pre-norm vs post-norm wiring of the same random
    layers and the residual norm each produces layer by layer.
(c) Position schemes: sinusoidal, RoPE and ALiBi, the d = 4 worked example at positions 0-3, and how
    each makes a score depend on distance.
(d) Mixture of experts: a tiny random Mixtral's router probabilities, the experts each token goes
    to, and the load balance with its auxiliary loss.

Every hand computation here has a reference it is compared with: the model's own forward (cache
tensors, hidden states, router outputs, aux loss, captured with hooks) or a transformers /
torch function (LayerNorm, RMSNorm, Llama's rotary embedding, BLOOM's ALiBi, DistilBERT's
sinusoidal table). tests/reference/test_chapters.py checks them. Pure PyTorch + transformers; no gradio.
"""

from __future__ import annotations

import functools
import math
import threading

import torch
import torch.nn.functional as F

from model_core.core.errors import PromptError

RANDOM = "random weights (seed 0), never trained"
MAX_TOKENS = 64  # prompts are cut to this many byte tokens for the random models
_LOCK = threading.Lock()  # temporary hooks on shared chapter models: one call at a time


def byte_ids(prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The prompt as the random models' byte tokens (BOS 256 first), at most max_tokens."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptError("Type a prompt first.")
    return ([256] + list(prompt.encode("utf-8")))[:max_tokens]


def _seeded(config, attn_implementation: str = "eager"):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 dtype=torch.float32)
    model.eval()
    model.requires_grad_(False)
    return model


def cache_bytes(cache) -> tuple[int, int]:
    """(bytes of every key/value tensor the cache holds, tokens held), read off the tensors."""
    total, tokens = 0, 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if torch.is_tensor(t) and t.numel():
                total += t.numel() * t.element_size()
                tokens = max(tokens, int(t.shape[-2]))
    return total, tokens


# ---------------------------------------------------------------------------------------------
# (a) Attention variants and the KV cache

WIDTH = dict(d_model=256, n_heads=8, head_dim=32, n_layers=2)
KV_HEADS = {"MHA": 8, "GQA": 2, "MQA": 1}
MLA = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
VARIANTS = ("MHA", "GQA", "MQA", "MLA")


def variant_config(kind: str):
    """The same width (d_model 256, 8 query heads, 2 layers) in each attention variant, from
    transformers' own config classes: LlamaConfig for MHA/GQA/MQA, DeepseekV2Config for MLA."""
    from transformers import DeepseekV2Config, LlamaConfig

    w = WIDTH
    common = dict(hidden_size=w["d_model"], num_attention_heads=w["n_heads"], num_hidden_layers=w["n_layers"],
                  intermediate_size=512, vocab_size=258, max_position_embeddings=512, bos_token_id=256,
                  eos_token_id=257)
    if kind in KV_HEADS:
        return LlamaConfig(**common, num_key_value_heads=KV_HEADS[kind], head_dim=w["head_dim"])
    if kind == "MLA":
        # q_lora_rank None: a plain query projection; first_k_dense_replace = layers: dense MLPs only
        return DeepseekV2Config(**common, num_key_value_heads=w["n_heads"], q_lora_rank=None,
                                first_k_dense_replace=w["n_layers"], n_routed_experts=4, num_experts_per_tok=2,
                                n_shared_experts=1, moe_intermediate_size=64, **MLA)
    raise PromptError(f"Attention variant must be one of {', '.join(VARIANTS)}.")


@functools.cache
def variant_model(kind: str):
    return _seeded(variant_config(kind))


def kv_formula(kind: str, config, bytes_per_value: int = 4) -> dict:
    """KV-cache bytes per token.
    MHA / GQA / MQA: 2 (K and V) x layers x kv_heads x head_dim x bytes.
    MLA: layers x (kv_lora_rank + qk_rope_head_dim) x bytes: one compressed latent that both K and
    V are expanded from, plus one shared RoPE key per token (what DeepSeek-V2 caches)."""
    L = config.num_hidden_layers
    b = bytes_per_value
    if kind == "MLA":
        r, rope = config.kv_lora_rank, config.qk_rope_head_dim
        return {"bytes_per_token": L * (r + rope) * b,
                "expression": f"{L} layers × ({r} latent + {rope} RoPE key) × {b} B"}
    kv, dh = config.num_key_value_heads, config.head_dim
    return {"bytes_per_token": 2 * L * kv * dh * b,
            "expression": f"2 × {L} layers × {kv} K/V heads × {dh} head_dim × {b} B"}


def attention_variants(token_ids: list[int]) -> dict:
    """Each variant's real forward over the tokens with use_cache=True: the cache's measured bytes
    per token next to the formula, the attention parameters per layer, and layer 0's patterns."""
    ids = torch.tensor([list(token_ids)])
    T = ids.shape[1]
    rows, patterns = [], {}
    for kind in VARIANTS:
        model = variant_model(kind)
        cfg = model.config
        with torch.inference_mode():
            out = model(ids, use_cache=True, output_attentions=True)
        measured, held = cache_bytes(out.past_key_values)
        bpv = next(model.parameters()).element_size()
        f = kv_formula(kind, cfg, bpv)
        attn = model.model.layers[0].self_attn
        rows.append({
            "variant": kind, "config": type(cfg).__name__, "query heads": cfg.num_attention_heads,
            "cached per layer and token": (f"latent {cfg.kv_lora_rank} + RoPE key {cfg.qk_rope_head_dim}"
                                           if kind == "MLA" else
                                           f"{cfg.num_key_value_heads} K + {cfg.num_key_value_heads} V heads × "
                                           f"{cfg.head_dim}"),
            "attention params / layer": sum(p.numel() for p in attn.parameters()),
            "formula B/token": f["bytes_per_token"], "formula": f["expression"],
            "measured B/token": measured / held, "measured total B": measured, "tokens cached": held,
            "16-bit B/token": kv_formula(kind, cfg, 2)["bytes_per_token"],
        })
        patterns[kind] = out.attentions[0][0].float()  # [H, T, T]
    mha = rows[0]["formula B/token"]
    for r in rows:
        r["vs MHA"] = f"{r['formula B/token'] / mha:.3g}×"
    return {"rows": rows, "patterns": patterns, "tokens": T, "note": RANDOM}


# ---------------------------------------------------------------------------------------------
# (b) Norms


def norm_compare(x: torch.Tensor, eps: float = 1e-5) -> dict:
    """LayerNorm and RMSNorm (unit gain, no bias) of the same vector, by hand and by torch's own
    functions. RMSNorm does not centre: for a vector with mean 0 the two agree."""
    x = x.detach().float().cpu().flatten()
    d = x.numel()
    mean, var = float(x.mean()), float(x.var(unbiased=False))
    rms = math.sqrt(float(x.pow(2).mean()))
    ln = (x - mean) / math.sqrt(var + eps)
    rn = x / math.sqrt(rms ** 2 + eps)
    ref_ln = F.layer_norm(x, (d,), eps=eps)
    ref_rn = F.rms_norm(x, (d,), eps=eps)
    centred = x - mean
    return {"x": x, "mean": mean, "std": math.sqrt(var), "rms": rms, "eps": eps, "layernorm": ln, "rmsnorm": rn,
            "ref_layernorm": ref_ln, "ref_rmsnorm": ref_rn,
            "max_ln_vs_rms": float((ln - rn).abs().max()),
            # rms^2 = var + mean^2: the two differ by how far the vector sits from zero on average
            "identity": (rms ** 2, var + mean ** 2),
            "centred_agree": float((F.layer_norm(centred, (d,), eps=eps) - F.rms_norm(centred, (d,), eps=eps))
                                   .abs().max())}


GROWTH = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_hidden_layers=24,
              intermediate_size=256, vocab_size=258, max_position_embeddings=512, bos_token_id=256,
              eos_token_id=257)


@functools.cache
def growth_model():
    from transformers import LlamaConfig

    return _seeded(LlamaConfig(**GROWTH), attn_implementation="sdpa")


def residual_growth(token_ids: list[int]) -> dict:
    """The same random layers wired two ways, residual norm ||x_l|| (mean over tokens) after each:
    pre-norm  x <- x + attn(norm1(x)); x <- x + mlp(norm2(x))      (Llama, GPT-2: this model's own)
    post-norm x <- norm1(x + attn(x)); x <- norm2(x + mlp(x))      (the original Transformer)
    The pre-norm wiring is checked against the model's own forward (output_hidden_states)."""
    model = growth_model()
    inner = model.model
    ids = torch.tensor([list(token_ids)])
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
        x = inner.embed_tokens(ids)
        pe = inner.rotary_emb(x, torch.arange(ids.shape[1])[None])
        pre, post = [x], [x]
        xp, xq = x, x
        for lay in inner.layers:
            # attention_mask None: transformers' SDPA path is then causal by itself
            xp = xp + lay.self_attn(lay.input_layernorm(xp), attention_mask=None, position_embeddings=pe)[0]
            xp = xp + lay.mlp(lay.post_attention_layernorm(xp))
            pre.append(xp)
            h = lay.input_layernorm(xq + lay.self_attn(xq, attention_mask=None, position_embeddings=pe)[0])
            xq = lay.post_attention_layernorm(h + lay.mlp(h))
            post.append(xq)
    norms = lambda hs: [float(h[0].norm(dim=-1).mean()) for h in hs]  # noqa: E731
    # hidden_states[l] is the input of layer l (the last one is after the final norm): compare 0..L-1
    own = out.hidden_states[:-1]
    return {"pre": norms(pre), "post": norms(post), "sqrt_d": math.sqrt(GROWTH["hidden_size"]),
            "layers": GROWTH["num_hidden_layers"], "d_model": GROWTH["hidden_size"],
            "wiring_check": (torch.stack([h[0] for h in pre[:-1]]), torch.stack([h[0] for h in own])),
            "note": RANDOM}


# ---------------------------------------------------------------------------------------------
# (c) Position schemes


def sinusoidal(n_positions: int, d: int, base: float = 10000.0) -> torch.Tensor:
    from model_core.anatomy.walkthrough import sinusoidal_encoding

    return sinusoidal_encoding(n_positions, d, base)


def rope_inv_freq(d: int, base: float = 10000.0) -> torch.Tensor:
    """theta_i = base^(-2i/d), i = 0 .. d/2 - 1 (float64)."""
    return base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


def rope_worked(q=(1.0, 2.0, 3.0, 4.0), n_positions: int = 4, base: float = 10000.0) -> dict:
    """The d = 4 worked example: the angles p·theta_i of both pairs at positions 0..n-1 and the
    vector q rotated at each position, in both pairings:
    rotate_half (Hugging Face Llama): pairs (q0, q2) and (q1, q3);
    adjacent (the RoFormer paper): pairs (q0, q1) and (q2, q3)."""
    q = torch.tensor(q, dtype=torch.float64)
    d = q.numel()
    inv = rope_inv_freq(d, base)
    half = d // 2
    rows = []
    for p in range(n_positions):
        ang = p * inv
        c, s = torch.cos(ang), torch.sin(ang)
        a, b = q[:half], q[half:]
        rh = torch.cat([a * c - b * s, b * c + a * s])
        e, o = q[0::2], q[1::2]
        adj = torch.stack([e * c - o * s, o * c + e * s], dim=1).flatten()
        rows.append({"position": p, "angles": ang, "cos": c, "sin": s, "rotate_half": rh, "adjacent": adj})
    return {"q": q, "theta": inv, "rows": rows, "base": base}


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. 2022): for n a power of two, m_h = 2^(-8h/n), h = 1..n;
    otherwise the closest power of two's slopes, then every other slope of twice as many heads."""
    def pow2(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]
    if n_heads < 1:
        raise PromptError("ALiBi needs at least one head.")
    if math.log2(n_heads).is_integer():
        s = pow2(n_heads)
    else:
        p = 2 ** math.floor(math.log2(n_heads))
        s = pow2(p) + pow2(2 * p)[0::2][: n_heads - p]
    return torch.tensor(s, dtype=torch.float64)


def alibi_bias(n_positions: int, n_heads: int) -> torch.Tensor:
    """[heads, T, T]: -m_h (i - j) added to query i's score for key j <= i; -inf above (causal)."""
    m = alibi_slopes(n_heads)
    i = torch.arange(n_positions)[:, None]
    j = torch.arange(n_positions)[None, :]
    dist = (i - j).to(torch.float64)
    bias = -m[:, None, None] * dist[None] + 0.0  # + 0.0: no "-0" on the diagonal
    return bias.masked_fill((j > i)[None], float("-inf"))


def position_scores(max_distance: int = 128, d: int = 64, n_heads: int = 8, base: float = 10000.0) -> dict:
    """How each scheme makes a score depend on the distance k between two tokens:
    sinusoidal: PE_p · PE_(p+k) / (d/2) (added to the input, it reaches the score only through W_q, W_k);
    RoPE: (R_p q)·(R_(p+k) q) for q = all ones, = sum_i 2 cos(k theta_i), divided by d;
    ALiBi: the bias -m_h k each head adds to its score."""
    k = torch.arange(max_distance + 1, dtype=torch.float64)
    inv = rope_inv_freq(d, base)
    rope = (2 * torch.cos(k[:, None] * inv[None, :])).sum(-1) / d
    pe = sinusoidal(max_distance + 1, d, base).double()
    sin_dot = (pe[0][None, :] * pe).sum(-1) / (d / 2)
    return {"distance": k, "rope": rope, "sinusoidal": sin_dot,
            "alibi": -alibi_slopes(n_heads)[:, None] * k[None, :], "d": d, "n_heads": n_heads}


def rope_scaling(d: int = 64, base: float = 10000.0, factor: float = 4.0, original_context: int = 2048) -> dict:
    """theta_i of plain RoPE and of two ways to stretch it to a `factor` times longer context, from
    transformers' own RoPE init functions (ROPE_INIT_FUNCTIONS, on a LlamaConfig of head_dim d):
    linear (position interpolation) divides every frequency by the factor; YaRN leaves the fast
    pairs (many turns within the original context) alone, divides the slow ones by the factor and
    blends in between, and also scales the attention logits (attention_factor)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    out = {"default": rope_inv_freq(d, base).float(), "factor": factor, "original_context": original_context, "d": d}
    for kind in ("linear", "yarn"):
        params = {"rope_type": kind, "factor": factor, "rope_theta": base}
        if kind == "yarn":
            params["original_max_position_embeddings"] = original_context
        cfg = LlamaConfig(hidden_size=d, num_attention_heads=1, head_dim=d,
                          max_position_embeddings=int(original_context * factor), rope_parameters=params)
        inv, attention_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        out[kind] = inv.float()
        out[f"{kind}_attention_factor"] = float(attention_factor)
    # turns each pair makes over the original context: > 1 means the pair "sees" a full period
    out["turns_in_context"] = out["default"] * original_context / (2 * math.pi)
    return out


# ---------------------------------------------------------------------------------------------
# (d) Mixture of experts

MOE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, num_local_experts=8, num_experts_per_tok=2, vocab_size=258, max_position_embeddings=512,
           bos_token_id=256, eos_token_id=257, output_router_logits=True, router_aux_loss_coef=0.02)


@functools.cache
def moe_model():
    from transformers import MixtralConfig

    return _seeded(MixtralConfig(**MOE), attn_implementation="sdpa")


def _aux_loss(probs_by_layer: list[torch.Tensor], top_k: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Switch-Transformer balance loss as Mixtral trains with it: E · sum_e f_e · P_e over all
    layers' tokens, f_e = share of top-k slots that went to expert e (sums to k), P_e = mean
    router probability of e. Perfect balance gives k."""
    E = probs_by_layer[0].shape[-1]
    probs = torch.cat(probs_by_layer)
    chosen = probs.topk(top_k, dim=-1).indices
    f = torch.zeros(E).scatter_add_(0, chosen.flatten(), torch.ones(chosen.numel())) / probs.shape[0]
    P = probs.mean(0)
    return float(E * (f * P).sum()), f, P


def moe_routing(token_ids: list[int], layer: int = 0, model=None) -> dict:
    """The router of one MoE layer, by hand from the input its MoE block received (captured):
    logits = W_r x, probabilities = softmax, the top-k experts and their renormalised weights.
    Next to it the router's own outputs (captured from its forward), the load per expert and the
    balance loss by hand and as the model returns it (aux_loss)."""
    model = model or moe_model()
    cfg = model.config
    layers = model.model.layers
    if not 0 <= layer < len(layers):
        raise PromptError(f"Layer must be between 0 and {len(layers) - 1}.")
    k = cfg.num_experts_per_tok
    seen: dict[int, dict] = {}
    handles = []
    for i, lay in enumerate(layers):
        moe = lay.mlp
        handles.append(moe.register_forward_pre_hook(
            lambda m, a, i=i: seen.setdefault(i, {}).__setitem__("x", a[0].detach().reshape(-1, a[0].shape[-1]))))
        handles.append(moe.gate.register_forward_hook(
            lambda m, a, o, i=i: seen.setdefault(i, {}).update(logits=o[0].detach(), weights=o[1].detach(),
                                                                  indices=o[2].detach())))
    ids = torch.tensor([list(token_ids)])
    try:
        with _LOCK, torch.inference_mode():
            out = model(ids, output_router_logits=True)
    finally:
        for h in handles:
            h.remove()
    probs_all = []
    for i in range(len(layers)):
        w = layers[i].mlp.gate.weight
        probs_all.append(torch.softmax((seen[i]["x"] @ w.T).float(), dim=-1))
    aux, f_all, P_all = _aux_loss(probs_all, k)
    cap = seen[layer]
    w = layers[layer].mlp.gate.weight
    logits = cap["x"] @ w.T
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    E = probs.shape[-1]
    chosen = top.indices
    load = torch.zeros(E).scatter_add_(0, chosen.flatten(), torch.ones(chosen.numel())) / chosen.shape[0]
    return {"layer": layer, "n_layers": len(layers), "n_experts": E, "top_k": k, "tokens": len(token_ids),
            "logits": logits.float(), "probs": probs, "chosen": chosen, "weights": weights,
            "captured_logits": cap["logits"].float(), "captured_indices": cap["indices"],
            "captured_weights": cap["weights"].float(),
            "load": load, "mean_prob": probs.mean(0), "aux_loss": aux, "aux_loss_model": float(out.aux_loss),
            "load_all_layers": f_all, "mean_prob_all_layers": P_all,
            "same_choice": int(sum(set(a.tolist()) == set(b.tolist())
                                   for a, b in zip(chosen, cap["indices"]))),
            "note": RANDOM}
