"""The diagnosis core on synthetic cohorts (no server): each mechanism, planted in the
numbers a tokenloom replay would carry, comes out on top with its figures in the sentence;
the same cohort twice gives "no significant change"; causes rank before consequences."""

from __future__ import annotations

import html
import random

import pytest

from tokenloom.daemon.debug import capture as C
from tokenloom.daemon.debug import report
from tokenloom.daemon.debug.diagnose import diagnose, mann_whitney_p
from tokenloom.daemon.debug.samples import from_record, phases_of


def response(i, *, prompt=200, cached=160, ttft=0.02, gap=0.005, tokens=8, tenant="a",
             worker=None, preemptions=0, refusals=0, chunks=1, max_gap=None, drafted=0,
             accepted=0, reason="partial_block", queue=0.001, prefill=None, ids=None):
    """A replay's `response` line shaped like tokenloom's (usage, metrics, trace)."""
    prefill = prefill if prefill is not None else ttft * 0.6
    t_routed, t_lookup = 0.0005, 0.0005 + queue
    t_pf = t_lookup + 0.0002
    t_first = max(ttft - 0.0005, t_pf + prefill + 0.0001)
    trace = {"request_id": f"cmpl-{i}", "tenant": tenant,
             "events": [{"event": "request_received", "t": 0.0},
                        {"event": "tokenized", "t": t_routed / 2},
                        {"event": "routed", "t": t_routed},
                        {"event": "prefix_cache_lookup_done", "t": t_lookup},
                        {"event": "admitted", "t": t_lookup},
                        {"event": "prefill_started", "t": t_pf},
                        {"event": "prefill_finished", "t": t_pf + prefill},
                        {"event": "first_token", "t": t_first}],
             "prefill_chunks": chunks, "kv_refusals": refusals,
             "decode": {"iterations": tokens - 1, "mean_gap_s": gap,
                        "max_gap_s": max_gap if max_gap is not None else gap * 1.5},
             "preemptions": [{}] * preemptions,
             "speculation": ({"drafted": drafted, "accepted": accepted} if drafted else None)}
    if worker is not None:
        trace["routing"] = {"worker": worker}
    return {"kind": "response", "index": i, "t": i * 0.05, "endpoint": "chat",
            "tenant": tenant, "status": 200, "error": None, "ttft": ttft,
            "itl": [gap] * (tokens - 1), "e2e": ttft + gap * (tokens - 1),
            "usage": {"prompt_tokens": prompt, "completion_tokens": tokens,
                      "prompt_tokens_details": {"cached_tokens": cached}},
            "metrics": {"time_to_first_token": t_first, "cached_tokens": cached,
                        "num_preemptions": preemptions,
                        "prefix_cache": [{"index": 0, "hit_blocks": cached // 16,
                                          "cached_tokens": cached,
                                          "first_miss_reason": reason}],
                        "trace": [trace]},
            "prompt_token_ids": ids}


def cohort(n=40, seed=0, **kw):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        jitter = 1 + 0.1 * rng.random()
        args = {k: (v(i) if callable(v) else v) for k, v in kw.items()}
        for key in ("ttft", "gap"):
            if key in args:
                args[key] = args[key] * jitter
            else:
                args[key] = {"ttft": 0.02, "gap": 0.005}[key] * jitter
        out.append(response(i, **args))
    return C.Capture({"kind": "header", "source": "replay", "block_size": 16}, out)


def test_phases_sum_to_the_client_ttft():
    rec = response(0, ttft=0.05)
    s = from_record(rec, 0)
    assert abs(sum(s.phases.values()) - 0.05) < 1e-9
    assert list(s.phases) == ["tokenization", "routing", "queue", "prefix_lookup", "prefill_wait",
                              "prefill", "first_decode", "stream"]
    # A trace without `tokenized` (or the later events): only the phases that ended.
    assert set(phases_of({"events": [{"event": "request_received", "t": 0},
                                     {"event": "routed", "t": 0.1}]})) == {"tokenize_route"}


def test_mann_whitney():
    xs = [i * 0.01 for i in range(30)]
    assert mann_whitney_p(xs, xs) > 0.5
    assert mann_whitney_p(xs, [x + 1 for x in xs]) < 1e-6
    assert mann_whitney_p(xs[:3], xs) is None


def test_same_cohort_twice_is_no_significant_change():
    d = diagnose(cohort(seed=1), cohort(seed=2))
    assert d.top is None
    assert d.sentence.startswith("No significant change")
    assert report.as_json(d)["significant_change"] is False


def test_prefix_layout_names_divergence_hit_rate_and_healthy_tpot():
    stable = [5] * 150
    before = cohort(prompt=200, cached=144, ttft=0.02,
                    ids=lambda i: stable + [100 + i] * 50)
    after = cohort(prompt=200, cached=0, ttft=0.08, reason="no_prefix", prefill=0.07,
                   ids=lambda i: [100 + i] * 50 + stable)
    d = diagnose(before, after)
    assert d.top.name == "prefix_layout"
    s = d.sentence
    assert s.startswith("p95 TTFT regressed") and "72%" in s and "0%" in s
    assert "diverge from each other at token 0 (was 150)" in s
    assert "TPOT stayed healthy" in s
    assert d.prefix_diff is not None and d.prefix_diff["after"]["common"] == 0
    assert d.prefix_diff["before"]["common"] == 150
    assert "first difference at token 0" in report.text(d)


def test_eviction_is_told_from_layout_by_the_miss_reason():
    d = diagnose(cohort(cached=144), cohort(cached=0, reason="evicted", ttft=0.06))
    assert d.top.name == "prefix_eviction" and "evicted" in d.sentence


def test_noisy_tenant_is_the_cause_and_kv_pressure_its_consequence():
    before = cohort(tenant=lambda i: "a" if i % 2 else "b", prompt=200, cached=0)
    after = cohort(tenant=lambda i: "a" if i % 4 == 0 else "flood",
                   prompt=lambda i: 200 if i % 4 == 0 else 1800, cached=0,
                   ttft=lambda i: 0.2, preemptions=lambda i: 1 if i % 3 == 0 else 0,
                   queue=0.15)
    d = diagnose(before, after)
    assert d.top.name == "noisy_tenant", report.text(d)
    assert "'flood'" in d.sentence
    names = [f.name for f in d.findings if f.significant]
    assert "kv_pressure" in names and names.index("kv_pressure") > 0
    assert "preemptions" in d.sentence   # the consequence is named


def test_kv_pressure():
    d = diagnose(cohort(cached=0), cohort(cached=0, preemptions=lambda i: i % 2,
                                          refusals=5, ttft=0.09))
    assert d.top.name == "kv_pressure" and "preemptions per request rose 0.00 -> 0.50" \
        in d.sentence


def test_prefill_interference():
    d = diagnose(cohort(chunks=8, prompt=1000, cached=0, max_gap=0.01),
                 cohort(chunks=1, prompt=1000, cached=0, max_gap=0.05, gap=0.009))
    assert d.top.name == "prefill_interference"
    assert d.top.symptom == "tpot" and d.sentence.startswith("p95 TPOT regressed")
    assert "125 to 1000 tokens" in d.sentence


def test_spec_collapse():
    d = diagnose(cohort(drafted=40, accepted=32), cohort(drafted=40, accepted=4, gap=0.012))
    assert d.top.name == "spec_collapse" and "80% -> 10%" in d.sentence


def test_router_imbalance():
    d = diagnose(cohort(worker=lambda i: i % 2),
                 cohort(worker=lambda i: 0 if i % 10 else 1, ttft=0.05))
    assert d.top.name == "router_imbalance" and "90% of the requests to worker 0" in d.sentence


def test_compute_slowdown_needs_both_prefill_and_decode_slower():
    """The same work (same prompts, hits, batching) 3x slower per prefill token and per
    decode gap is `compute_slowdown`; 2x (under its 2.5x threshold), or only the decode
    gaps slower, is not significant."""
    d = diagnose(cohort(prefill=0.010, ttft=0.02), cohort(prefill=0.030, ttft=0.04, gap=0.015))
    assert d.top is not None and d.top.name == "compute_slowdown", report.text(d)
    assert "the same work ran slower" in d.sentence and d.top.symptom == "tpot"
    pb, pa = d.top.figures["prefill_s_per_token_p50"]
    assert pa / pb == pytest.approx(3.0)
    for slower in (cohort(prefill=0.020, ttft=0.03, gap=0.010),      # 2x: below threshold
                   cohort(prefill=0.010, ttft=0.02, gap=0.015)):     # decode only
        d = diagnose(cohort(prefill=0.010, ttft=0.02), slower)
        assert d.top is None, report.text(d)


def test_html_report_has_the_plots(tmp_path):
    d = diagnose(cohort(cached=144), cohort(cached=0, reason="no_prefix", ttft=0.06))
    page = report.html(d)
    assert page.count("<svg") >= 4 and "polyline" in page and html.escape(d.sentence) in page
    assert "First prefix-cache miss position" in page and "Mean TTFT by phase" in page


def test_html_report_renders_in_chromium(tmp_path):
    """The report opens in a real browser (headless Chromium) and the plots are drawn: the
    screenshot is not blank and holds both cohorts' colours (before blue, after orange)."""
    import numpy as np
    import screenshot

    from tokenloom.daemon.debug.svg import COLORS

    if screenshot.chromium() is None:
        pytest.skip("chromium is not installed (make test installs it: apt-get install -y "
                    "chromium)")
    d = diagnose(cohort(cached=144), cohort(cached=0, reason="no_prefix", ttft=0.06))
    page, png = tmp_path / "report.html", tmp_path / "report.png"
    page.write_text(report.html(d), encoding="utf-8")
    screenshot.screenshot(page, png, size=(1280, 1800))
    w, h, px = screenshot.png_rgb(png)
    assert (w, h) == (1280, 1800)
    assert (px.min(axis=2) < 240).mean() > 0.02          # not a blank page
    for colour in COLORS[:2]:
        rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
        drawn = np.all(np.abs(px.astype(int) - rgb) < 12, axis=2).sum()
        assert drawn > 500, f"{colour} (a cohort's series) is not on the screenshot"


def test_diagnose_cli_text_json_and_html(tmp_path, capsys):
    import json

    from tokenloom.daemon.__main__ import main

    for name, cap in (("b", cohort(cached=144)), ("a", cohort(cached=0, reason="no_prefix",
                                                               ttft=0.06))):
        C.write(tmp_path / f"{name}.jsonl", cap.header, cap.records)
    html = tmp_path / "r.html"
    assert main(["diagnose", str(tmp_path / "b.jsonl"), str(tmp_path / "a.jsonl"), "--json",
                 "--html", str(html)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["top_mechanism"] == "prefix_layout" and out["significant_change"] is True
    assert out["sentence"].startswith("p95 TTFT regressed") and "<svg" in html.read_text()
    assert main(["diagnose", str(tmp_path / "b.jsonl"), str(tmp_path / "b.jsonl")]) == 0
    assert "Incident: No significant change" in capsys.readouterr().out
