"""The `lmscope` command line: the one module that wires the model core, the job queue and the web
app together (the top layer; docs/ARCHITECTURE.md). Settings are read once here
(model_core.core.settings) and passed down. Subcommands import what they need when they run, so
`lmscope models` or `lmscope trace` never import gradio.

A command's result goes to stdout (_out, _print_json); everything else (errors, progress) goes
through logging, configured once in main(): `serve` and `worker` write time, level, logger and
message per line, the one-shot commands the message alone (what a person at the terminal reads).
LMSCOPE_LOG_LEVEL (default INFO) sets the level."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from model_core.core.errors import LmscopeError
from model_core.core.settings import LOG_FORMAT, Settings, configure_logging

log = logging.getLogger(__name__)


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")


def _out(*lines: str) -> None:
    sys.stdout.write("".join(line + "\n" for line in lines))


def _print_json(obj) -> None:
    _out(json.dumps(obj, ensure_ascii=False, indent=2))


def cmd_models(args) -> int:
    from model_core.core.registry import list_models

    if args.action:
        return cmd_models_change(args)

    rows = list_models(include_random=True)
    if args.json:
        _print_json(rows)
    else:
        for r in rows:
            state = "ready" if r["ready"] else ("not installed" if not r["installed"] else "not converted yet")
            params = f"{r['parameters'] / 1e6:.1f}M" if r.get("parameters") else "?"
            _out(f"{r['name']:28s} {r['architecture']:12s} {params:>8s}  {r['source']:13s} {state}")
    return 0


def cmd_models_change(args) -> int:
    """`models add NAME PATH|HUB_ID` (checked at once) and `models remove NAME`."""
    from model_core.core import add_model, host_models
    from model_core.core.errors import LmscopeError

    want = 2 if args.action == "add" else 1
    if len(args.names) != want:
        _err("usage: lmscope models add NAME PATH|HUB_ID  |  lmscope models remove NAME")
        return 2
    if args.action == "remove":
        if not host_models.remove(args.names[0]):
            _err(f"error: '{args.names[0]}' is not a model the host added.")
            return 1
        _out(f"removed '{args.names[0]}' (its checkpoint stays where it is)")
        return 0
    try:
        entry = add_model.add(*args.names)
    except LmscopeError as e:
        _err(f"error: {e}")
        return 1
    if args.json:
        _print_json({"name": args.names[0], **entry})
    else:
        _out(f"added '{args.names[0]}': {entry['architecture']}, {entry['parameters'] / 1e6:.1f}M parameters, "
             f"{entry['dtype']} on {entry['device']}; every model picker lists it")
    return 0


def cmd_prepare(args) -> int:
    from model_core.core.registry import REGISTRY, convert_gguf

    entry = REGISTRY.get(args.model)
    if entry is None or entry.source != "gguf-package":
        _out(f"'{args.model}' needs no preparation.")
        return 0
    path = convert_gguf(entry)
    _out(f"{args.model}: ready at {path}")
    return 0


def cmd_trace(args) -> int:
    from model_core.core.registry import load_model
    from model_core.interp.trace import trace
    from model_core.interp.trace_summary import trace_summary

    lm = load_model(args.model, device=args.device or args.settings.device, dtype=args.settings.dtype)
    tr = trace(lm, args.prompt, chat=args.chat, max_tokens=args.max_tokens, truncate=args.truncate)
    out = trace_summary(lm, tr, k=args.top_k)
    if args.json:
        _print_json(out)
    else:
        _out("tokens: " + " | ".join(t["display"] for t in out["tokens"]), "next token:",
             *(f"  {row['prob']:7.4f}  {row['token']!r}" for row in out["next_tokens"]),
             "logit lens (last position, top-1 per layer):",
             *(f"  layer {row['layer']:3d}  {row['prob']:7.4f}  {row['token']!r}" for row in out["logit_lens"]))
    return 0


def cmd_attribute(args) -> int:
    """`lmscope attribute PROMPT --transcoders NAME`: the prompt's attribution graph toward one token,
    pruned, with its checks (model_core.interp.attribution_graph)."""
    from model_core.core.registry import load_model
    from model_core.interp.attribution_graph import attribution_graph
    from model_core.interp.transcoders import load_transcoders

    lm = load_model(args.model, device=args.device or args.settings.device, dtype=args.settings.dtype)
    tc = load_transcoders(args.transcoders, device=str(lm.device))
    target = args.target
    if target is not None and target.lstrip("-").isdigit() and args.target_is_id:
        target = int(target)
    g = attribution_graph(lm, tc, args.prompt, target, chat=args.chat, max_feature_nodes=args.max_feature_nodes,
                          node_threshold=args.node_threshold, edge_threshold=args.edge_threshold)
    qk = _qk(lm, tc, g, args.qk) if args.qk else None
    if qk is not None:
        g.checks["qk"] = qk.check
    if args.neuronpedia:
        from model_core.interp.attribution_export import neuronpedia_json

        Path(args.neuronpedia).write_text(json.dumps(neuronpedia_json(g, lm.shape.n_layers)), encoding="utf-8")
    if args.json:
        _print_json({**g.to_dict(), **({"qk": qk.to_dict()} if qk is not None else {})})
        return 0 if all(c["ok"] for c in g.checks.values() if c) else 1
    if qk is not None:
        _out(f"layer {qk.layer} head {qk.head}, query position {qk.query_pos} -> key position {qk.key_pos}: score "
             f"{qk.score:.4f}, attention weight {qk.pattern:.4f}; largest terms (query side, then key side):",
             *(f"  q {c:+9.4f}  {t}" for t, c in qk.query_terms[:8]), *(f"  k {c:+9.4f}  {t}" for t, c in qk.key_terms[:8]))
    _out(f"target {g.target_display or g.target_token!r} (id {g.target}) after: {g.prompt_text or ''.join(g.prompt_tokens)!r}",
         f"{len(g.nodes)} nodes, {len(g.edges)} edges kept of {g.stats['active_features']} active features "
         f"({g.stats['rows_computed']} rows computed in {g.stats['seconds']:.1f} s)", "checks:")
    for name, c in g.checks.items():
        if c:
            detail = {k: v for k, v in c.items() if k not in ("what", "ok")}
            _out(f"  {'ok  ' if c['ok'] else 'FAIL'} {name}: " + ", ".join(
                f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in detail.items()))
    _out("most influential nodes:")
    for n in sorted(g.nodes, key=lambda n: -n.influence)[:12]:
        _out(f"  {n.influence:7.4f}  {n.id:<14} {n.kind:<9} {n.token!r}")
    return 0 if all(c["ok"] for c in g.checks.values() if c) else 1


def cmd_transcoders(args) -> int:
    """`lmscope transcoders list|import|export`: transcoder sets in lmscope and in the formats of
    sparsify, SAELens and circuit-tracer (model_core.interp.transcoder_formats)."""
    from model_core.interp import transcoders as TC

    if args.action == "list":
        rows = []
        for name in TC.list_transcoders():
            try:
                rec = json.loads((TC.transcoders_dir() / name / "transcoders.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                rows.append({"name": name, "model": None, "layers": [], "quality": "unreadable transcoders.json",
                             "imported_from": None})
                continue
            rows.append({"name": name, "model": rec.get("model"), "layers": rec.get("layers"),
                         "quality": TC.quality_line(rec["quality"]) if rec.get("quality") else "not evaluated",
                         "imported_from": rec.get("imported_from")})
        if args.json:
            _print_json(rows)
        else:
            _out(*(f"{r['name']}  ({r['model']}, {len(r['layers'] or [])} layers; {r['quality']})" for r in rows))
        return 0
    if args.action == "import":
        tc = TC.import_transcoders(Path(args.path), model=args.model, name=args.name, fmt=args.format)
        out = {"name": tc.name, "model": tc.model, "layers": tc.layers, "from": tc.record["imported_from"]}
    else:
        files = TC.export_transcoders(args.name, Path(args.path), args.format)
        out = {"name": args.name, "format": args.format, "files": [str(f) for f in files]}
    if args.json:
        _print_json(out)
    else:
        _out(*(f"{k}: {v}" for k, v in out.items()))
    return 0


def _qk(lm, tc, g, spec: str):
    """--qk LAYER.HEAD.QUERY.KEY: the QK attribution of that pattern entry on the graph's prompt."""
    from model_core.core.errors import SettingsError
    from model_core.interp.attribution_graph import FrozenModel
    from model_core.interp.qk_attribution import qk_attribution

    try:
        layer, head, q, k = (int(x) for x in spec.split("."))
    except ValueError:
        raise SettingsError("--qk takes LAYER.HEAD.QUERY.KEY, four whole numbers, e.g. 10.3.4.1.") from None
    return qk_attribution(FrozenModel(lm, tc, g.prompt_ids, g.target), layer, head, q, k)


def _diff_across_run(args, base, device) -> int:
    """`lmscope diff --across-run`: KL(base || model) on the prompt at every checkpoint of the tuned
    model's run, the final model last."""
    from model_core.core.errors import SettingsError
    from model_core.core.registry import load_model
    from model_core.interp.model_diff_run import kl_across_run, run_checkpoints

    if args.chat:
        raise SettingsError("--across-run follows the prompt as written; leave out --chat.")
    steps = run_checkpoints(args.tuned)
    if not steps:
        raise SettingsError(f"'{args.tuned}' has no kept checkpoints; train it with --keep-checkpoints N to see "
                            "when it changed.")
    models = [(st, (lambda n=n: load_model(n, device=device, dtype=args.settings.dtype))) for st, n in steps]
    r = kl_across_run(base, models, prompts=[args.prompt])  # its last 128 tokens
    if args.json:
        _print_json(r.to_dict())
        return 0
    _out(f"KL({r.base} || model at the step), mean over the prompt's {len(r.tokens[0])} tokens:")
    for step, name, row in zip(r.steps, r.models, r.mean_kl):
        _out(f"  step {step:6d}  {row[0]:9.5f}  {name}")
    return 0


def cmd_diff(args) -> int:
    from model_core.core.registry import load_model
    from model_core.interp.model_diff import diff_prompt

    device = args.device or args.settings.device
    base = load_model(args.base, device=device, dtype=args.settings.dtype)
    if args.across_run:
        return _diff_across_run(args, base, device)
    tuned = load_model(args.tuned, device=device, dtype=args.settings.dtype)
    d = diff_prompt(base, tuned, args.prompt, chat=args.chat, max_tokens=args.max_tokens)
    if args.json:
        _print_json(d.to_dict())
        return 0
    if d.vocabulary != "same":
        _out(d.vocabulary)
    _out(f"KL({d.base} || {d.tuned}) of the next token after each prompt token, and where the residual "
         "streams part (first layer at 5% of the base's norm; 0 = embeddings):")
    for t, tok in enumerate(d.tokens):
        gained = ", ".join(f"{g!r} {v:+.3f}" for g, v in d.gained[t][:3])
        lost = ", ".join(f"{g!r} {v:+.3f}" for g, v in d.lost[t][:3])
        parted = "-" if d.parted_at[t] is None else str(d.parted_at[t])
        _out(f"  {t:4d} {tok!r:>16}  KL {d.kl[t]:.4f}  parts at {parted:>3}  gained {gained or '-'}  lost {lost or '-'}")
    return 0


def _search_settings(args):
    """--num-beams / --num-beam-groups / --diversity-penalty / --penalty-alpha ask for a search
    (model_core.serving.search_decoding) instead of sampling; None when none of them is set."""
    from model_core.serving.search_decoding import DecodingSettings

    beams, alpha = args.num_beams, args.penalty_alpha
    if beams <= 1 and alpha <= 0 and args.num_beam_groups <= 1 and args.diversity_penalty <= 0:
        return None
    if alpha > 0 and beams > 1:
        raise LmscopeError("Pick one search: --num-beams for beam search or --penalty-alpha for contrastive search.")
    if alpha > 0:
        return DecodingSettings.from_values("contrastive", penalty_alpha=alpha, top_k=args.top_k or 4,
                                            length_penalty=args.length_penalty, max_new_tokens=args.max_new_tokens)
    method = "diverse" if args.num_beam_groups > 1 or args.diversity_penalty > 0 else "beam"
    return DecodingSettings.from_values(method, num_beams=beams, num_beam_groups=args.num_beam_groups,
                                        diversity_penalty=args.diversity_penalty, length_penalty=args.length_penalty,
                                        max_new_tokens=args.max_new_tokens)


def cmd_search(args, settings) -> int:
    from model_core.core.registry import load_model
    from model_core.serving.search_decoding import decode, decoding_to_json

    lm = load_model(args.model, device=args.device or args.settings.device, dtype=args.settings.dtype)
    out = decoding_to_json(lm, decode(lm, args.prompt, settings, chat=args.chat))
    if args.json:
        _print_json(_generate_json([out]))
    else:
        _out(args.prompt + out["text"],
             *(f"  #{b['rank']}  score {b['score']:.4f}  log p {b['logprob']:.3f}  {b['length']} tokens  "
               f"repeated 3-grams {b['repetition']:.0%}  {b['text']!r}" for b in out["beams"]))
    return 0


def _generate_json(runs: list[dict], steering: dict | None = None) -> dict:
    """What `lmscope generate --json` prints, whichever way it ran: {"runs": [...], "steering": ...}.
    runs: one run (a sampled generation, or a search's decoding with its beams), or the unsteered
    and the steered run; steering: the vector and its settings when it steered, else None."""
    return {"runs": runs, "steering": steering}


def cmd_generate(args) -> int:
    from model_core.core.registry import load_model
    from model_core.core.sampling import SamplingSettings
    from model_core.serving.generate import generate, generation_to_json

    # checked before anything loads: a bad value is one sentence and nothing runs
    settings = SamplingSettings.from_values(args.temperature, args.top_k, args.top_p, args.min_p,
                                            args.repetition_penalty, presence_penalty=args.presence_penalty,
                                            frequency_penalty=args.frequency_penalty)
    if args.dola_layers is not None:
        return cmd_dola(args, settings)
    if args.prompt_lookup is not None or args.assistant_model is not None:
        return cmd_speculative(args, settings)
    search = _search_settings(args)
    if search is not None:
        if settings.penalises_generated:
            raise LmscopeError("--presence-penalty and --frequency-penalty apply to sampling, not to a beam or "
                               "contrastive search.")
        return cmd_search(args, search)
    lm = load_model(args.model, device=args.device or args.settings.device, dtype=args.settings.dtype)
    options = dict(max_new_tokens=args.max_new_tokens, settings=settings, seed=args.seed, chat=args.chat,
                   stop=args.stop or [])
    if args.steer_pairs:
        return cmd_steered_generate(args, lm, options)
    res = generate(lm, args.prompt, **options)
    out = generation_to_json(lm, res)
    if args.json:
        _print_json(_generate_json([out]))
    else:
        _out(args.prompt + out["text"])
    return 0


def cmd_dola(args, settings) -> int:
    """Greedy DoLa decoding (model_core.interp.dola): the final layer contrasted at each step with the
    candidate layer that differs from it most; --json reports that layer and every candidate's divergence."""
    from model_core.core.prompts import encode_prompt
    from model_core.core.registry import load_model
    from model_core.interp import dola as D
    from model_core.serving.generation_request import check_max_new_tokens

    if args.dola_layers not in D.LAYER_CHOICES:
        raise LmscopeError(f"--dola-layers takes low or high, not {args.dola_layers!r}.")
    check_max_new_tokens(args.max_new_tokens)
    if not settings.greedy or settings.penalises_generated:
        raise LmscopeError("DoLa here is greedy: use --temperature 0 without presence or frequency penalties "
                           "(--repetition-penalty applies).")
    if (args.steer_pairs or args.stop or _search_settings(args) is not None or args.prompt_lookup is not None
            or args.assistant_model is not None):
        raise LmscopeError("DoLa does not combine with steering, stop strings, beams, contrastive search or "
                           "speculative decoding.")
    lm = load_model(args.model, device=args.device or args.settings.device, dtype=args.settings.dtype)
    ids = encode_prompt(lm, args.prompt, chat=args.chat)
    res = D.dola_greedy(lm, ids, args.max_new_tokens, args.dola_layers,
                        repetition_penalty=settings.repetition_penalty)
    out = {"prompt": args.prompt, **res.to_json(lm.tokenizer)}
    if args.json:
        _print_json(_generate_json([out]))
    else:
        layers = " ".join(str(s.premature_layer) for s in res.steps)
        _out(args.prompt + out["text"],
             f"DoLa ({res.layers} layers: candidates {res.candidates}); premature layer per step: {layers}")
    return 0


def cmd_speculative(args, settings) -> int:
    """Greedy speculative decoding (prompt lookup or a draft model) beside plain greedy decoding of
    the same prompt in the same run: whether their tokens are equal, and the speed-up."""
    from model_core.core.prompts import encode_prompt
    from model_core.core.registry import load_model
    from model_core.serving import speculative as Spec

    if args.prompt_lookup is not None and args.assistant_model is not None:
        raise LmscopeError("Give --prompt-lookup or --assistant-model, not both.")
    if not settings.greedy or settings.repetition_penalty != 1.0 or settings.penalises_generated:
        raise LmscopeError("Speculative decoding here is greedy: use --temperature 0 without penalties.")
    if args.steer_pairs or args.stop or _search_settings(args) is not None:
        raise LmscopeError("Speculative decoding does not combine with steering, stop strings, beams or "
                           "contrastive search.")
    k = Spec.check_k(args.prompt_lookup if args.prompt_lookup is not None else args.draft_tokens)
    lm = load_model(args.model, device=args.device or args.settings.device, dtype=args.settings.dtype)
    if args.assistant_model is not None:
        draft_lm = load_model(args.assistant_model, device=args.device or args.settings.device,
                              dtype=args.settings.dtype)
        Spec.check_draft(lm, draft_lm)
        draft = Spec.DraftModel(draft_lm)
    else:
        draft = Spec.PromptLookup()
    ids = encode_prompt(lm, args.prompt, chat=args.chat)
    plain = Spec.plain_greedy(lm, ids, args.max_new_tokens)
    spec = Spec.speculative_greedy(lm, ids, args.max_new_tokens, draft, k=k)
    out = {"prompt": args.prompt, "prompt_token_ids": ids, **spec.to_json(lm.tokenizer),
           "equals_plain": spec.token_ids == plain.token_ids, "plain": plain.to_json(lm.tokenizer),
           "speedup": plain.seconds / spec.seconds if spec.seconds > 0 else None}
    if args.json:
        _print_json(_generate_json([out]))
    else:
        rate = spec.acceptance_rate
        _out(args.prompt + out["text"],
             f"draft: {spec.draft} (k {k}); accepted {spec.accepted} of {spec.proposed} proposed tokens"
             + (f" ({rate:.0%})" if rate is not None else "")
             + f"; {len(spec.token_ids)} tokens in {spec.target_forwards} target forwards vs "
               f"{plain.target_forwards} plain; {out['speedup']:.2f}x plain greedy's speed in this run; "
               f"tokens {'equal to' if out['equals_plain'] else 'DIFFERENT from'} plain greedy's")
    return 0


def cmd_steered_generate(args, lm, options: dict) -> int:
    """The generation with alpha * v at --steer-layer (v from the --steer-pairs file) beside the
    unsteered one with the same seed."""
    from model_core.interp import steering as St
    from model_core.serving import steered as Steered
    from model_core.serving.generate import generation_to_json

    path = Path(args.steer_pairs)
    if args.steer_pairs in St.BUILTIN_PAIRS:
        pairs = St.builtin_pairs(args.steer_pairs)
    elif path.is_file():
        pairs = St.parse_pairs(path.read_text(encoding="utf-8", errors="replace"))
    else:
        raise LmscopeError(f"No pairs file {args.steer_pairs!r} (or a built-in set: {', '.join(St.BUILTIN_PAIRS)}).")
    vec = St.steering_vector(lm, pairs, args.steer_layer, chat=args.chat)
    runs = [Steered.steered_generation(lm, args.prompt, vec, a, from_position=args.steer_from, **options)
            for a in dict.fromkeys([0.0, St.check_alpha(args.alpha)])]
    if args.json:
        _print_json(_generate_json(
            [{"alpha": r.alpha, "base_perplexity": r.base_perplexity, **generation_to_json(lm, r.generation)}
             for r in runs],
            {**St.steering_to_json(vec), "alpha": runs[-1].alpha, "from_position": args.steer_from}))
    else:
        for r in runs:
            _out(f"alpha {r.alpha:g} (perplexity under the base model {r.base_perplexity or float('nan'):.2f}):",
                 "  " + args.prompt + r.generation.text)
    return 0


def cmd_card(args) -> int:
    from model_core.anatomy import reference_cards as R

    card = R.card(args.name)
    if args.json:
        _print_json(R.to_json(card))
        return 0
    marks = R.row_marks(card)
    _out(f"{card.get('title') or card['name']}  ({card['source']})")
    for label, value in R.display_rows(card).items():
        _out(f"  {label:34s} {value}")
        for m in marks.get(label, []):
            said = "(value not quoted)" if m["claim"] is None else m["claim"]
            _out(f"  {'':34s} {'=' if m['agrees'] else '≠'} {m['source']}: {said}" + ("" if m["agrees"] else f" — {m['note']}"))
    _out(*(f"  note: {note}" for note in card.get("notes", [])))
    return 0


def cmd_serve(args) -> int:
    from app.server.main import serve

    serve(args.settings, host=args.host, port=args.port, embedded_services=not args.no_services)
    return 0


def cmd_worker(args) -> int:
    from tasks.worker import run_worker

    run_worker(concurrency=args.concurrency, settings=args.settings)
    return 0


def cmd_jobs(args) -> int:
    from tasks.cli import jobs_command

    return jobs_command(args)


def build_parser() -> argparse.ArgumentParser:
    from model_core.core.settings import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="lmscope", description="See inside decoder-only language models.")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="list the models (registry, the host's, fine-tuned); "
                                      "`models add NAME PATH|HUB_ID` puts the host's checkpoint in every picker")
    m.add_argument("action", nargs="?", choices=["add", "remove"])
    m.add_argument("names", nargs="*", help="add: NAME PATH|HUB_ID; remove: NAME")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    pr = sub.add_parser("prepare", help="convert a packaged model to the safetensors cache")
    pr.add_argument("--model", default=DEFAULT_MODEL)
    pr.set_defaults(func=cmd_prepare)

    t = sub.add_parser("trace", help="trace one forward pass and print tokens, next tokens, logit lens")
    t.add_argument("prompt")
    t.add_argument("--model", default=DEFAULT_MODEL)
    t.add_argument("--top-k", type=int, default=10)
    t.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    t.add_argument("--max-tokens", type=int, default=1024)
    t.add_argument("--truncate", action="store_true", help="keep the last --max-tokens tokens of a long prompt")
    t.add_argument("--device", default=None)
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_trace)

    df = sub.add_parser("diff", help="what fine-tuning changed on a prompt: per-token KL(base || tuned), "
                                     "tokens gained and lost, where the residual streams part")
    df.add_argument("--base", required=True, help="the model before (a fine-tuned model's parent)")
    df.add_argument("--tuned", required=True, help="the model after")
    df.add_argument("--prompt", required=True)
    df.add_argument("--chat", action="store_true", help="wrap the prompt in the base model's chat template")
    df.add_argument("--max-tokens", type=int, default=1024)
    df.add_argument("--across-run", action="store_true",
                    help="the KL at every checkpoint the tuned model's run kept (when did it change)")
    df.add_argument("--device", default=None)
    df.add_argument("--json", action="store_true")
    df.set_defaults(func=cmd_diff)

    g = sub.add_parser("generate", help="generate token by token, recording every step")
    g.add_argument("prompt")
    g.add_argument("--model", default=DEFAULT_MODEL)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtract this from the logit of every "
                   "token generated so far (OpenAI's; the prompt does not count), in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract this times the number of "
                   "times a token was generated so far (OpenAI's), in [-2, 2]")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true")
    g.add_argument("--num-beams", type=int, default=1, help="beam search with N beams (transformers' generate); "
                   "--json lists every beam with its scores")
    g.add_argument("--num-beam-groups", type=int, default=1, help="diverse beam search: split the beams into groups")
    g.add_argument("--diversity-penalty", type=float, default=0.0, help="diverse beam search: penalty per token "
                   "an earlier group chose at the same step")
    g.add_argument("--length-penalty", type=float, default=1.0, help="beam score = sum log p / length ** this")
    g.add_argument("--penalty-alpha", type=float, default=0.0, help="contrastive search with this alpha and "
                   "--top-k candidates (4 if unset)")
    g.add_argument("--prompt-lookup", type=int, default=None, metavar="K", help="speculative decoding (greedy): "
                   "propose up to K tokens that followed the text's last 3, 2 or 1 tokens earlier in it; --json "
                   "lists each step's accepted tokens and compares with plain greedy in the same run")
    g.add_argument("--assistant-model", default=None, help="speculative decoding (greedy) with this draft model "
                   "(the same tokenizer as --model), --draft-tokens at a time")
    g.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft model proposes per step (1-32)")
    g.add_argument("--dola-layers", default=None, metavar="low|high", help="DoLa (greedy): contrast the final "
                   "layer with the lower or upper half's layer that differs from it most, chosen per step")
    g.add_argument("--steer-pairs", default=None, help="steer: a JSONL file of {\"positive\": ..., "
                   "\"negative\": ...} lines (or a built-in set: love-hate, formal-informal); prints the unsteered "
                   "run (alpha 0) and the steered one, same seed")
    g.add_argument("--steer-layer", type=int, default=6, help="steer: the layer whose input gets alpha * v")
    g.add_argument("--alpha", type=float, default=4.0, help="steer: the vector's strength (0: unsteered)")
    g.add_argument("--steer-from", type=int, default=0, help="steer: add the vector from this prompt position on")
    g.add_argument("--device", default=None)
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    at = sub.add_parser("attribute", help="attribution graph of a prompt toward one token, on a transcoder set "
                        "(`lmscope jobs submit transcoders` trains one), with its checks")
    at.add_argument("prompt")
    at.add_argument("--model", default=DEFAULT_MODEL)
    at.add_argument("--transcoders", required=True, help="the transcoder set's name")
    at.add_argument("--target", default=None, help="the target token as text (one token; default: the top next token)")
    at.add_argument("--target-is-id", action="store_true", help="read --target as a token id")
    at.add_argument("--max-feature-nodes", type=int, default=512)
    at.add_argument("--node-threshold", type=float, default=0.8)
    at.add_argument("--edge-threshold", type=float, default=0.98)
    at.add_argument("--qk", default=None, metavar="L.H.Q.K", help="also split head H of layer L's score from "
                    "query position Q to key position K over the graph's nodes at both positions (QK attribution)")
    at.add_argument("--neuronpedia", default=None, metavar="FILE",
                    help="also write the graph in the JSON layout Neuronpedia's graph viewer reads")
    at.add_argument("--chat", action="store_true")
    at.add_argument("--device", default=None)
    at.add_argument("--json", action="store_true")
    at.set_defaults(func=cmd_attribute)

    tr = sub.add_parser("transcoders", help="transcoder sets: list them, import one written by sparsify, SAELens or "
                        "circuit-tracer, export one in those formats")
    tsub = tr.add_subparsers(dest="action", required=True)
    tl = tsub.add_parser("list", help="the saved sets")
    tl.add_argument("--json", action="store_true")
    ti = tsub.add_parser("import", help="a folder in sparsify's, SAELens' or circuit-tracer's layout -> an lmscope set")
    ti.add_argument("path")
    ti.add_argument("--model", default=None, help="the model it reads (default: the one its files name)")
    ti.add_argument("--name", default=None, help="the set's name in lmscope")
    ti.add_argument("--format", default="auto", choices=["auto", "sparsify", "saelens", "circuit-tracer"])
    ti.add_argument("--json", action="store_true")
    te = tsub.add_parser("export", help="an lmscope set -> a new folder in another library's layout")
    te.add_argument("name")
    te.add_argument("path")
    te.add_argument("--format", required=True, choices=["sparsify", "saelens", "circuit-tracer"])
    te.add_argument("--json", action="store_true")
    for parser in (tl, ti, te):
        parser.set_defaults(func=cmd_transcoders)

    cd = sub.add_parser("card", help="architecture card computed from a config on the meta device: "
                        "llama-3.2-1b, gpt2, gpt3-175b, mistral-7b, deepseek-v2, granite-3b, or any model")
    cd.add_argument("name", help="a reference card name, a registry model, a fine-tuned model or a local folder")
    cd.add_argument("--json", action="store_true")
    cd.set_defaults(func=cmd_card)

    s = sub.add_parser("serve", help="start the web UI")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=7860)
    s.add_argument("--no-services", action="store_true",
                   help="do not start the embedded Redis and worker (use REDIS_URL and `lmscope worker`)")
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser("worker", help="run a Celery worker for background jobs")
    w.add_argument("--concurrency", type=int, default=1)
    w.set_defaults(func=cmd_worker)

    from tasks.cli import add_jobs_parser

    add_jobs_parser(sub, cmd_jobs)
    return p


def main(argv=None, environ=None) -> int:
    # read and checked once, here, before anything else reads them (building the parser imports the
    # job modules); `serve` also checks that the users file exists
    try:
        settings = Settings.from_env(environ, check_files=False)
        args = build_parser().parse_args(argv)
        if args.func is cmd_serve:
            settings = Settings.from_env(environ, check_files=True)
    except LmscopeError as e:
        configure_logging(Settings.log_level, "%(message)s")  # the settings are what failed: the default level
        log.error("error: bad configuration: %s", e)
        return 2
    # the one logging setup of this process; a Celery worker's is tasks.celery_app's (the same one)
    long_running = args.func in (cmd_serve, cmd_worker)
    configure_logging(settings.log_level, LOG_FORMAT if long_running else "%(message)s")
    args.settings = settings
    try:
        return args.func(args)
    except LmscopeError as e:
        log.error("error: %s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
