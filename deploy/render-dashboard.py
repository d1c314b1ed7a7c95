#!/usr/bin/python3
"""Draws the Grafana dashboard's panels into one PNG from a Prometheus server's query API.

Grafana is not packaged for Debian 12, so the README's picture is made here: every panel of
deploy/grafana/dashboards/pagedattn.json, at its grid position, with its own PromQL, legend
format, unit, stacking and thresholds, evaluated over [start, end] through
/api/v1/query_range. Grafana variables become: $instance -> .* (all instances),
$__rate_interval -> --rate-interval.

  apt-get install -y --no-install-recommends python3-matplotlib   # once, by hand (a doc tool)
  deploy/render-dashboard.py --prometheus=http://127.0.0.1:9090 --minutes=10 --out=dash.png

deploy/demo-dashboard.sh runs the whole thing: server, Prometheus, CLI load, this script.
"""
import argparse
import datetime
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

BG, PANEL, GRID, TEXT, DIM = "#111217", "#181b1f", "#2c3036", "#d8d9da", "#8e8e8e"
PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9",
           "#fade2a", "#c4162a", "#96d98d", "#ffb357", "#ca95e5"]
NAMED = {"green": "#73bf69", "yellow": "#f2cc0c", "red": "#f2495c", "orange": "#ff780a",
         "blue": "#5794f2"}


def query_range(base, expr, start, end, step):
    url = f"{base}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def substitute(expr, rate_interval):
    expr = expr.replace("${__rate_interval}", rate_interval).replace("$__rate_interval", rate_interval)
    return re.sub(r"\$\{?instance\}?", ".*", expr)


def legend(fmt, labels):
    if not fmt:
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def fmt_value(v, unit):
    if v is None or math.isnan(v):
        return "n/a"
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    if unit == "s":
        a = abs(v)
        if a == 0:
            return "0 s"
        if a < 1e-3:
            return f"{v * 1e6:.0f} µs"
        if a < 1:
            return f"{v * 1e3:.1f} ms"
        return f"{v:.2f} s"
    suffix = " req/s" if unit == "reqps" else ""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.1f}M{suffix}"
    if a >= 1e3:
        return f"{v / 1e3:.1f}k{suffix}"
    if a >= 100 or v == int(v):
        return f"{v:.0f}{suffix}"
    return f"{v:.2f}{suffix}"


def threshold_color(value, steps):
    color = NAMED.get(steps[0]["color"], steps[0]["color"]) if steps else PALETTE[0]
    for s in steps:
        if s.get("value") is not None and value is not None and value >= s["value"]:
            color = NAMED.get(s["color"], s["color"])
    return color


def series_points(result):
    out = []
    for r in result:
        xs, ys = [], []
        for t, v in r["values"]:
            xs.append(mdates.date2num(datetime.datetime.fromtimestamp(float(t))))
            ys.append(float(v))
        out.append((r["metric"], xs, ys))
    return out


def draw_timeseries(ax, panel, data, window):
    defaults = panel["fieldConfig"]["defaults"]
    unit = defaults.get("unit", "short")
    stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "stack" or \
        defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
    right = {o["matcher"]["options"] for o in panel["fieldConfig"].get("overrides", [])
             for p in o["properties"] if p["id"] == "custom.axisPlacement" and p["value"] == "right"}
    ax2 = ax.twinx() if right else None
    lines, base = [], None
    color_i = 0
    for target, result in data:
        for labels, xs, ys in series_points(result):
            name = legend(target.get("legendFormat"), labels)
            color = PALETTE[color_i % len(PALETTE)]
            color_i += 1
            ys_clean = [y if math.isfinite(y) else float("nan") for y in ys]
            axis = ax2 if name in right else ax
            if stacked:
                lower = base if base is not None and len(base) == len(ys_clean) else [0.0] * len(ys_clean)
                upper = [lo + (0 if math.isnan(y) else y) for lo, y in zip(lower, ys_clean)]
                axis.fill_between(xs, lower, upper, color=color, alpha=0.35, linewidth=0)
                (line,) = axis.plot(xs, upper, color=color, linewidth=1.4, label=name)
                base = upper
            else:
                axis.fill_between(xs, 0, [0 if math.isnan(y) else y for y in ys_clean],
                                  color=color, alpha=0.08, linewidth=0)
                (line,) = axis.plot(xs, ys_clean, color=color, linewidth=1.4, label=name)
            lines.append(line)
    formatter = FuncFormatter(lambda v, _: fmt_value(v, unit))
    for axis in [a for a in (ax, ax2) if a is not None]:
        axis.yaxis.set_major_formatter(formatter)
        axis.tick_params(colors=DIM, labelsize=7)
        axis.set_ylim(bottom=0)
        for side in axis.spines.values():
            side.set_visible(False)
    ax.grid(True, color=GRID, linewidth=0.6)
    ax.set_xlim(*window)
    span_min = (window[1] - window[0]) * 24 * 60
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S" if span_min < 15 else "%H:%M"))
    if not lines:
        ax.text(0.5, 0.5, "No data", color=DIM, ha="center", va="center", transform=ax.transAxes)
    else:
        ncol = min(len(lines), 4 if len(lines) <= 8 else 6)
        ax.legend(handles=lines, loc="upper left", bbox_to_anchor=(0, -0.1), ncol=ncol,
                  frameon=False, fontsize=7 if len(lines) <= 8 else 6, labelcolor=TEXT,
                  handlelength=1.2, columnspacing=1.0, labelspacing=0.2)


def draw_stat(ax, panel, data):
    defaults = panel["fieldConfig"]["defaults"]
    unit = defaults.get("unit", "short")
    steps = defaults.get("thresholds", {}).get("steps", [])
    points = [p for _, result in data for p in series_points(result)]
    value, xs, ys = None, [], []
    if points:
        _, xs, ys = points[0]
        finite = [y for y in ys if math.isfinite(y)]
        value = finite[-1] if finite else None
    color = threshold_color(value, steps)
    ax.set_facecolor(color)
    if xs:
        ax.fill_between(xs, 0, [y if math.isfinite(y) else 0 for y in ys], color="white",
                        alpha=0.18, linewidth=0)
        top = max([y for y in ys if math.isfinite(y)] + [1e-12])
        ax.set_ylim(0, top * 2.2)
        ax.set_xlim(xs[0], xs[-1])
    text = fmt_value(value, unit)
    if unit == "none" and value is not None:
        text = f"{value:.0f}"
    ax.text(0.5, 0.5, text, color="white", fontsize=20, fontweight="bold", ha="center",
            va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", default="http://127.0.0.1:9090")
    p.add_argument("--dashboard", default="deploy/grafana/dashboards/pagedattn.json")
    p.add_argument("--minutes", type=float, default=15, help="window ending at --end")
    p.add_argument("--end", type=float, default=None, help="unix time (default: now)")
    p.add_argument("--rate-interval", default="1m", help="stands for $__rate_interval")
    p.add_argument("--out", default="deploy/dashboard.png")
    p.add_argument("--dpi", type=int, default=72)
    args = p.parse_args()

    with open(args.dashboard) as f:
        dash = json.load(f)
    end = args.end or time.time()
    start = end - args.minutes * 60
    step = max(1.0, (end - start) / 300)
    window = tuple(mdates.date2num(datetime.datetime.fromtimestamp(t)) for t in (start, end))

    panels = dash["panels"]
    rows = max(pn["gridPos"]["y"] + pn["gridPos"]["h"] for pn in panels)
    col_in, row_in, title_in = 0.8, 0.36, 0.5
    fig = plt.figure(figsize=(24 * col_in, rows * row_in + title_in), facecolor=BG)
    fig_h = rows * row_in + title_in
    fig.text(0.008, 1 - 0.3 / fig_h, f"{dash['title']}  ·  instance: All  ·  last "
             f"{args.minutes:g} min  ·  drawn from Prometheus query_range (same PromQL as the "
             "Grafana dashboard)", color=TEXT, fontsize=11, va="center")
    for pn in panels:
        g = pn["gridPos"]
        pad_x, pad_top, pad_bottom = 0.12, 0.42, 0.12
        legend_room = 0.55 if pn["type"] == "timeseries" else 0.0
        left = (g["x"] * col_in + pad_x + (0.55 if pn["type"] == "timeseries" else 0)) / (24 * col_in)
        width = (g["w"] * col_in - 2 * pad_x - (1.1 if pn["type"] == "timeseries" else 0)) / (24 * col_in)
        top_in = title_in + g["y"] * row_in
        bottom_in = top_in + g["h"] * row_in
        bottom = 1 - (bottom_in - pad_bottom - legend_room) / fig_h
        height = (g["h"] * row_in - pad_top - pad_bottom - legend_room) / fig_h
        # The panel's card, then its plot inside.
        card = fig.add_axes([(g["x"] * col_in + 0.05) / (24 * col_in), 1 - (bottom_in - 0.05) / fig_h,
                             (g["w"] * col_in - 0.1) / (24 * col_in), (g["h"] * row_in - 0.1) / fig_h])
        card.set_facecolor(PANEL)
        card.set_xticks([])
        card.set_yticks([])
        for side in card.spines.values():
            side.set_color(GRID)
        card.text(0.01, 1 - 0.2 / (g["h"] * row_in), pn["title"], color=TEXT, fontsize=9,
                  fontweight="bold", va="center", transform=card.transAxes)
        ax = fig.add_axes([left, bottom, width, height])
        ax.set_facecolor(PANEL)
        data = []
        for t in pn.get("targets", []):
            expr = substitute(t["expr"], args.rate_interval)
            data.append((t, query_range(args.prometheus, expr, start, end, step)))
        if pn["type"] == "stat":
            draw_stat(ax, pn, data)
        else:
            draw_timeseries(ax, pn, data, window)
    fig.savefig(args.out, dpi=args.dpi, facecolor=BG)
    print(f"wrote {args.out} ({len(panels)} panels, {args.minutes:g} min ending "
          f"{time.strftime('%H:%M:%S', time.localtime(end))})")


if __name__ == "__main__":
    sys.exit(main())
