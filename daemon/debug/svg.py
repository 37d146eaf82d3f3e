"""Small self-contained SVG charts for the diagnosis report (no plotting dependency): a
CDF of several series, stacked horizontal bars, grouped histogram bars. Pure module; every
function returns one `<svg>` element as a string."""

from __future__ import annotations

from html import escape

COLORS = ("#3566a8", "#d9622b", "#3f9a4a", "#8a55b5", "#c23b5a", "#b0902c", "#4aa8b8",
          "#777777")
W, H = 560, 300
PAD_L, PAD_R, PAD_T, PAD_B = 64, 16, 28, 44


def _frame(title: str, body: list[str], width: int = W, height: int = H) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
            f'<rect width="100%" height="100%" fill="white"/>'
            f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13" '
            f'font-weight="bold">{escape(title)}</text>' + "".join(body) + "</svg>")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.1f}"
    return f"{v:.3g}"


def _legend(names: list[str], x: float, y: float) -> list[str]:
    out = []
    for i, name in enumerate(names):
        c = COLORS[i % len(COLORS)]
        out.append(f'<rect x="{x}" y="{y + 14 * i - 8}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{x + 14}" y="{y + 14 * i + 1}">{escape(name)}</text>')
    return out


def _axes(x_max: float, y_max: float, x_label: str, y_label: str, ticks: int = 5,
          x_min: float = 0.0) -> list[str]:
    x0, x1, y0, y1 = PAD_L, W - PAD_R, H - PAD_B, PAD_T
    out = [f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>',
           f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>',
           f'<text x="{(x0 + x1) / 2}" y="{H - 8}" text-anchor="middle">{escape(x_label)}'
           f'</text>',
           f'<text x="14" y="{(y0 + y1) / 2}" text-anchor="middle" '
           f'transform="rotate(-90 14 {(y0 + y1) / 2})">{escape(y_label)}</text>']
    for i in range(ticks + 1):
        fx = x0 + (x1 - x0) * i / ticks
        fy = y0 - (y0 - y1) * i / ticks
        out.append(f'<text x="{fx}" y="{y0 + 14}" text-anchor="middle">'
                   f'{_fmt(x_min + (x_max - x_min) * i / ticks)}</text>')
        out.append(f'<text x="{x0 - 4}" y="{fy + 4}" text-anchor="end">'
                   f'{_fmt(y_max * i / ticks)}</text>')
        out.append(f'<line x1="{x0}" y1="{fy}" x2="{x1}" y2="{fy}" stroke="#e4e4e4"/>')
    return out


def cdf(title: str, series: dict[str, list[float]], x_label: str, scale: float = 1.0) -> str:
    """Empirical CDFs, one step line per series; values multiplied by `scale` (1000: ms)."""
    xs_all = [v * scale for vals in series.values() for v in vals]
    if not xs_all:
        return _frame(title, [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data'
                              f'</text>'])
    x_max = max(xs_all) * 1.05 or 1.0
    body = _axes(x_max, 1.0, x_label, "fraction of requests")
    x0, x1, y0, y1 = PAD_L, W - PAD_R, H - PAD_B, PAD_T
    for i, (name, vals) in enumerate(series.items()):
        vs = sorted(v * scale for v in vals)
        if not vs:
            continue
        pts = [(x0, y0)]
        for k, v in enumerate(vs):
            px = x0 + (x1 - x0) * v / x_max
            pts.append((px, y0 - (y0 - y1) * k / len(vs)))
            pts.append((px, y0 - (y0 - y1) * (k + 1) / len(vs)))
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        body.append(f'<polyline points="{path}" fill="none" stroke-width="2" '
                    f'stroke="{COLORS[i % len(COLORS)]}"/>')
    body += _legend(list(series), x1 - 120, y1 + 16)
    return _frame(title, body)


def stacked_bars(title: str, bars: dict[str, dict[str, float]], x_label: str,
                 scale: float = 1.0) -> str:
    """One horizontal bar per key of `bars`, stacked from its segments (same segment names
    share a colour)."""
    segments: list[str] = []
    for segs in bars.values():
        for s in segs:
            if s not in segments:
                segments.append(s)
    total = max((sum(v * scale for v in segs.values()) for segs in bars.values()), default=0)
    x_max = total * 1.05 or 1.0
    height = PAD_T + 40 * len(bars) + 30 + 14 * len(segments) + 20
    x0, x1 = 90, W - PAD_R
    body = []
    for i, (name, segs) in enumerate(bars.items()):
        y = PAD_T + 10 + 40 * i
        body.append(f'<text x="{x0 - 6}" y="{y + 16}" text-anchor="end">{escape(name)}</text>')
        x = x0
        for s, v in segs.items():
            w = (x1 - x0) * v * scale / x_max
            c = COLORS[segments.index(s) % len(COLORS)]
            body.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0):.1f}" height="24" '
                        f'fill="{c}"><title>{escape(s)}: {_fmt(v * scale)}</title></rect>')
            x += w
        body.append(f'<text x="{x + 4:.1f}" y="{y + 16}">'
                    f'{_fmt(sum(segs.values()) * scale)}</text>')
    axis_y = PAD_T + 10 + 40 * len(bars)
    body.append(f'<line x1="{x0}" y1="{axis_y}" x2="{x1}" y2="{axis_y}" stroke="black"/>')
    for k in range(6):
        fx = x0 + (x1 - x0) * k / 5
        body.append(f'<text x="{fx}" y="{axis_y + 14}" text-anchor="middle">'
                    f'{_fmt(x_max * k / 5)}</text>')
    body.append(f'<text x="{(x0 + x1) / 2}" y="{axis_y + 28}" text-anchor="middle">'
                f'{escape(x_label)}</text>')
    body += _legend(segments, x0, axis_y + 46)
    return _frame(title, body, height=height)


def histogram(title: str, series: dict[str, list[float]], x_label: str, bins: int = 12) -> str:
    """Grouped bars: the series' counts per bin over a common range."""
    xs = [v for vals in series.values() for v in vals]
    if not xs:
        return _frame(title, [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data'
                              f'</text>'])
    lo, hi = min(xs), max(xs)
    width = (hi - lo) / bins if hi > lo else 1.0
    counts = {name: [0] * bins for name in series}
    for name, vals in series.items():
        for v in vals:
            counts[name][min(bins - 1, int((v - lo) / width))] += 1
    y_max = max(max(c) for c in counts.values()) * 1.1 or 1
    body = _axes(lo + width * bins, y_max, x_label, "requests", x_min=lo)
    x0, x1, y0, y1 = PAD_L, W - PAD_R, H - PAD_B, PAD_T
    slot = (x1 - x0) / bins
    bar = slot * 0.8 / max(1, len(series))
    for i, (name, c) in enumerate(counts.items()):
        for k, n in enumerate(c):
            h = (y0 - y1) * n / y_max
            x = x0 + slot * k + slot * 0.1 + bar * i
            body.append(f'<rect x="{x:.1f}" y="{y0 - h:.1f}" width="{bar:.1f}" '
                        f'height="{h:.1f}" fill="{COLORS[i % len(COLORS)]}">'
                        f'<title>{escape(name)}: {n} in [{_fmt(lo + width * k)}, '
                        f'{_fmt(lo + width * (k + 1))})</title></rect>')
    body += _legend(list(series), x1 - 120, y1 + 16)
    return _frame(title, body)
