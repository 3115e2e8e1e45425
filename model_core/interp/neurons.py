"""Neuron and head pages (issue 15 item 9): what one MLP neuron or one attention head does.

Three views of a unit, all from the model itself:

- **Output weights through the unembedding.** A neuron n of layer l adds activation x W_out[n] to
  the residual stream (W_out[n]: the down projection's column n, read off the module by feeding it
  a one-hot vector, so every family's layout works). Read through the final norm's gain g (and its
  centring, for LayerNorm) and the unembedding W_U, (W_out[n] * g) . W_U is what one unit of
  activation adds to each token's logit, before the final norm's input-dependent scale: the tokens
  it promotes (largest) and suppresses (smallest). A head's OV circuit maps a token it attends to
  onto what it writes: for a source token s, W_E[s] -> the layer's attention norm -> W_V (the
  head's key/value group) -> W_O (the head's slice) -> g -> W_U. Gemma 3's extra norm after the MLP
  / attention contributes its gain.
- **Top-activating contexts over a corpus** (`scan`): every window of a token stream is run once
  with identity edits on each layer's mlp.hook_post and attn.hook_z that keep the K largest
  activations per neuron and the K largest head-output norms ||z_h W_O^h|| per head, with where they
  occurred (window, position; position 0 of a window is skipped: it has no context and its
  activations are outliers). `ContextIndex` holds the result and is saved as safetensors.
- **Activation on a prompt**: the neuron's mlp.hook_post column of a Trace; a head's output norm
  per position and where it attends.

Pure torch + transformers; the background job that runs `scan` once per model is tasks/neuron_job.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from model_core.core.adapters import is_norm
from model_core.core.errors import SettingsError
from model_core.core.hook_names import act_name, layer_of

TOP_K = 12  # contexts kept per neuron and per head
DEFAULT_WINDOW = 64
DEFAULT_TOKENS = 16384
FORMAT = "lmscope-context-index"


# --- reading weights ----------------------------------------------------------------------------

def norm_gain(norm: nn.Module) -> tuple[torch.Tensor, bool]:
    """(g [d] float32, centres): the norm as a linear map at scale 1 is c -> g * c (LayerNorm:
    g * (c - mean(c))). RMSNorm-style gains (w, Gemma's 1 + w) are read off the module by feeding
    it a vector of ones, whose mean square is exactly 1."""
    w = next(norm.parameters(), None)
    d = w.shape[-1] if w is not None else None
    if isinstance(norm, nn.LayerNorm):
        g = norm.weight.float() if norm.weight is not None else torch.ones(norm.normalized_shape[-1])
        return g.detach(), True
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", 1e-6)
    ones = torch.ones(1, d, dtype=w.dtype, device=w.device)
    with torch.inference_mode():
        g = norm(ones)[0].float() * math.sqrt(1.0 + eps)
    return g.clone(), False


def _through(norm_mod: nn.Module, vec: torch.Tensor) -> torch.Tensor:
    g, centre = norm_gain(norm_mod)
    v = vec.float()
    if centre:
        v = v - v.mean(-1, keepdim=True)
    return v * g.to(v.device)


def unembed_direction(lm, vec: torch.Tensor) -> torch.Tensor:
    """[..., d] directions in the residual stream -> [..., V]: what each adds to every token's
    logit through the final norm's gain (scale 1) and the unembedding (no biases, no soft-cap)."""
    ad = lm.adapter
    v = _through(ad.final_norm, vec)
    W = ad.unembed.weight
    return v.to(W.device) @ W.float().T


def _linear_rows(module: nn.Module, n_in: int, rows: list[int], device, dtype) -> torch.Tensor:
    """module(e_r) - module(0) for one-hot inputs e_r: the module's weight rows for inputs r, in the
    module's own layout (nn.Linear, GPT-2's Conv1D)."""
    x = torch.zeros(len(rows) + 1, n_in, device=device, dtype=dtype)
    x[torch.arange(len(rows)), torch.tensor(rows)] = 1
    with torch.inference_mode():
        y = module(x).float()
    return y[:-1] - y[-1:]


def _check(lm, layer: int, unit: int, n_units: int, what: str) -> None:
    L = lm.shape.n_layers
    for v, hi, name in ((layer, L, "Layer"), (unit, n_units, what)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < hi:
            raise SettingsError(f"{name} {v} is outside this model (0–{hi - 1}).")


def neuron_direction(lm, layer: int, neuron: int) -> torch.Tensor:
    """[d]: what one unit of neuron `neuron`'s activation adds to the residual stream (Gemma 3: after
    its post-MLP norm's gain)."""
    s = lm.shape
    _check(lm, layer, neuron, s.d_mlp, "Neuron")
    ad = lm.adapter
    blk = ad.layers[layer]
    down = ad.mlp_post_module(blk)
    w = next(down.parameters())
    d = _linear_rows(down, s.d_mlp, [neuron], w.device, w.dtype)[0]
    out_mod = ad.mlp_out_module(blk)
    return _through(out_mod, d) if is_norm(out_mod) else d


def neuron_logits(lm, layer: int, neuron: int) -> torch.Tensor:
    """[V]: (W_out[neuron] * g) . W_U, the neuron's direct effect per unit activation on each logit."""
    return unembed_direction(lm, neuron_direction(lm, layer, neuron))


def head_ov_logits(lm, layer: int, head: int, source_ids: list[int]) -> torch.Tensor:
    """[S, V]: for each source token, what head `head` writes to every logit when it attends (fully)
    to that token alone: its embedding through the layer's attention norm, the head's W_V and W_O,
    the final gain and W_U (no positions, no biases)."""
    s = lm.shape
    _check(lm, layer, head, s.n_heads, "Head")
    ad = lm.adapter
    blk = ad.layers[layer]
    ids = torch.tensor([int(i) for i in source_ids], device=ad.embed_tokens.weight.device)
    with torch.inference_mode():
        x = ad.attn_norm(blk)(ad.embed_tokens(ids))  # [S, d], each token's embedding normalised
        S, dh = len(source_ids), s.d_head
        rope = (torch.ones(1, S, dh, dtype=x.dtype, device=x.device), torch.zeros(1, S, dh, dtype=x.dtype, device=x.device))
        _, _, v = ad.qkv(layer, x, rope)  # v: [kv_heads, S, dh]
        kv = head // max(1, s.n_heads // v.shape[0])
        o_mod = ad.attn_z_module(blk)
        z = torch.zeros(S + 1, s.n_heads * dh, dtype=v.dtype, device=v.device)
        z[:S, head * dh:(head + 1) * dh] = v[kv]
        out = o_mod(z).float()
        out = out[:S] - out[S:]
    post = ad.attn_out_module(blk)
    if is_norm(post):
        out = _through(post, out)
    return unembed_direction(lm, out)


def top_tokens(lm, logits: torch.Tensor, k: int = 10) -> dict:
    """{"promoted": [...], "suppressed": [...]} of {id, token, value} from a [V] vector."""
    from model_core.core.tokenization import token_display

    def rows(vals, idx):
        return [{"id": int(i), "token": token_display(lm.tokenizer, i) or "∅", "value": float(v)}
                for v, i in zip(vals.tolist(), idx.tolist())]
    k = max(1, min(int(k), logits.shape[-1]))
    hi = torch.topk(logits, k)
    lo = torch.topk(-logits, k)
    return {"promoted": rows(hi.values, hi.indices), "suppressed": rows(-lo.values, lo.indices)}


# --- on one prompt ----------------------------------------------------------------------------

def neuron_activation(tr, layer: int, neuron: int) -> torch.Tensor:
    """[T]: the neuron's activation (mlp.hook_post) at every position of a Trace."""
    _check(tr.lm, layer, neuron, tr.lm.shape.d_mlp, "Neuron")
    return tr.mlp_post(layer)[:, neuron].float()


def _o_gram(lm, layer: int) -> torch.Tensor:
    """[H, dh, dh]: W_O^h^T W_O^h per head, so ||z_h W_O^h||^2 = z_h G_h z_h."""
    s = lm.shape
    ad = lm.adapter
    o_mod = ad.attn_z_module(ad.layers[layer])
    w = next(o_mod.parameters())
    rows = _linear_rows(o_mod, s.n_heads * s.d_head, list(range(s.n_heads * s.d_head)), w.device, w.dtype)
    Wo = rows.view(s.n_heads, s.d_head, -1)  # [H, dh, d]
    return Wo @ Wo.transpose(1, 2)


def head_activity(tr, layer: int, head: int) -> dict:
    """On a Trace: the head's output norm ||z_h W_O^h|| at each position [T], and for each query
    position the key it attends most ([T] positions) with that weight."""
    lm = tr.lm
    _check(lm, layer, head, lm.shape.n_heads, "Head")
    with torch.inference_mode():
        st = tr.attention_steps(layer)
        z = st["z"][head].float()  # [T, dh]
        G = _o_gram(lm, layer)[head].to(z.device)
        norms = torch.sqrt(torch.clamp(((z @ G) * z).sum(-1), min=0))
        pat = st["pattern"][head].float()
        w, src = pat.max(-1)
    return {"norm": norms.cpu(), "source": src.cpu(), "weight": w.cpu()}


# --- top-activating contexts over a corpus ----------------------------------------------------

def corpus_windows(tokenizer, texts: list[str], n_tokens: int = DEFAULT_TOKENS,
                   window: int = DEFAULT_WINDOW) -> torch.Tensor:
    """[N, window] int64: the texts tokenized one after another (each followed by a blank line, no
    special tokens) into one stream, cut into whole windows, at most n_tokens in all."""
    if window < 2:
        raise SettingsError("The context window must be at least 2 tokens.")
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            break
    n = min(len(ids), int(n_tokens)) // window
    if n < 1:
        raise SettingsError(f"The corpus has fewer than {window} tokens; nothing to scan.")
    return torch.tensor(ids[: n * window], dtype=torch.int64).view(n, window)


@dataclass
class ContextIndex:
    """The K largest activations of every neuron and head over `tokens` ([N, W] windows), each with
    its place as a flat index w * W + p."""

    model: str
    tokens: torch.Tensor  # [N, W] int64
    neuron_vals: torch.Tensor  # [L, M, K] float32, largest first
    neuron_idx: torch.Tensor  # [L, M, K] int64
    head_vals: torch.Tensor  # [L, H, K] float32 (head output norm)
    head_idx: torch.Tensor  # [L, H, K] int64
    meta: dict = field(default_factory=dict)

    @property
    def window(self) -> int:
        return int(self.tokens.shape[1])

    def place(self, flat: int) -> tuple[int, int]:
        return divmod(int(flat), self.window)

    def save(self, path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"tokens": self.tokens.contiguous(), "neuron_vals": self.neuron_vals.contiguous(),
                   "neuron_idx": self.neuron_idx.contiguous(), "head_vals": self.head_vals.contiguous(),
                   "head_idx": self.head_idx.contiguous()}, str(tmp),
                  metadata={"format": FORMAT, "model": self.model, "meta": json.dumps(self.meta)})
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path) -> ContextIndex:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            if md.get("format") != FORMAT:
                raise SettingsError(f"{Path(path).name} is not an lmscope context index.")
            t = {k: f.get_tensor(k) for k in f.keys()}
        return cls(model=md.get("model", ""), meta=json.loads(md.get("meta") or "{}"), **t)

    def contexts(self, tokenizer, kind: str, layer: int, unit: int, before: int = 24, after: int = 4) -> list[dict]:
        """The top contexts of a neuron or head: value, window, position, and the text around it
        (tokens shown byte-safe, glyphs joined as in every view)."""
        from model_core.core.tokenization import describe_tokens

        vals, idx = ((self.neuron_vals, self.neuron_idx) if kind == "neuron" else (self.head_vals, self.head_idx))
        if not (0 <= layer < vals.shape[0] and 0 <= unit < vals.shape[1]):
            raise SettingsError(f"{'Neuron' if kind == 'neuron' else 'Head'} L{layer}/{unit} is not in this index.")
        out = []
        for v, flat in zip(vals[layer, unit].tolist(), idx[layer, unit].tolist()):
            if not math.isfinite(v) or flat < 0:
                continue
            w, p = self.place(flat)
            lo, hi = max(0, p - before), min(self.window, p + after + 1)
            rows = describe_tokens(tokenizer, self.tokens[w, lo:hi].tolist())
            out.append({"value": float(v), "window": w, "position": p, "at": p - lo,
                        "tokens": [r["display"] for r in rows]})
        return out


def scan(lm, windows: torch.Tensor, k: int = TOP_K, batch_size: int = 8, progress=None) -> ContextIndex:
    """Run every window once (batches of `batch_size`) and keep the k largest activations of every
    neuron and the k largest output norms of every head, with their places. progress(f) as each
    batch ends (it may raise to stop)."""
    from model_core.core.hooks import instrument
    from model_core.interp.interventions import last_logits

    ad = lm.adapter
    s = lm.shape
    L, M, H, dh = s.n_layers, s.d_mlp, s.n_heads, s.d_head
    if not hasattr(ad, "mlp_post_module") or not hasattr(ad, "attn_z_module"):
        raise SettingsError(f"Top contexts are not available for the '{ad.family}' family.")
    instrument(ad)
    N, W = windows.shape
    k = max(1, min(int(k), N * (W - 1)))
    dev = lm.device
    nv = torch.full((L, M, k), float("-inf"), device=dev)
    ni = torch.full((L, M, k), -1, dtype=torch.int64, device=dev)
    hv = torch.full((L, H, k), float("-inf"), device=dev)
    hi = torch.full((L, H, k), -1, dtype=torch.int64, device=dev)
    grams = [_o_gram(lm, l).to(dev) for l in range(L)]

    def keep(vals_all, idx_all, l, x, offset):
        # x: [B, W, U] -> running top-k per unit over (window, position), position 0 skipped
        B = x.shape[0]
        x = x.float().clone()
        x[:, 0] = float("-inf")
        flat = x.reshape(B * W, -1).T  # [U, B*W]
        places = offset + torch.arange(B * W, device=x.device)
        v = torch.cat([vals_all[l], flat], 1)
        i = torch.cat([idx_all[l], places.expand(flat.shape[0], -1)], 1)
        top = torch.topk(v, k, dim=1)
        vals_all[l] = top.values
        idx_all[l] = torch.gather(i, 1, top.indices)

    with torch.inference_mode():
        for b0 in range(0, N, batch_size):
            ids = windows[b0:b0 + batch_size].to(dev)
            offset = b0 * W

            def on_post(name, x, offset=offset):
                keep(nv, ni, layer_of(name), x, offset)
                return x

            def on_z(name, x, offset=offset):
                l = layer_of(name)
                z = x.float().view(x.shape[0], W, H, dh)
                norms = torch.sqrt(torch.clamp(torch.einsum("bthe,hef,bthf->bth", z, grams[l], z), min=0))
                keep(hv, hi, l, norms, offset)
                return x

            edits = {}
            for l in range(L):
                edits[act_name("post", l)] = on_post
                edits[act_name("z", l)] = on_z
            last_logits(lm, ids, edits)
            if progress is not None:
                progress(min(1.0, (b0 + len(ids)) / N))
    return ContextIndex(model=lm.name, tokens=windows.cpu(), neuron_vals=nv.cpu(), neuron_idx=ni.cpu(),
                        head_vals=hv.cpu(), head_idx=hi.cpu(),
                        meta={"window": W, "windows": N, "k": k, "skipped": "position 0 of each window"})
