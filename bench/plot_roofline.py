#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Draws a roofline chart (SVG, no dependencies) from moe_bench_hotpath's JSON output.

Usage: python3 bench/plot_roofline.py results.json roofline.svg
The roof is min(peak FMA FLOP/s, arithmetic intensity x read bandwidth), both measured in the same
run around every layer row (counters peak_GFLOP/s and bw_GB/s; the roof drawn uses their medians
over the rows); each point is one BM_Layer_* benchmark's fastest iteration at its FLOP/B.
"""
import json
import math
import sys


def main(src, dst):
    data = json.load(open(src))
    points, peaks, bws = [], [], []
    for b in data["benchmarks"]:
        name = b["name"]
        if not name.startswith("BM_Layer_") or "FLOP/B" not in b:
            continue
        peaks.append(b["peak_GFLOP/s"])
        bws.append(b["bw_GB/s"])
        gflops = b.get("best_GFLOP/s", b["GFLOP/s"])
        points.append((name.replace("BM_Layer_", "").replace("/manual_time", "").replace("/real_time", "").replace("/min_time:1.500", ""), b["FLOP/B"], gflops))
    if not points:
        sys.exit("no BM_Layer_* results with FLOP/B in " + src)
    peak = sorted(peaks)[len(peaks) // 2]
    bw = sorted(bws)[len(bws) // 2]
    W, H, M = 900, 600, 70
    xmin, xmax = 0.1, max(p[1] for p in points) * 4
    ymin, ymax = 1.0, peak * 2

    def X(v):
        return M + (math.log10(v) - math.log10(xmin)) / (math.log10(xmax) - math.log10(xmin)) * (W - 2 * M)

    def Y(v):
        return H - M - (math.log10(v) - math.log10(ymin)) / (math.log10(ymax) - math.log10(ymin)) * (H - 2 * M)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W/2}" y="25" text-anchor="middle" font-size="15">moe MoeFfn roofline '
           f'(peak {peak:.0f} GFLOP/s, read bandwidth {bw:.1f} GB/s: medians of the rows\' measured limits)</text>']
    for d in range(int(math.floor(math.log10(xmin))), int(math.ceil(math.log10(xmax))) + 1):
        v = 10 ** d
        if xmin <= v <= xmax:
            out.append(f'<line x1="{X(v):.1f}" y1="{M}" x2="{X(v):.1f}" y2="{H-M}" stroke="#ddd"/>')
            out.append(f'<text x="{X(v):.1f}" y="{H-M+15}" text-anchor="middle">{v:g}</text>')
    for d in range(0, int(math.ceil(math.log10(ymax))) + 1):
        v = 10 ** d
        if ymin <= v <= ymax:
            out.append(f'<line x1="{M}" y1="{Y(v):.1f}" x2="{W-M}" y2="{Y(v):.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{M-5}" y="{Y(v)+4:.1f}" text-anchor="end">{v:g}</text>')
    out.append(f'<text x="{W/2}" y="{H-25}" text-anchor="middle">arithmetic intensity (FLOP per byte of active weights)</text>')
    out.append(f'<text x="20" y="{H/2}" transform="rotate(-90 20 {H/2})" text-anchor="middle">GFLOP/s</text>')
    ridge = peak / bw
    roof = [(xmin, xmin * bw), (ridge, peak), (xmax, peak)]
    out.append('<polyline fill="none" stroke="black" stroke-width="2" points="' +
               " ".join(f"{X(a):.1f},{Y(max(ymin, b)):.1f}" for a, b in roof) + '"/>')
    colors = {"Qwen3": "#1f77b4", "OLMoE": "#2ca02c", "Mixtral": "#d62728", "DeepSeekV3": "#9467bd"}
    for label, ai, g in points:
        shape = label.split("_")[0]
        c = colors.get(shape, "#555")
        filled = "none" if "Backward" in label else c
        marker = "rect" if "Bf16" in label else "circle"
        if marker == "circle":
            out.append(f'<circle cx="{X(ai):.1f}" cy="{Y(max(ymin, g)):.1f}" r="4" fill="{filled}" stroke="{c}"/>')
        else:
            out.append(f'<rect x="{X(ai)-4:.1f}" y="{Y(max(ymin, g))-4:.1f}" width="8" height="8" fill="{filled}" stroke="{c}"/>')
        out.append(f'<title>{label}: {g:.1f} GFLOP/s at {ai:.2f} FLOP/B</title>')
    y0 = M + 10
    for shape, c in colors.items():
        out.append(f'<circle cx="{W-M-120}" cy="{y0}" r="4" fill="{c}"/><text x="{W-M-110}" y="{y0+4}">{shape}</text>')
        y0 += 16
    out.append(f'<text x="{W-M-125}" y="{y0+4}">filled: forward, open: fwd+bwd, square: bf16</text>')
    out.append("</svg>")
    open(dst, "w").write("\n".join(out))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
