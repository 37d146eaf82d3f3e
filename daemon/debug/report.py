"""Renderings of a `Diagnosis`: the before/after table as text (the terminal), a JSON
object (`--json`, for machines), and a self-contained HTML page with SVG plots (`--html`,
for people: latency CDFs per cohort, per-phase stacked bars, first-miss position histogram).
Pure module."""

from __future__ import annotations

import dataclasses
from html import escape

from tokenloom.daemon.debug import svg
from tokenloom.daemon.debug.diagnose import Diagnosis, render_diff
from tokenloom.daemon.debug.mechanisms import ms, pct
from tokenloom.daemon.debug.samples import PHASES
from tokenloom.daemon.debug.summary import Dist, Summary


def _d(d: Dist) -> str:
    return f"{ms(d.p50)} / {ms(d.p95)}"


def _num(x, fmt="{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def rows(diag: Diagnosis) -> list[tuple[str, str, str]]:
    """(label, before, after) of the table, in the essay's order: symptom, phases, work,
    cache, memory, batching, splits."""
    b, a = diag.before.summary, diag.after.summary
    out = [("requests (errors)", f"{b.requests} ({b.errors})", f"{a.requests} ({a.errors})"),
           ("TTFT p50 / p95", _d(b.ttft), _d(a.ttft)),
           ("TPOT p50 / p95", _d(b.tpot), _d(a.tpot)),
           ("ITL p50 / p95", _d(b.itl), _d(a.itl)),
           ("e2e p50 / p95", _d(b.e2e), _d(a.e2e))]
    for phase in PHASES:
        if phase in b.phases or phase in a.phases:
            none = Dist(None, None, None, 0)
            out.append((f"  TTFT phase {phase} p50 / p95", _d(b.phases.get(phase, none)),
                        _d(a.phases.get(phase, none))))

    def both(label, f):
        out.append((label, f(b), f(a)))
    both("prompt tokens / request", lambda s: f"{s.prompt_tokens_mean:.0f}")
    both("prefill tokens / request", lambda s: f"{s.prefill_tokens_mean:.0f}")
    both("prefix-cache hit rate", lambda s: pct(s.hit_rate))
    both("first-miss position p50", lambda s: _num(_p50(s.first_miss_positions), "{:.0f}"))
    both("first-miss reasons", lambda s: ", ".join(f"{k} {v}" for k, v in
                                                   sorted(s.miss_reasons.items())) or "-")
    both("preemptions / request", lambda s: f"{s.preemptions_per_request:.2f}")
    both("KV-plan refusals / request", lambda s: f"{s.kv_refusals_per_request:.1f}")
    both("peak KV pool usage", lambda s: pct(s.server.get("kv_usage_max")))
    both("waiting requests (mean)", lambda s: _num(s.server.get("waiting_mean")))
    both("prefill tokens / chunk", lambda s: _num(s.prefill_tokens_per_chunk, "{:.0f}"))
    both("longest decode gap p95", lambda s: ms(s.decode_max_gap.p95))
    both("decode batch size (mean)", lambda s: _num(s.server.get("decode_batch_size_mean")))
    both("speculative acceptance", lambda s: pct(s.spec_acceptance))
    both("graph replay share", lambda s: pct(s.server.get("graph_replay_share")))
    for kind, attr in (("tenant", "tenants"), ("worker", "workers")):
        keys = sorted(set(getattr(b, attr)) | set(getattr(a, attr)))
        if not keys:
            continue
        for k in keys:
            out.append((f"{kind} {k}: requests, token share, p95 TTFT",
                        _group(getattr(b, attr).get(k)), _group(getattr(a, attr).get(k))))
    return out


def _p50(xs):
    from tokenloom.daemon.debug.summary import percentile
    return percentile(xs, 50)


def _group(g) -> str:
    if g is None:
        return "-"
    return f"{g.requests}, {pct(g.prompt_token_share)}, {ms(g.ttft.p95)}"


def text(diag: Diagnosis, tokenizer=None) -> str:
    table = rows(diag)
    w0 = max(len(r[0]) for r in table)
    w1 = max(len(r[1]) for r in table + [("", diag.before.name, "")])
    lines = [f"{'':<{w0}}  {diag.before.name:<{w1}}  {diag.after.name}"]
    lines += [f"{label:<{w0}}  {x:<{w1}}  {y}" for label, x, y in table]
    lines.append("")
    lines.append("Mechanisms (ranked; score >= 1 is significant):")
    if not diag.findings:
        lines.append("  none")
    for f in diag.findings:
        mark = "*" if f.significant else " "
        lines.append(f" {mark} {f.name:<22} score {f.score:5.2f}  {f.title}")
        for e in f.evidence:
            lines.append(f"      {e}")
    if diag.prefix_diff is not None:
        lines.append("")
        lines.append("Token-level prefix diff of a representative request:")
        lines.append(render_diff(diag.prefix_diff, diag.block_size or 16, tokenizer))
    lines.append("")
    lines.append("Incident: " + diag.sentence)
    return "\n".join(lines)


def _summary_json(s: Summary) -> dict:
    out = dataclasses.asdict(s)
    out["spec_acceptance"] = s.spec_acceptance
    out.pop("first_miss_positions")
    return out


def as_json(diag: Diagnosis) -> dict:
    top = diag.top
    return {
        "sentence": diag.sentence,
        "top_mechanism": top.name if top is not None else None,
        "significant_change": top is not None or "no significant change" not in
        diag.sentence.lower(),
        "symptoms": {s.metric: {"before": dataclasses.asdict(s.before),
                                "after": dataclasses.asdict(s.after), "verdict": s.verdict,
                                "p_value": s.p_value} for s in (diag.ttft, diag.tpot)},
        "mechanisms": [{"name": f.name, "title": f.title, "score": round(f.score, 3),
                        "significant": f.significant, "symptom": f.symptom,
                        "evidence": f.evidence, "figures": f.figures} for f in diag.findings],
        "before": _summary_json(diag.before.summary),
        "after": _summary_json(diag.after.summary),
        "table": [list(r) for r in rows(diag)],
        "prefix_diff": ({k: v for k, v in diag.prefix_diff.items()}
                        if diag.prefix_diff is not None else None),
    }


_CSS = """body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
.sentence{font-size:16px;background:#fff6e0;border-left:4px solid #d9622b;padding:10px 14px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px}
th{background:#f0f0f0;text-align:left}.sig{font-weight:bold}
.plots{display:flex;flex-wrap:wrap;gap:12px}pre{background:#f6f6f6;padding:8px;font-size:12px}
"""


def html(diag: Diagnosis, tokenizer=None) -> str:
    b, a = diag.before, diag.after
    names = (b.name, a.name)
    if names[0] == names[1]:
        names = (names[0] + " (before)", names[1] + " (after)")

    def series(get):
        return {names[0]: [v for s in b.samples if s.ok and (v := get(s)) is not None],
                names[1]: [v for s in a.samples if s.ok and (v := get(s)) is not None]}
    plots = [svg.cdf("TTFT per request (CDF)", series(lambda s: s.ttft), "TTFT (ms)", 1000),
             svg.cdf("TPOT per request (CDF)", series(lambda s: s.tpot), "TPOT (ms)", 1000)]
    bars = {}
    for name, c in zip(names, (b, a)):
        bars[name] = {p: (c.summary.phases[p].mean or 0.0) for p in PHASES
                      if p in c.summary.phases}
    plots.append(svg.stacked_bars("Mean TTFT by phase", bars, "ms", 1000))
    plots.append(svg.histogram("First prefix-cache miss position",
                               series(lambda s: float(s.cached_tokens)),
                               "cached tokens before the first miss"))
    tenants = set(b.summary.tenants) | set(a.summary.tenants)
    if len(tenants) > 1:
        plots.append(svg.cdf("TTFT per tenant (CDF)",
                             {f"{n}: {t}": [s.ttft for s in c.samples
                                            if s.ok and s.tenant == t and s.ttft is not None]
                              for n, c in zip(names, (b, a)) for t in sorted(tenants)},
                             "TTFT (ms)", 1000))
    table = "".join(f"<tr><td>{escape(r[0])}</td><td>{escape(r[1])}</td>"
                    f"<td>{escape(r[2])}</td></tr>" for r in rows(diag))
    mech = "".join(
        f"<tr class=\"{'sig' if f.significant else ''}\"><td>{escape(f.name)}</td>"
        f"<td>{f.score:.2f}</td><td>{escape(f.title)}</td>"
        f"<td>{'<br>'.join(escape(e) for e in f.evidence)}</td></tr>" for f in diag.findings)
    diff = ""
    if diag.prefix_diff is not None:
        diff = (f"<h2>Token-level prefix diff of a representative request</h2><pre>"
                f"{escape(render_diff(diag.prefix_diff, diag.block_size or 16, tokenizer))}"
                f"</pre>")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>tokenloom diagnose: "
            f"{escape(names[0])} vs {escape(names[1])}</title><style>{_CSS}</style></head>"
            f"<body><h1>tokenloom diagnose: {escape(names[0])} &rarr; {escape(names[1])}</h1>"
            f"<p class=\"sentence\">{escape(diag.sentence)}</p>"
            f"<div class=\"plots\">{''.join(plots)}</div>"
            f"<h2>Before / after</h2><table><tr><th></th><th>{escape(names[0])}</th>"
            f"<th>{escape(names[1])}</th></tr>{table}</table>"
            f"<h2>Mechanisms (ranked)</h2><table><tr><th>mechanism</th><th>score</th>"
            f"<th></th><th>evidence</th></tr>{mech or '<tr><td>none</td></tr>'}</table>"
            f"{diff}</body></html>")
