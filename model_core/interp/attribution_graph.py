"""Attribution graphs on per-layer transcoders (the method of Anthropic's circuit-tracer): a prompt's
computation toward one output token drawn as features connected by their direct linear effects.

The local replacement model of a prompt, written out here as an explicit function of its inputs
(`FrozenModel.forward`), every layer l in order, T positions, d = d_model:

    a_in[l]  = N_attn[l](resid)          norm with its scale frozen at the real forward's, per position
    z[l]     = P[l] @ V[l](a_in[l])      the attention pattern P [H, T, T] frozen at the real forward's
    resid   += O[l](z[l])                the output projection (bias included)
    m_in[l]  = N_mlp[l](resid)
    pre[l]   = W_enc[l] m_in[l] + b_enc  the transcoder's pre-activations [T, F]: feature nodes' values
    resid   += acts[l] W_dec[l] + b_dec + m_in[l] W_skip[l]^T + err[l]   (W_skip: a skip transcoder's)
    logit    = W_U[target] . N_final(resid[T-1]) + b_U[target]

Its inputs (the leaves) are the token embeddings emb [T, d], every layer's active features acts[l]
[T, F] and error nodes err[l] [T, d] (the real MLP output minus the transcoder's: what the
transcoder misses). With patterns and norm scales frozen it is affine in the leaves, so each
target's value is the sum of its input edges plus a bias that does not depend on them:

    edge(s -> t) = value_s * d t / d value_s     (one backward pass per target, batched)
    bias_t       = t with every leaf zero        (one forward of the frozen model)

At the prompt's own leaves the frozen model computes exactly what the real model computes, so its
logit must equal transformers' logit for the prompt: that and the completeness of every computed
row are checks that can fail, reported with the graph (`Graph.checks`).

Which features get a row: the logit's row first, then repeatedly the features of highest influence
on the logit so far (influence = the logit's row through the row-normalised |adjacency|, summed over
path lengths), `batch` at a time, up to `max_feature_nodes`. Pruning keeps the nodes carrying
`node_threshold` of the influence and the edges carrying `edge_threshold` of it (circuit-tracer's
defaults, 0.8 and 0.98).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from model_core.core.hook_names import act_name
from model_core.core.hooks import Recorder, instrument, recording
from model_core.core.prompts import prompt_ids
from model_core.core.tokenization import byte_safe_decode, describe_tokens
from model_core.interp.features_sae import FeatureError
from model_core.interp.transcoders import Transcoders, check_family, transcode

log = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 64  # measured limits of time and memory on the CPU: docs/PERFORMANCE.md
DEFAULT_MAX_FEATURE_NODES = 512
LOGIT_TOLERANCE = 1e-4  # frozen logit vs transformers' (fp32): relative to max(1, |logit|)
COMPLETENESS_TOLERANCE = 1e-3  # |value - (sum of input edges + bias)| relative to max(1, |value|)


class LinearNorm:
    """A norm as a linear map with its per-position scale frozen: y = g * (x - mean) * s + b
    (LayerNorm) or y = g * x * s (RMSNorm family: Llama's w, Gemma's 1 + w, read off the module by
    feeding it ones). `freeze(x)` computes s from the real input and checks the map reproduces the
    module's own output there."""

    def __init__(self, norm: torch.nn.Module, x: torch.Tensor):
        x = x.float()
        self.centred = isinstance(norm, torch.nn.LayerNorm)
        eps = norm.eps if self.centred else getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        if self.centred:
            self.g = norm.weight.float() if norm.weight is not None else x.new_ones(x.shape[-1])
            self.b = norm.bias.float() if norm.bias is not None else x.new_zeros(x.shape[-1])
            self.s = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)  # [T, 1]
        else:
            ones = torch.ones(1, x.shape[-1], dtype=next(norm.parameters()).dtype, device=x.device)
            with torch.no_grad():
                self.g = norm(ones)[0].float() * math.sqrt(1.0 + eps)
            self.b = x.new_zeros(x.shape[-1])
            self.s = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        with torch.no_grad():
            real = norm(x.to(next(norm.parameters()).dtype)).float()
        err = float((self(x) - real).abs().max())
        if err > 1e-3 * max(1.0, float(real.abs().max())):
            raise FeatureError(f"{type(norm).__name__} is not a LayerNorm or RMSNorm that lmscope can freeze "
                               f"(frozen form off by {err:.3g}).")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        return self.g * x * self.s + self.b


@dataclass
class Leaves:
    emb: torch.Tensor  # [T, d]
    acts: dict[int, torch.Tensor]  # layer -> [T, F] (zero where a feature is off)
    errs: dict[int, torch.Tensor]  # layer -> [T, d]

    def scaled(self, factor: float) -> Leaves:
        return Leaves(self.emb * factor, {k: v * factor for k, v in self.acts.items()},
                      {k: v * factor for k, v in self.errs.items()})

    def requiring_grad(self) -> Leaves:
        def leaf(t):
            return t.detach().clone().requires_grad_(True)
        return Leaves(leaf(self.emb), {k: leaf(v) for k, v in self.acts.items()},
                      {k: leaf(v) for k, v in self.errs.items()})

    def flat(self) -> list[torch.Tensor]:
        return [self.emb, *self.acts.values(), *self.errs.values()]


class FrozenModel:
    """The local replacement model of one prompt (module docstring): built from one real forward."""

    def __init__(self, lm, tc: Transcoders, ids: list[int], target: int):
        check_family(lm)
        tc.check_model(lm)
        missing = sorted(set(range(lm.shape.n_layers)) - set(tc.coders))
        if missing:
            raise FeatureError(f"An attribution graph needs a transcoder for every layer; '{tc.name}' has none for "
                               f"layer(s) {', '.join(map(str, missing[:8]))}.")
        self.lm, self.tc, self.ids, self.target = lm, tc, list(ids), int(target)
        # what the views show for each prompt token and the target, read in context: a token holding
        # part of a character shows as "東·2/3" or its bytes, never as the decode's "\ufffd"
        shown = [r["display"] for r in describe_tokens(lm.tokenizer, self.ids + [self.target])]
        self.display, self.target_display = shown[:-1], shown[-1]
        ad = lm.adapter
        self.L, self.T = lm.shape.n_layers, len(ids)
        rec = Recorder()
        instrument(ad)
        dev = lm.device
        with torch.no_grad(), recording(rec):
            out = lm.model(input_ids=torch.tensor([ids], device=dev), use_cache=False)
        self.model_logit = float(out.logits[0, -1].float()[self.target])
        self.target_prob = float(torch.softmax(out.logits[0, -1].float(), -1)[self.target])
        self.model_top = int(out.logits[0, -1].argmax())
        store = {k: v[0].float() for k, v in rec.store.items() if torch.is_tensor(v)}
        self.resid_pre = {layer: store[act_name("resid_pre", layer)] for layer in range(self.L)}
        self.rope = {layer: rec.rope.get(layer) for layer in range(self.L)}
        self.attn_norm, self.mlp_norm, self.patterns = {}, {}, {}
        acts, errs, self.pre_real = {}, {}, {}
        for layer in range(self.L):
            block = ad.layers[layer]
            pre = store[act_name("resid_pre", layer)]
            self.attn_norm[layer] = LinearNorm(ad.attn_norm(block), pre)
            with torch.no_grad():
                self.patterns[layer] = ad.attend(layer, ad.attn_norm(block)(pre.to(lm.dtype)), self.rope[layer]
                                                 ).probs.float()  # [H, T, T]
            mid = pre + store[act_name("attn_out", layer)]
            self.mlp_norm[layer] = LinearNorm(ad.mlp_norm(block), mid)
            coder = tc.coders[layer]
            with torch.no_grad():
                m_in = ad.mlp_norm(block)(mid.to(lm.dtype)).float()
                enc = coder.encode(m_in.to(coder.device))
                dense = torch.zeros(self.T, coder.num_latents, device=coder.device)
                dense.scatter_(1, enc.top_indices, enc.top_acts.float())
                recon = transcode(coder, m_in)
            acts[layer] = dense
            errs[layer] = store[act_name("mlp_out", layer)] - recon
        final = store[act_name("resid_pre", self.L - 1)] + store[act_name("attn_out", self.L - 1)] \
            + store[act_name("mlp_out", self.L - 1)]
        self.final_norm = LinearNorm(ad.final_norm, final)
        self.leaves = Leaves(store[act_name("resid_pre", 0)], acts, errs)
        u = ad.unembed
        self.w_u = u.weight[self.target].float().detach()
        self.b_u = float(u.bias[self.target]) if getattr(u, "bias", None) is not None else 0.0

    def forward(self, leaves: Leaves, parts: dict | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """leaves -> (the target logit, {layer: transcoder pre-activations [T, F]}). With `parts`, each
        layer's attention output and skip-connection output [T, d] land there as ("attention", l) and
        ("skip", l) (what the residual stream is a sum of, beside the leaves and biases)."""
        ad, lm = self.lm.adapter, self.lm
        resid = leaves.emb
        pres = {}
        for layer in range(self.L):
            block = ad.layers[layer]
            a_in = self.attn_norm[layer](resid)
            _, _, v = ad.qkv(layer, a_in.to(lm.dtype), self.rope[layer])  # v [H_kv, T, dh]
            P = self.patterns[layer]
            v = v.float().repeat_interleave(P.shape[0] // v.shape[0], dim=0)  # [H, T, dh]
            z = torch.matmul(P, v).transpose(0, 1).reshape(self.T, -1)  # [T, H*dh]
            attn = ad.attn_z_module(block)(z.to(lm.dtype)).float()
            resid = resid + attn
            coder = self.tc.coders[layer]
            m_in = self.mlp_norm[layer](resid)
            pres[layer] = coder.encoder(m_in.to(coder.device)).float()  # [T, F]
            out = leaves.acts[layer] @ coder.W_dec.float() + coder.b_dec.float()
            skip = m_in @ coder.W_skip.float().mT if coder.W_skip is not None else None
            if skip is not None:  # the skip connection: linear in the stream, like attention's V path
                out = out + skip
            if parts is not None:
                parts[("attention", layer)] = attn
                parts[("skip", layer)] = skip
            resid = resid + out + leaves.errs[layer]
        logit = self.final_norm(resid)[-1] @ self.w_u + self.b_u
        return logit, pres


@dataclass
class Node:
    id: str
    kind: str  # "feature" | "error" | "embedding" | "logit"
    layer: int | None
    position: int
    feature: int | None = None
    value: float = 0.0  # activation (feature), norm of the vector (error, embedding), logit (logit)
    influence: float = 0.0
    token: str = ""
    label: str = ""  # a feature's automatic label, where its transcoder set has them

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("id", "kind", "layer", "position", "feature", "value", "influence",
                                              "token", "label")}


@dataclass
class Graph:
    prompt_tokens: list[str]
    target: int
    target_token: str
    prompt_ids: list[int]
    target_prob: float  # the real model's probability of the target as the next token
    model: str
    nodes: list[Node]
    edges: list[tuple[str, str, float]]  # (source id, target id, weight)
    checks: dict
    settings: dict
    stats: dict = field(default_factory=dict)
    # what views show (tokenization.describe_tokens' display): prompt_tokens and target_token are each
    # token's own decode, "\ufffd" where a token holds part of a character
    prompt_display: list[str] = field(default_factory=list)
    target_display: str = ""
    prompt_text: str = ""  # the prompt's exact text (byte-safe: a cut character as <0xNN>)

    def to_dict(self) -> dict:
        return {"model": self.model, "prompt_tokens": self.prompt_tokens, "prompt_ids": self.prompt_ids,
                "prompt_display": self.prompt_display or self.prompt_tokens,
                "prompt_text": self.prompt_text or "".join(self.prompt_tokens),
                "target_display": self.target_display or self.target_token,
                "target": self.target, "target_token": self.target_token, "target_prob": self.target_prob,
                "nodes": [n.to_dict() for n in self.nodes],
                "edges": [{"source": s, "target": t, "weight": w} for s, t, w in self.edges],
                "checks": self.checks, "settings": self.settings, "stats": self.stats}


def _rows(fm: FrozenModel, leaves: Leaves, outputs: torch.Tensor, which: list[int], batch: int
          ) -> list[list[torch.Tensor]]:
    """For each index of `outputs` in `which`: d outputs[i] / d leaf for every leaf (batched backward)."""
    inputs = leaves.flat()
    got: list[list[torch.Tensor]] = []
    for b0 in range(0, len(which), batch):
        sel = which[b0:b0 + batch]
        eye = outputs.new_zeros(len(sel), outputs.shape[0])
        eye[torch.arange(len(sel)), torch.tensor(sel)] = 1.0
        grads = torch.autograd.grad(outputs, inputs, grad_outputs=eye, retain_graph=True, is_grads_batched=True,
                                    allow_unused=True)
        for i in range(len(sel)):
            got.append([torch.zeros_like(x) if g is None else g[i] for g, x in zip(grads, inputs)])
    return got


def attribution_graph(lm, tc: Transcoders, prompt, target: int | str | None = None, *, chat: bool = False,
                      max_feature_nodes: int = DEFAULT_MAX_FEATURE_NODES, node_threshold: float = 0.8,
                      edge_threshold: float = 0.98, batch: int = 32) -> Graph:
    """The pruned attribution graph of `prompt` toward `target` (a token id, a string that is one
    token, or None: the model's top next token), with its checks (module docstring)."""
    t0 = time.perf_counter()
    for key, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise FeatureError(f"'{key}' must be a number above 0 and at most 1.")
    if isinstance(max_feature_nodes, bool) or not isinstance(max_feature_nodes, int) or not 1 <= max_feature_nodes <= 20000:
        raise FeatureError("'max_feature_nodes' must be a whole number from 1 to 20,000.")
    ids = prompt_ids(lm, prompt, chat)
    if len(ids) > MAX_PROMPT_TOKENS:
        raise FeatureError(f"Attribution graphs take prompts of up to {MAX_PROMPT_TOKENS} tokens; this one has "
                           f"{len(ids)}: keep the sentence that leads to the token you ask about.")
    target_id = _target_id(lm, ids, target)
    fm = FrozenModel(lm, tc, ids, target_id)
    leaves = fm.leaves.requiring_grad()
    with torch.enable_grad():
        logit, pres = fm.forward(leaves)
        active = [(layer, int(p), int(f)) for layer in range(fm.L)
                  for p, f in (fm.leaves.acts[layer] != 0).nonzero().tolist()]
        # every active feature's pre-activation, then the logit: the rows' outputs
        outputs = torch.cat([pres[layer][fm.leaves.acts[layer] != 0] for layer in range(fm.L)] + [logit[None]])
        n_feat, L, T = len(active), fm.L, fm.T
        # node order: features, errors (layer-major), embeddings, logit
        n_nodes = n_feat + L * T + T + 1
        logit_node = n_nodes - 1
        adj = RowAdjacency(n_nodes, max_feature_nodes + 1)
        values = _source_values(fm, active)
        masks = [fm.leaves.acts[layer] != 0 for layer in range(L)]

        def fill(row_node: int, grads: list[torch.Tensor]) -> None:
            g_emb, g_acts, g_errs = grads[0], grads[1:1 + L], grads[1 + L:]
            feats = torch.cat([g_acts[layer][masks[layer]] for layer in range(L)]) * values  # [n_feat]
            errs = torch.cat([(g_errs[layer] * fm.leaves.errs[layer]).sum(-1) for layer in range(L)])  # [L*T]
            emb = (g_emb * fm.leaves.emb).sum(-1)  # [T]
            adj.add(row_node, torch.cat([feats, errs, emb, emb.new_zeros(1)]))

        fill(logit_node, _rows(fm, leaves, outputs, [n_feat], 1)[0])
        visited: list[int] = []
        todo = set(range(n_feat))
        while todo and len(visited) < max_feature_nodes:
            inf = adj.influence(logit_node, L)
            ranked = sorted(todo, key=lambda i: -inf[i])
            pick = [i for i in ranked[:min(batch, max_feature_nodes - len(visited))] if inf[i] > 0]
            if not pick:
                break
            for i, grads in zip(pick, _rows(fm, leaves, outputs, pick, batch)):
                fill(i, grads)
            visited += pick
            todo -= set(pick)
    with torch.no_grad():
        bias_logit, bias_pres = fm.forward(fm.leaves.scaled(0.0))
        value_logit, value_pres = fm.forward(fm.leaves)
    bias = torch.cat([bias_pres[layer][fm.leaves.acts[layer] != 0] for layer in range(L)] + [bias_logit[None]])
    value = torch.cat([value_pres[layer][fm.leaves.acts[layer] != 0] for layer in range(L)] + [value_logit[None]])
    checks = _checks(fm, adj, visited, bias.cpu(), value.cpu(), n_feat, logit_node)
    inf = adj.influence(logit_node, L)
    nodes, edges = _prune(fm, adj, inf, active, visited, values.cpu(), node_threshold, edge_threshold, n_feat,
                          logit_node)
    checks["intervention"] = _intervention_check(fm, adj, active, visited, logit_node)
    tok = lm.tokenizer
    return Graph(prompt_tokens=[tok.decode([i]) for i in ids], target=target_id, target_token=tok.decode([target_id]),
                 prompt_display=fm.display, target_display=fm.target_display,
                 prompt_text=byte_safe_decode(tok, ids),
                 prompt_ids=list(ids), target_prob=fm.target_prob, model=lm.name,
                 nodes=nodes, edges=edges, checks=checks,
                 settings={"transcoders": tc.name, "max_feature_nodes": max_feature_nodes,
                           "node_threshold": node_threshold, "edge_threshold": edge_threshold},
                 stats={"active_features": n_feat, "rows_computed": len(visited) + 1,
                        "features_reaching_logit": int((inf[:n_feat] > 0).sum()), "seconds":
                        round(time.perf_counter() - t0, 3), "tokens": len(ids)})


def _target_id(lm, ids: list[int], target) -> int:
    if target is None:
        return _top_token(lm, ids)
    if isinstance(target, str):
        enc = lm.tokenizer(target, add_special_tokens=False)["input_ids"]
        if len(enc) != 1:
            raise FeatureError(f"The target {target!r} is {len(enc)} tokens for {lm.name}; give one token.")
        return int(enc[0])
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < lm.shape.vocab_size:
        raise FeatureError(f"The target must be a token id from 0 to {lm.shape.vocab_size - 1}.")
    return int(target)


def _top_token(lm, ids: list[int]) -> int:
    instrument(lm.adapter)
    with torch.no_grad():
        return int(lm.model(input_ids=torch.tensor([ids], device=lm.device), use_cache=False).logits[0, -1].argmax())


def _source_values(fm: FrozenModel, active: list[tuple[int, int, int]]) -> torch.Tensor:
    """Each active feature's activation (the value its outgoing edges are scaled by)."""
    return torch.cat([fm.leaves.acts[layer][fm.leaves.acts[layer] != 0] for layer in range(fm.L)])


class RowAdjacency:
    """The computed rows of the adjacency matrix (target node -> its input edges from every node),
    at most `max_rows` of them: [rows, nodes] float32 on the CPU. A node without a row (an error or
    embedding node, a feature not expanded) is a source only."""

    def __init__(self, n_nodes: int, max_rows: int):
        self.n = n_nodes
        self.data = torch.zeros(max_rows, n_nodes)
        self.row_of: dict[int, int] = {}
        self.nodes: list[int] = []

    def add(self, node: int, edges: torch.Tensor) -> None:
        r = len(self.nodes)
        self.data[r] = edges.detach().float().cpu()
        self.row_of[node] = r
        self.nodes.append(node)

    def row(self, node: int) -> torch.Tensor:
        r = self.row_of.get(node)
        return torch.zeros(self.n) if r is None else self.data[r]

    def normalised(self) -> torch.Tensor:
        W = self.data[:len(self.nodes)].abs()
        return W / W.sum(1, keepdim=True).clamp_min(1e-30)

    def influence(self, logit_node: int, n_layers: int) -> torch.Tensor:
        """Each node's influence on the logit: the logit's row through the row-normalised |A|,
        summed over every path length (acyclic: no path is longer than layers + 2 edges)."""
        W = self.normalised()
        rows = torch.tensor(self.nodes)
        v = torch.zeros(self.n)
        v[logit_node] = 1.0
        total = torch.zeros(self.n)
        for _ in range(n_layers + 2):
            v = v[rows] @ W
            total += v
            if not bool(v.any()):
                break
        return total


def _node_id(kind: str, layer, position: int, feature=None) -> str:
    if kind == "feature":
        return f"F{layer}.{position}.{feature}"
    if kind == "error":
        return f"E{layer}.{position}"
    if kind == "embedding":
        return f"T{position}"
    return "logit"


def _describe(fm: FrozenModel, i: int, active, n_feat: int, values: torch.Tensor, inf: torch.Tensor) -> Node:
    L, T = fm.L, fm.T
    if i < n_feat:
        layer, p, f = active[i]
        label = fm.tc.feature_label(layer, f) if hasattr(fm.tc, "feature_label") else ""
        return Node(_node_id("feature", layer, p, f), "feature", layer, p, f, float(values[i]), float(inf[i]),
                    fm.display[p], label)
    if i < n_feat + L * T:
        layer, p = divmod(i - n_feat, T)
        return Node(_node_id("error", layer, p), "error", layer, p, None, float(fm.leaves.errs[layer][p].norm()),
                    float(inf[i]), fm.display[p])
    if i < n_feat + L * T + T:
        p = i - n_feat - L * T
        return Node(_node_id("embedding", None, p), "embedding", None, p, None, float(fm.leaves.emb[p].norm()),
                    float(inf[i]), fm.display[p])
    return Node("logit", "logit", L, T - 1, None, fm.model_logit, 1.0, fm.target_display)


def _prune(fm: FrozenModel, adj: RowAdjacency, inf, active, visited, values, node_threshold, edge_threshold,
           n_feat, logit_node):
    """Nodes carrying node_threshold of the influence (features with rows and error nodes, ranked
    together; embeddings and the logit always), then the edges among them carrying edge_threshold of
    the edge influence (|normalised weight| x the target's influence, the logit's counted as 1)."""
    L, T = fm.L, fm.T
    candidates = list(visited) + list(range(n_feat, n_feat + L * T))
    candidates.sort(key=lambda i: -float(inf[i]))
    total = float(sum(inf[i] for i in candidates)) or 1.0
    kept, acc = set(), 0.0
    for i in candidates:
        if acc >= node_threshold * total or inf[i] <= 0:
            break
        kept.add(i)
        acc += float(inf[i])
    kept |= set(range(n_feat + L * T, n_feat + L * T + T)) | {logit_node}
    idx = torch.tensor(sorted(kept))
    targets = [i for i in idx.tolist() if i in adj.row_of]
    W = adj.normalised()[[adj.row_of[t] for t in targets]][:, idx]  # [targets, kept]
    weight = torch.tensor([float(inf[t]) + (1.0 if t == logit_node else 0.0) for t in targets])
    sub = W * weight[:, None]
    order = torch.argsort(sub.flatten(), descending=True)
    scores = sub.flatten()[order]
    n_keep = int((torch.cumsum(scores, 0) < edge_threshold * (float(scores.sum()) or 1.0)).sum()) + 1
    edges, used = [], {logit_node}
    for k, flat in enumerate(order[:n_keep].tolist()):
        if float(scores[k]) <= 0:
            break
        ti, si = divmod(flat, len(idx))
        t, s = targets[ti], int(idx[si])
        used |= {t, s}
        edges.append((t, s))
    order_nodes = sorted(used)
    nodes = [_describe(fm, i, active, n_feat, values, inf) for i in order_nodes]
    ids = {i: n.id for i, n in zip(order_nodes, nodes)}
    return nodes, [(ids[s], ids[t], float(adj.row(t)[s])) for t, s in edges]


def _checks(fm: FrozenModel, adj: RowAdjacency, visited, bias, value, n_feat, logit_node) -> dict:
    """The checks reported with the graph; each can fail (see the module docstring)."""
    logit_diff = abs(float(value[n_feat]) - fm.model_logit)
    rows = [logit_node] + list(visited)
    outs = [n_feat] + list(visited)  # a feature's output index is its node index
    residual = torch.tensor([float(value[o] - bias[o] - adj.row(r).sum()) for r, o in zip(rows, outs)])
    scale = torch.tensor([max(1.0, abs(float(value[o]))) for o in outs])
    worst = float((residual.abs() / scale).max())
    real_acts = torch.cat([fm.leaves.acts[layer][fm.leaves.acts[layer] != 0] for layer in range(fm.L)]).cpu()
    pre_diff = float((value[:n_feat] - real_acts).abs().max()) if n_feat else 0.0
    return {
        "logit": {"frozen": float(value[n_feat]), "transformers": fm.model_logit, "abs_diff": logit_diff,
                  "tolerance": LOGIT_TOLERANCE * max(1.0, abs(fm.model_logit)),
                  "ok": logit_diff <= LOGIT_TOLERANCE * max(1.0, abs(fm.model_logit)),
                  "what": "the frozen replacement model's target logit at the prompt's own inputs against "
                          "transformers' logit for the prompt"},
        "completeness": {"rows": len(rows), "max_relative_residual": worst, "tolerance": COMPLETENESS_TOLERANCE,
                         "ok": worst <= COMPLETENESS_TOLERANCE,
                         "what": "each computed node's value minus its bias and the sum of its input edges"},
        "pre_activations": {"max_abs_diff": pre_diff, "ok": pre_diff <= 1e-3 * max(1.0, float(real_acts.abs().max()))
                            if n_feat else True,
                            "what": "each active feature's pre-activation in the frozen model against the "
                                    "transcoder's on the real MLP input"},
    }


def _intervention_check(fm: FrozenModel, adj: RowAdjacency, active, visited, logit_node) -> dict | None:
    """Ablate the feature with the largest direct edge to the logit: in the frozen model the logit
    moves by minus that edge; the real model's change (not frozen) is shown beside it."""
    logit_row = adj.row(logit_node)
    direct = [(abs(float(logit_row[i])), i) for i in visited if float(logit_row[i]) != 0]
    if not direct:
        return None
    _, i = max(direct)
    layer, p, f = active[i]
    ablated = fm.leaves.scaled(1.0)
    ablated.acts[layer] = ablated.acts[layer].clone()
    ablated.acts[layer][p, f] = 0.0
    with torch.no_grad():
        base, _ = fm.forward(fm.leaves)
        changed, _ = fm.forward(ablated)
    frozen_change = float(changed - base)
    predicted = -float(logit_row[i])
    real_change = real_ablation_change(fm, layer, p, f)
    tol = COMPLETENESS_TOLERANCE * max(1.0, abs(predicted))
    return {"node": _node_id("feature", layer, p, f), "frozen_change": frozen_change, "edge_predicted": predicted,
            "abs_diff": abs(frozen_change - predicted), "tolerance": tol,
            "ok": abs(frozen_change - predicted) <= tol, "real_model_change": real_change,
            "what": "ablating the node in the frozen model moves the target logit by minus its edge; the real "
                    "model (attention and other features free) moves by real_model_change"}


def real_ablation_change(fm: FrozenModel, layer: int, position: int, feature: int) -> float:
    """The real model's target logit with one transcoder feature's output taken out of layer's MLP
    output at one position, minus the clean logit."""
    coder = fm.tc.coders[layer]
    act = float(fm.leaves.acts[layer][position, feature])
    delta = (act * coder.W_dec[feature].float()).to(fm.lm.dtype)

    def edit(name, y):
        out = y.clone()
        out[:, position] -= delta.to(y.device)
        return out

    with torch.no_grad(), recording(Recorder(capture=False, edits={act_name("mlp_out", layer): edit})):
        logits = fm.lm.model(input_ids=torch.tensor([fm.ids], device=fm.lm.device), use_cache=False).logits
    return float(logits[0, -1].float()[fm.target]) - fm.model_logit
