#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Markdown tables of moe_bench_hotpath's JSON output (the tables of docs/performance.md).

Usage: python3 bench/perf_table.py results.json > tables.md

For every shape: one row per (T, variant) with the fastest and the mean iteration, tokens/s and
GFLOP/s of the fastest, S-MFU, S-MBU, roofline fraction (against the limits measured around that
row, whose bandwidth is listed) and the speed-up over what ran beside it in the same loop: the
naive HF-loop baseline for the fp32 rows (forward against the naive forward, forward+backward
against the naive forward+backward), the fp32 layer for the bf16 rows; then the non-GEMM
kernels at T = 512 as a share of the fp32 forward, and the experts' gate+up projection alone with
weights from DRAM and from cache. Last, the targets of issue 6 checked against the same run
("met" / "not met" per shape), with what bounds the T = 1 speed-up: both sides stream weights,
ours on two threads and the baseline on one.
"""
import json
import re
import sys

NAME = re.compile(r"BM_(Layer|Naive|Kernel)_([A-Za-z0-9]+)_([A-Za-z0-9]+)/T:(\d+)")


def load(path):
    with open(path) as f:
        data = json.load(f)
    rows = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        m = NAME.match(b["name"])
        if not m:
            continue
        kind, shape, what, t = m.group(1), m.group(2), m.group(3), int(m.group(4))
        rows[(kind, shape, what, t)] = b
    return data.get("context", {}), rows


def ms(b):
    unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
    return b["real_time"] * unit


def best_ms(b):
    """The fastest iteration of a layer row (the time the fractions are computed from)."""
    return b.get("best_ms", ms(b))


def main(path):
    context, rows = load(path)
    shapes = []
    for (_, shape, _, _) in rows:
        if shape not in shapes:
            shapes.append(shape)
    if "limits" in context:
        print(f"Limits measured at start-up: {context['limits']}.\n")
    variants = [("Forward", "fp32 fwd"), ("ForwardBf16", "bf16 fwd"),
                ("ForwardBackward", "fp32 fwd+bwd")]
    for shape in shapes:
        print(f"### {shape}\n")
        print("| T | variant | best (ms) | mean (ms) | tokens/s | GFLOP/s | S-MFU | S-MBU "
              "| roofline | of bf16 peak | bw (GB/s) | speed-up |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        ts = sorted({t for (k, s, _, t) in rows if s == shape and k == "Layer"})
        for t in ts:
            for what, label in variants:
                b = rows.get(("Layer", shape, what, t))
                if not b:
                    continue
                speedup = (f"{b['vs_naive']:.2f}x" if "vs_naive" in b else
                           f"{b['vs_fp32']:.2f}x fp32" if "vs_fp32" in b else "-")
                bf16 = f"{b['bf16_peak_frac']:.3f}" if "bf16_peak_frac" in b else "-"
                print(f"| {t} | {label} | {best_ms(b):.3f} | {ms(b):.3f} "
                      f"| {t / best_ms(b) * 1e3:,.0f} | {b.get('best_GFLOP/s', 0):.1f} "
                      f"| {b.get('S-MFU', 0):.3f} | {b.get('S-MBU', 0):.3f} "
                      f"| {b.get('roofline', 0):.3f} | {bf16} | {b.get('bw_GB/s', 0):.1f} "
                      f"| {speedup} |")
        fwd = rows.get(("Layer", shape, "Forward", 512))
        kernels = [(w, rows.get(("Kernel", shape, w, 512)))
                   for w in ("Route", "Plan", "Gather", "Combine")]
        if fwd and any(b for _, b in kernels):
            parts = ", ".join(f"{w} {ms(b):.3f} ms" for w, b in kernels if b)
            total = sum(ms(b) for _, b in kernels if b)
            print(f"\nNon-GEMM kernels at T = 512 (one thread each): {parts}; together "
                  f"{100 * total / ms(fwd):.1f}% of the fp32 forward ({ms(fwd):.1f} ms). "
                  "The layer no longer runs Gather (rows are read in place).")
        dram = rows.get(("Kernel", shape, "ExpertInDram", 512))
        cached = rows.get(("Kernel", shape, "ExpertInCached", 512))
        if dram and cached:
            print(f"\nThe routed experts' gate+up projection alone at T = 512 "
                  f"({dram.get('rows/expert', 0):.0f} rows per expert): weights from DRAM "
                  f"{dram['best_GFLOP/s']:.0f} GFLOP/s (S-MFU {dram['S-MFU']:.2f}, weights read "
                  f"at {dram['weight_GB/s']:.1f} GB/s = {dram['bw_frac']:.2f} of "
                  f"{dram['bw_GB/s']:.1f}), from cache {cached['best_GFLOP/s']:.0f} GFLOP/s "
                  f"(S-MFU {cached['S-MFU']:.2f}).")
        print()
    targets(shapes, rows)


def targets(shapes, rows):
    """The targets of issue 6, each checked on every shape of the run."""
    def layer(shape, what, t):
        return rows.get(("Layer", shape, what, t))

    def vs_naive(shape, what, t):
        return (layer(shape, what, t) or {}).get("vs_naive")

    def non_gemm(shape):
        fwd = layer(shape, "Forward", 512)
        ks = [rows.get(("Kernel", shape, w, 512)) for w in ("Route", "Plan", "Gather", "Combine")]
        if not fwd or not all(ks):
            return None
        return sum(ms(k) for k in ks) / ms(fwd)

    def counter(name):
        return lambda shape, what, t: (layer(shape, what, t) or {}).get(name)

    def counter_of(name, what, t):
        return lambda shape: counter(name)(shape, what, t)

    # (target, values per shape as (label, function(shape) -> value), pass test: a function,
    # None for the roofline rule, "info" for a row that is not a target)
    checks = [
        ("T <= 8: S-MBU >= 0.80 (fp32)", [("T 1", lambda s: counter("S-MBU")(s, "Forward", 1)),
                                          ("T 8", lambda s: counter("S-MBU")(s, "Forward", 8))],
         lambda v: v >= 0.80, "{:.2f}"),
        ("routing + plan + gather + combine <= 5% of the forward at T = 512",
         [("", non_gemm)], lambda v: v <= 0.05, "{:.1%}"),
        ("forward >= 3x naive at T = 512",
         [("", lambda s: vs_naive(s, "Forward", 512))],
         lambda v: v >= 3.0, "{:.2f}x"),
        ("forward >= 1.5x naive at T = 1",
         [("", lambda s: vs_naive(s, "Forward", 1))],
         lambda v: v >= 1.5, "{:.2f}x"),
        ("(T = 1: 2-thread over 1-thread read bandwidth, measured around the row)",
         [("", counter_of("bw_ratio", "Forward", 1))],
         "info", "{:.2f}x"),
        ("(T = 1: the speed-up had ours read at that full 2-thread bandwidth)",
         [("", lambda s: (vs_naive(s, "Forward", 1) / counter("S-MBU")(s, "Forward", 1)
                          if layer(s, "Forward", 1) else None))],
         "info", "{:.2f}x"),
        ("fp32 at T >= 512: roofline >= 0.70 (Qwen3: S-MFU >= 0.65)",
         [("T 512", lambda s: counter("S-MFU" if s == "Qwen3" else "roofline")(s, "Forward", 512)),
          ("T 2048",
           lambda s: counter("S-MFU" if s == "Qwen3" else "roofline")(s, "Forward", 2048))],
         None, "{:.3f}"),
        ("forward+backward >= 3x naive at T = 512",
         [("", lambda s: vs_naive(s, "ForwardBackward", 512))],
         lambda v: v >= 3.0, "{:.2f}x"),
        ("bf16 >= 1.6x the fp32 layer at T <= 8",
         [("T 1", lambda s: (layer(s, "ForwardBf16", 1) or {}).get("vs_fp32")),
          ("T 8", lambda s: (layer(s, "ForwardBf16", 8) or {}).get("vs_fp32"))],
         lambda v: v >= 1.6, "{:.2f}x"),
        ("bf16 >= 0.65 of the bf16 dot-product peak at T >= 512",
         [("T 512", lambda s: counter("bf16_peak_frac")(s, "ForwardBf16", 512)),
          ("T 2048", lambda s: counter("bf16_peak_frac")(s, "ForwardBf16", 2048))],
         lambda v: v >= 0.65, "{:.3f}"),
    ]
    print("## Targets of issue 6, against this run\n")
    print("| target | " + " | ".join(shapes) + " | met |")
    print("|---|" + "---|" * len(shapes) + "---|")
    for name, values, test, fmt in checks:
        cells, ok_all, missing = [], True, False
        for shape in shapes:
            parts = []
            for label, f in values:
                v = f(shape)
                if v is None:
                    missing = True
                    continue
                if test == "info":
                    passed = True
                elif test is None:
                    passed = v >= (0.65 if shape == "Qwen3" else 0.70)
                else:
                    passed = test(v)
                ok_all &= passed
                mark = "" if passed else " (no)"
                parts.append(f"{label + ' ' if label else ''}{fmt.format(v)}{mark}")
            cells.append(", ".join(parts) if parts else "-")
        status = "-" if (missing and ok_all) or test == "info" else ("yes" if ok_all else "no")
        print(f"| {name} | " + " | ".join(cells) + f" | {status} |")
    print()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
