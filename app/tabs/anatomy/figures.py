"""Anatomy view figures: pure functions, data (tensors / lists) -> plotly Figure."""

from __future__ import annotations

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

SMALL = dict(margin=dict(l=40, r=10, t=40, b=30), height=320)


def _np(t):
    if torch.is_tensor(t):
        return t.detach().float().cpu().numpy()
    return t


def token_labels(tokens: list[dict]) -> list[str]:
    """Unique axis labels: 'position:token'."""
    return [f"{i}:{t['display']}" for i, t in enumerate(tokens)]


def heatmap(matrix, x=None, y=None, title: str = "", colorscale: str = "RdBu", zmid: float | None = 0.0,
            height: int = 320, xtitle: str = "", ytitle: str = "") -> go.Figure:
    z = _np(matrix)
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorscale=colorscale, zmid=zmid,
                               reversescale=colorscale == "RdBu", hoverongaps=False))
    fig.update_layout(title=title, **{**SMALL, "height": height})
    fig.update_yaxes(autorange="reversed", title=ytitle)
    fig.update_xaxes(title=xtitle)
    return fig


def param_breakdown(counts_by_model: dict[str, dict]) -> go.Figure:
    """Stacked bars: parameters by part for each model (share of its total)."""
    parts = ["embedding", "attention", "mlp", "norms", "unembedding"]
    fig = go.Figure()
    for part in parts:
        fig.add_bar(name=part, x=list(counts_by_model),
                    y=[100 * c.get(part, 0) / max(1, c["total"]) for c in counts_by_model.values()],
                    customdata=[c.get(part, 0) for c in counts_by_model.values()],
                    hovertemplate="%{x}<br>" + part + ": %{customdata:,} (%{y:.1f}%)<extra></extra>")
    fig.update_layout(barmode="stack", title="Parameters by part (% of each model)", yaxis_title="%", **SMALL)
    return fig


def mask_label(step: dict) -> str:
    """What the mask panel shows: the causal mask, plus the window on sliding-window layers."""
    return f"mask applied (causal + window {step['window']})" if step.get("window") else "causal mask applied"


def _range(m) -> str:
    a = _np(m)
    a = a[a == a]  # drop NaN (masked gaps)
    a = a[abs(a) != float("inf")]
    return f"{a.min():.3g} … {a.max():.3g}" if a.size else "—"


def attention_steps(step: dict, tokens: list[dict]) -> go.Figure:
    """Q, K, raw scores, scaled, masked, softmax, V and the weighted sum z, one small heatmap each.
    Each subplot title carries the panel's value range; the three score panels share one colour
    range (and colour bar), so the scaling shows as paler colours."""
    labels = token_labels(tokens)
    dims = list(range(step["q"].shape[1]))
    masked = step["masked"].clone()
    masked[~step["mask"]] = float("nan")  # shown as gaps: the mask removes them
    after = "after RoPE · " if step.get("rope") else ""  # what a learner recomputing W_q·x must know
    panels = [
        ("Q (queries)", step["q"], dims, labels),
        ("K (keys)", step["k"], dims, labels),
        ("raw scores Q·Kᵀ", step["raw"], labels, labels),
        (f"scaled × {step['scale']:.4g}", step["scaled"], labels, labels),
        (mask_label(step), masked, labels, labels),
        ("softmax = pattern", step["pattern"], labels, labels),
        ("V (values)", step["v"], dims, labels),
        ("z = pattern · V", step["z"], dims, labels),
    ]
    scores = {panels[i][0] for i in (2, 3, 4)}
    smax = max(float(step["raw"].abs().max()), float(step["scaled"].abs().max()), 1e-9)
    titles = [f"{p[0]}<br><span style='font-size:11px'>{after if i < 2 else ''}{_range(p[1])}</span>"
              for i, p in enumerate(panels)]
    fig = make_subplots(rows=2, cols=4, subplot_titles=titles, horizontal_spacing=0.05, vertical_spacing=0.16)
    for idx, (name, m, x, y) in enumerate(panels):
        r, c = divmod(idx, 4)
        prob = name.startswith("softmax")
        style = (dict(coloraxis="coloraxis") if name in scores else
                 dict(colorscale="Viridis", zmin=0, zmax=1, showscale=False) if prob else
                 dict(colorscale="RdBu", reversescale=True, zmid=0.0, showscale=False))
        fig.add_trace(go.Heatmap(z=_np(m), x=x, y=y, hoverongaps=False, name=name, **style,
                                 hovertemplate="row %{y}<br>col %{x}<br>%{z:.4g}<extra>" + name + "</extra>"),
                      row=r + 1, col=c + 1)
        fig.update_yaxes(autorange="reversed", showticklabels=c == 0, row=r + 1, col=c + 1)
        fig.update_xaxes(showticklabels=False, row=r + 1, col=c + 1)
    fig.update_layout(height=600, margin=dict(l=90, r=10, t=70, b=20),
                      coloraxis=dict(colorscale="RdBu", reversescale=True, cmin=-smax, cmax=smax,
                                     colorbar=dict(title=dict(text="scores", side="right"), len=0.9, thickness=12)),
                      title=f"Layer {step['layer']}, head {step['head']} (K/V head {step['kv_head']})")
    return fig


def rope_rotation_step(step: dict, tokens: list[dict]) -> go.Figure:
    """The rotation step of one head: W_q·x and W_k·x (before RoPE) next to Q and K after it, on
    one colour range per pair, and the angle p·θ_i each dimension is turned by (rotate_half
    layout: dimension i and i + d/2 share pair i's angle)."""
    r = step["rope"]
    labels = token_labels(tokens)
    d = r["q_pre"].shape[1]
    dims = list(range(d))
    half = d // 2
    angle = torch.arange(len(tokens), dtype=torch.float32)[:, None] * r["inv_freq"][None, :]
    angle = torch.cat([angle, angle], dim=1)  # dimension i and i + d/2: the same angle
    panels = [("W_q·x (before RoPE)", r["q_pre"], "q"), ("Q after RoPE (what attention uses)", step["q"], "q"),
              ("W_k·x (before RoPE)", r["k_pre"], "k"), ("K after RoPE", step["k"], "k"),
              (f"angle p·θᵢ (dims i and i+{half} share one)", torch.remainder(angle, 2 * torch.pi), None)]
    fig = make_subplots(rows=1, cols=5, subplot_titles=[p[0] for p in panels], horizontal_spacing=0.03)
    lim = {k: max(float(r["q_pre"].abs().max()), float(step["q"].abs().max())) if k == "q" else
           max(float(r["k_pre"].abs().max()), float(step["k"].abs().max())) for k in ("q", "k")}
    for i, (name, m, kind) in enumerate(panels):
        style = (dict(colorscale="RdBu", reversescale=True, zmin=-lim[kind], zmax=lim[kind], showscale=False) if kind
                 else dict(colorscale="Twilight", zmin=0, zmax=2 * 3.141592653589793, showscale=True,
                           colorbar=dict(title="rad", thickness=10)))
        fig.add_trace(go.Heatmap(z=_np(m), x=dims, y=labels, name=name, hoverongaps=False, **style,
                                 hovertemplate="%{y}<br>dim %{x}<br>%{z:.4g}<extra>" + name + "</extra>"),
                      row=1, col=i + 1)
        fig.update_yaxes(autorange="reversed", showticklabels=i == 0, row=1, col=i + 1)
        fig.update_xaxes(showticklabels=False, title="dimension", row=1, col=i + 1)
    fig.update_layout(height=340, margin=dict(l=90, r=10, t=70, b=30),
                      title=(f"The rotation step, head {step['head']}: Q differs from W_q·x by up to "
                             f"{r['max_change_q']:.3g}, K from W_k·x by up to {r['max_change_k']:.3g}"))
    return fig


def attention_variants(step: dict, tokens: list[dict], no_scale: bool, no_mask: bool) -> go.Figure:
    """The model's softmax beside what it would be without the 1/sqrt(d_k) scaling or the mask."""
    labels = token_labels(tokens)
    panels = [("the model's softmax", step["pattern"])]
    if no_scale:
        panels.append(("without scaling", step["no_scale"]))
    if no_mask:
        panels.append(("without the mask" if step.get("window") else "without the causal mask", step["no_mask"]))
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p[0] for p in panels], horizontal_spacing=0.06)
    for i, (name, m) in enumerate(panels):
        fig.add_trace(go.Heatmap(z=_np(m), x=labels, y=labels, colorscale="Viridis", zmin=0, zmax=1,
                                 showscale=i == len(panels) - 1, name=name), row=1, col=i + 1)
        fig.update_yaxes(autorange="reversed", showticklabels=i == 0, row=1, col=i + 1)
        fig.update_xaxes(showticklabels=False, row=1, col=i + 1)
    ent = [float(-(m.clamp_min(1e-30).log() * m).sum(-1).mean()) for _, m in panels]
    fig.update_layout(height=360, margin=dict(l=90, r=10, t=60, b=20),
                      title="Mean row entropy: " + ", ".join(f"{p[0]} {e:.2f} nats" for p, e in zip(panels, ent)))
    return fig


def rope_distance(data: dict, title: str = "") -> go.Figure:
    fig = go.Figure(go.Scatter(x=_np(data["distance"]), y=_np(data["score"]), mode="lines"))
    fig.add_hline(y=data["unrotated"], line_dash="dot", annotation_text="without rotation")
    fig.update_layout(title=title or "Score of two fixed vectors vs their distance", xaxis_title="distance m − n",
                      yaxis_title="q_m · k_n", **SMALL)
    return fig


def rope_angles(angles: torch.Tensor) -> go.Figure:
    """cos(angle) per position and dimension pair: fast pairs spin, slow pairs barely move."""
    return heatmap(torch.cos(angles), title="RoPE: cos(position × θᵢ) per dimension pair",
                   xtitle="dimension pair i", ytitle="position", colorscale="RdBu", zmid=0.0, height=340)


def positions_side_by_side(own: torch.Tensor | None, own_title: str, sinus: torch.Tensor,
                           own_xtitle: str = "dimension") -> go.Figure:
    cols = 2 if own is not None else 1
    titles = ([own_title] if own is not None else []) + ["sinusoidal (Vaswani et al. 2017): sines | cosines"]
    fig = make_subplots(rows=1, cols=cols, subplot_titles=titles, horizontal_spacing=0.08)
    mats = ([own] if own is not None else []) + [sinus]
    for i, m in enumerate(mats):
        fig.add_trace(go.Heatmap(z=_np(m), colorscale="RdBu", reversescale=True, zmid=0.0,
                                 showscale=i == cols - 1), row=1, col=i + 1)
        fig.update_yaxes(autorange="reversed", title="position" if i == 0 else None, row=1, col=i + 1)
        fig.update_xaxes(title=own_xtitle if own is not None and i == 0 else "dimension", row=1, col=i + 1)
    fig.update_layout(height=380, margin=dict(l=50, r=10, t=50, b=40))
    return fig


def neighbours_bar(rows: list[dict], title: str) -> go.Figure:
    fig = go.Figure(go.Bar(x=[r["cosine"] for r in rows][::-1], y=[f"{r['token']} (#{r['id']})" for r in rows][::-1],
                           orientation="h"))
    fig.update_layout(title=title, xaxis_title="cosine similarity", **{**SMALL, "height": 60 + 24 * max(1, len(rows))})
    return fig


def norm_before_after(step: dict) -> go.Figure:
    dims = list(range(step["x"].numel()))
    gst = step.get("gain_stats") or {}
    gname = "1 + w" if step.get("gain_offset") else "g"
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=["before: residual x", "after: the norm's output y",
                                        f"the gain {gname} per dimension ({gst.get('negative', 0):.0%} negative, "
                                        f"median {gst.get('median', 0):.3g})"])
    fig.add_bar(x=dims, y=_np(step["x"]), name="x", row=1, col=1)
    fig.add_bar(x=dims, y=_np(step["out"]), name="y", row=2, col=1)
    gain = _np(step["gain"])
    fig.add_bar(x=dims, y=gain, name="gain", row=3, col=1,
                marker_color=["#d62728" if v < 0 else "#2ca02c" for v in gain])
    if step["type"] == "LayerNorm":
        scale = f"mean {step['mean']:.4g}, std {step['std']:.4g}"
    else:
        scale = f"RMS {step['rms']:.4g}"
    fig.update_layout(title=f"{step['type']} ({scale}; divided by {step['scale']:.4g})", height=560,
                      showlegend=False, margin=dict(l=40, r=10, t=60, b=30))
    fig.update_xaxes(title="dimension", row=3, col=1)
    return fig


def mlp_neurons(step: dict, n: int = 40) -> go.Figure:
    """The strongest neurons of one token: gated (gate, up, product) or GELU (pre, post)."""
    idx = step["top_neurons"][:n].tolist()
    labels = [str(i) for i in idx]
    fig = go.Figure()
    if step["gated"]:
        fig.add_bar(name="act(gate)", x=labels, y=_np(step["gate"][idx]))
        fig.add_bar(name="up", x=labels, y=_np(step["up"][idx]))
        fig.add_bar(name="product", x=labels, y=_np(step["product"][idx]))
        title = f"Top {len(idx)} neurons by |act(gate) × up| (act = {step['activation']})"
    else:
        fig.add_bar(name="pre-activation", x=labels, y=_np(step["pre"][idx]))
        fig.add_bar(name="post-activation", x=labels, y=_np(step["post"][idx]))
        name, _, note = step["activation"].partition(" ")
        title = f"Top {len(idx)} neurons by |{name}(pre)|" + (f" {note}" if note else "")
    fig.update_layout(barmode="group", title=title, xaxis_title="neuron", xaxis_type="category", **SMALL)
    return fig


def mlp_gate_scatter(step: dict) -> go.Figure:
    """Every neuron: the activation's input vs output (the gate's curve, or GELU's)."""
    act = step["activation"].split(" ")[0]
    if step["gated"]:
        x, y, xt, yt = step["gate_pre"], step["gate"], "gate pre-activation W_gate·x", f"{act}(gate)"
    else:
        x, y, xt, yt = step["pre"], step["post"], "pre-activation", f"{act}(pre)"
    fig = go.Figure(go.Scattergl(x=_np(x), y=_np(y), mode="markers", marker=dict(size=3, opacity=0.5),
                                 name="neurons"))
    if "curve_x" in step:  # the activation over -4..4, so its bend shows even when the neurons sit near 0
        fig.add_scatter(x=_np(step["curve_x"]), y=_np(step["curve_y"]), mode="lines", name=f"{act} curve",
                        line=dict(color="gray", dash="dot"))
    fig.update_layout(legend=dict(x=0.01, y=0.99))
    opened = float((y > 0.5).float().mean()) if step["gated"] else float((y > 0).float().mean())
    fig.update_layout(title=f"All {x.numel()} neurons ({opened:.0%} {'opened > 0.5' if step['gated'] else 'positive'})",
                      xaxis_title=xt, yaxis_title=yt, **SMALL)
    return fig


def output_bars(step: dict) -> go.Figure:
    top = step["top"]
    labels = [f"{r['token']} (#{r['id']})" for r in top][::-1]
    fig = make_subplots(rows=1, cols=2, subplot_titles=["logits", "softmax probability"], horizontal_spacing=0.25)
    fig.add_bar(x=[r["logit"] for r in top][::-1], y=labels, orientation="h", row=1, col=1)
    fig.add_bar(x=[r["prob"] for r in top][::-1], y=labels, orientation="h", row=1, col=2)
    fig.update_layout(showlegend=False, title=f"Next token (entropy {step['entropy']:.2f} nats)",
                      **{**SMALL, "height": 80 + 26 * len(top)})
    return fig


def logits_histogram(step: dict) -> go.Figure:
    fig = go.Figure(go.Histogram(x=_np(step["logits"]), nbinsx=100))
    fig.update_layout(title=f"All {step['logits'].numel():,} logits", xaxis_title="logit", yaxis_type="log", **SMALL)
    return fig


# --- chapters computed on tiny random-weight models (model_core.anatomy.textbook_chapters) -----------------------

def kv_variants_bars(rows: list[dict]) -> go.Figure:
    """KV-cache bytes per token of each attention variant: formula next to the measured cache."""
    names = [r["variant"] for r in rows]
    fig = go.Figure()
    fig.add_bar(name="formula", x=names, y=[r["formula B/token"] for r in rows], marker_color="#9ecae1",
                text=[f"{r['formula B/token']:,}" for r in rows], textposition="outside",
                hovertext=[r["formula"] for r in rows], hoverinfo="text")
    fig.add_bar(name="measured (real cache tensors ÷ tokens)", x=names, y=[r["measured B/token"] for r in rows],
                marker_color="#3182bd")
    top = max(max(r["formula B/token"], r["measured B/token"]) for r in rows)
    fig.update_layout(barmode="group", title="KV cache per token, same width (random weights)",
                      yaxis=dict(title="bytes per token (float32)", range=[0, top * 1.18]),
                      legend=dict(orientation="h", y=-0.2),
                      **{**SMALL, "height": 360})
    return fig


def variant_patterns(patterns: dict, labels: list[str], head: int = 0) -> go.Figure:
    """One head's attention pattern (layer 0) in each variant's random model."""
    kinds = list(patterns)
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=[f"{k}, head {head}" for k in kinds],
                        horizontal_spacing=0.03)
    for i, k in enumerate(kinds):
        fig.add_trace(go.Heatmap(z=_np(patterns[k][head]), x=labels, y=labels, colorscale="Viridis", zmin=0,
                                 zmax=1, showscale=i == len(kinds) - 1, name=k), row=1, col=i + 1)
        fig.update_yaxes(autorange="reversed", showticklabels=False, row=1, col=i + 1)
        fig.update_xaxes(showticklabels=False, row=1, col=i + 1)
    fig.update_layout(height=300, margin=dict(l=20, r=10, t=60, b=20),
                      title="Layer-0 pattern (random weights: the mask, not learned behaviour)")
    return fig


def norm_compare_bars(nc: dict, n: int = 48) -> go.Figure:
    """The same vector, LayerNorm'd and RMSNorm'd (unit gain), first n dimensions."""
    dims = list(range(min(n, nc["x"].numel())))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[f"x (mean {nc['mean']:.3g}, std {nc['std']:.3g}, RMS {nc['rms']:.3g})",
                                        "LayerNorm(x) vs RMSNorm(x), unit gain"])
    fig.add_bar(x=dims, y=_np(nc["x"][dims]), name="x", marker_color="#999999", row=1, col=1)
    fig.add_bar(x=dims, y=_np(nc["layernorm"][dims]), name="LayerNorm: (x − mean) / std", row=2, col=1)
    fig.add_bar(x=dims, y=_np(nc["rmsnorm"][dims]), name="RMSNorm: x / RMS", row=2, col=1)
    fig.update_layout(barmode="group", height=440, margin=dict(l=40, r=10, t=70, b=30),
                      legend=dict(orientation="h", y=-0.2),
                      title=f"Same vector, two norms: they differ by up to {nc['max_ln_vs_rms']:.3g} "
                            f"(first {len(dims)} dimensions)")
    fig.update_xaxes(title="dimension", row=2, col=1)
    return fig


def residual_growth_lines(g: dict) -> go.Figure:
    layers = list(range(len(g["pre"])))
    fig = go.Figure()
    fig.add_scatter(x=layers, y=g["pre"], mode="lines+markers", name="pre-norm: x + f(norm(x))")
    fig.add_scatter(x=layers, y=g["post"], mode="lines+markers", name="post-norm: norm(x + f(x))")
    fig.add_hline(y=g["sqrt_d"], line_dash="dot", annotation_text=f"√d = {g['sqrt_d']:.3g}")
    fig.update_layout(title=f"Residual norm ‖x‖ after each layer, {g['layers']} random layers (d = {g['d_model']})",
                      xaxis_title="after layer (0 = embedding)", yaxis_title="mean ‖x‖ over tokens",
                      legend=dict(orientation="h", y=-0.25), **{**SMALL, "height": 360})
    return fig


def position_schemes(ps: dict, alibi4) -> go.Figure:
    """Left: how RoPE and sinusoidal encodings make similarity fall with distance; middle: ALiBi's
    linear bias per head; right: ALiBi's bias matrix of one head for the first positions."""
    k = _np(ps["distance"])
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08,
                        subplot_titles=[f"RoPE and sinusoidal vs distance (d = {ps['d']})",
                                        f"ALiBi bias vs distance ({ps['n_heads']} heads)",
                                        f"ALiBi bias, head 1, positions 0-{alibi4.shape[-1] - 1}"])
    fig.add_scatter(x=k, y=_np(ps["rope"]), mode="lines", name="RoPE: (R_p 1)·(R_p+k 1) / d", row=1, col=1)
    fig.add_scatter(x=k, y=_np(ps["sinusoidal"]), mode="lines", name="sinusoidal: PE_p·PE_p+k / (d/2)",
                    line=dict(dash="dash"), row=1, col=1)
    for h in range(ps["alibi"].shape[0]):
        fig.add_scatter(x=k, y=_np(ps["alibi"][h]), mode="lines", name=f"ALiBi head {h + 1}",
                        showlegend=h in (0, ps["alibi"].shape[0] - 1), line=dict(width=1), row=1, col=2)
    z = alibi4[0].clone()
    z[torch.isinf(z)] = float("nan")
    n = z.shape[-1]
    fig.add_trace(go.Heatmap(z=_np(z), x=list(range(n)), y=list(range(n)), colorscale="Blues", reversescale=True,
                             showscale=False, hoverongaps=False, name="ALiBi bias",
                             text=[[("" if v != v else f"{v:.3g}") for v in row] for row in _np(z)],
                             texttemplate="%{text}"), row=1, col=3)
    fig.update_yaxes(autorange="reversed", title="query position", row=1, col=3)
    fig.update_xaxes(title="distance k", row=1, col=1)
    fig.update_xaxes(title="distance k", row=1, col=2)
    fig.update_xaxes(title="key position", row=1, col=3)
    fig.update_layout(height=380, margin=dict(l=40, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.25))
    return fig


def rope_scaling_lines(rs: dict) -> go.Figure:
    """theta_i per dimension pair: plain RoPE, linear interpolation and YaRN for a longer context."""
    i = list(range(rs["default"].numel()))
    fig = go.Figure()
    fig.add_scatter(x=i, y=_np(rs["default"]), mode="lines+markers", name="plain RoPE")
    fig.add_scatter(x=i, y=_np(rs["linear"]), mode="lines+markers", name=f"linear ×{rs['factor']:g} (all ÷ {rs['factor']:g})")
    fig.add_scatter(x=i, y=_np(rs["yarn"]), mode="lines+markers",
                    name=f"YaRN ×{rs['factor']:g} (attention × {rs['yarn_attention_factor']:.3g})")
    fig.update_layout(title=f"RoPE scaling to {rs['factor']:g}× the context ({rs['original_context']:,} → "
                            f"{int(rs['original_context'] * rs['factor']):,} positions), d = {rs['d']}",
                      xaxis_title="dimension pair i", yaxis=dict(title="θᵢ (rad per position)", type="log"),
                      legend=dict(orientation="h", y=-0.25), **{**SMALL, "height": 360})
    return fig


def moe_router(r: dict, labels: list[str]) -> go.Figure:
    """Router probabilities per token and expert (the chosen top-k marked), and the load."""
    E = r["n_experts"]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], horizontal_spacing=0.1,
                        subplot_titles=[f"router probabilities, layer {r['layer']} (● = one of the top {r['top_k']})",
                                        "load f_e and mean probability P_e"])
    probs = _np(r["probs"])
    chosen = r["chosen"].tolist()
    marks = [["●" if e in chosen[t] else "" for e in range(E)] for t in range(len(chosen))]
    fig.add_trace(go.Heatmap(z=probs, x=[f"E{e}" for e in range(E)], y=labels, colorscale="Viridis", zmin=0,
                             text=marks, texttemplate="%{text}", name="router p",
                             colorbar=dict(x=0.55, thickness=10)), row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    xs = [f"E{e}" for e in range(E)]
    fig.add_bar(x=xs, y=_np(r["load"]), name="load f_e (sums to k)", row=1, col=2)
    fig.add_bar(x=xs, y=_np(r["mean_prob"]), name="mean router p P_e", row=1, col=2)
    fig.add_hline(y=r["top_k"] / E, line_dash="dot", annotation_text=f"balanced: k/E = {r['top_k'] / E:.3g}",
                  row=1, col=2)
    fig.update_layout(barmode="group", height=max(360, 14 * len(labels) + 120), margin=dict(l=90, r=10, t=60, b=40),
                      legend=dict(orientation="h", y=-0.12),
                      title=f"Mixture of experts (random weights): balance loss over all layers "
                            f"{r['aux_loss']:.4g} (perfect balance: {r['top_k']})")
    return fig


# --- entropy, cross-entropy, KL and MFU (model_core.interp.infotheory) ---------------------------------

def surprisal_bars(labels: list[str], surprisal: list[float], mean: float) -> go.Figure:
    """-log p of each actual next token of the prompt (nats), with their mean: the cross-entropy."""
    fig = go.Figure(go.Bar(x=list(range(len(surprisal))), y=surprisal, marker_color="#3b75af",
                           hovertext=[f"{t!r}: -log p = {s:.3f} nats (p = {2.718281828 ** -s:.3g})"
                                      for t, s in zip(labels, surprisal)], hoverinfo="text"))
    fig.add_hline(y=mean, line=dict(color="#d62728", dash="dash"),
                  annotation_text=f"mean = cross-entropy = {mean:.3f} nats", annotation_position="top left")
    fig.update_xaxes(title="next token", tickvals=list(range(len(labels))), ticktext=labels, tickangle=-50)
    fig.update_yaxes(title="surprisal −log p (nats)", rangemode="tozero")
    fig.update_layout(title=dict(text="Surprisal of each actual next token", x=0.01), height=360,
                      margin=dict(l=50, r=20, t=40, b=90))
    return fig


def kl_bars(labels: list[str], p: list[float], q: list[float], terms: list[float], p_name: str,
            q_name: str) -> go.Figure:
    """The tokens that move KL(P||Q) most: p and q side by side, each token's term p (log p − log q)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.1,
                        subplot_titles=("p and q of these tokens", "term p·(log p − log q), nats"))
    fig.add_bar(x=labels, y=p, name=f"P: {p_name}", marker_color="#3b75af", row=1, col=1)
    fig.add_bar(x=labels, y=q, name=f"Q: {q_name}", marker_color="#ff7f0e", row=1, col=1)
    fig.add_bar(x=labels, y=terms, marker_color=["#15803d" if t >= 0 else "#b91c1c" for t in terms],
                showlegend=False, row=1, col=2)
    fig.update_xaxes(tickangle=-50)
    fig.update_layout(title=dict(text="Where P and Q differ most", x=0.01), height=380, barmode="group",
                      legend=dict(orientation="h", y=-0.35), margin=dict(l=50, r=20, t=60, b=110))
    return fig


def mfu_bar(achieved: float, peak: float, label: str) -> go.Figure:
    """Achieved FLOP/s against the peak on a log axis (MFU on a CPU is a tiny fraction)."""
    fig = go.Figure(go.Bar(x=[achieved, peak], y=["achieved", "peak"], orientation="h",
                           marker_color=["#3b75af", "#c9d3df"],
                           text=[f"{achieved:.3g} FLOP/s", f"{peak:.3g} FLOP/s"], textposition="auto"))
    fig.update_xaxes(type="log", title="FLOP/s (log scale)")
    fig.update_layout(title=dict(text=label, x=0.01), height=220, margin=dict(l=80, r=20, t=40, b=40))
    return fig
