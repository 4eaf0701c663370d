#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Markdown tables of moe_bench_hotpath's JSON output (the tables of docs/performance.md).

Usage: python3 bench/perf_table.py results.json > tables.md

For every shape: one row per (T, variant) with time, tokens/s, GFLOP/s, S-MFU, S-MBU, roofline
fraction and the speed-up over the naive HF-loop baseline measured in the same run (forward
variants against the naive forward, forward+backward against the naive forward+backward); then
the non-GEMM kernels at T = 512 as a share of the fp32 forward.
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


def main(path):
    context, rows = load(path)
    shapes = []
    for (_, shape, _, _) in rows:
        if shape not in shapes:
            shapes.append(shape)
    peak = next((b.get("peak_GFLOP/s") for b in rows.values() if "peak_GFLOP/s" in b), None)
    bw = next((b.get("bw_GB/s") for b in rows.values() if "bw_GB/s" in b), None)
    if peak and bw:
        print(f"Measured in the same run: fp32 FMA peak {peak:.0f} GFLOP/s, "
              f"read bandwidth {bw:.1f} GB/s (2 threads).\n")
    variants = [("Forward", "fp32 fwd", "Forward"), ("ForwardBf16", "bf16 fwd", "Forward"),
                ("ForwardBackward", "fp32 fwd+bwd", "ForwardBackward")]
    for shape in shapes:
        print(f"### {shape}\n")
        print("| T | variant | time (ms) | tokens/s | GFLOP/s | S-MFU | S-MBU | roofline "
              "| vs naive |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        ts = sorted({t for (k, s, _, t) in rows if s == shape and k == "Layer"})
        for t in ts:
            for what, label, naive_what in variants:
                b = rows.get(("Layer", shape, what, t))
                if not b:
                    continue
                naive = rows.get(("Naive", shape, naive_what, t))
                speedup = f"{ms(naive) / ms(b):.2f}x" if naive else "-"
                print(f"| {t} | {label} | {ms(b):.3f} | {b.get('tokens/s', 0):,.0f} "
                      f"| {b.get('GFLOP/s', 0):.1f} | {b.get('S-MFU', 0):.3f} "
                      f"| {b.get('S-MBU', 0):.3f} | {b.get('roofline', 0):.3f} | {speedup} |")
        fwd = rows.get(("Layer", shape, "Forward", 512))
        kernels = [(w, rows.get(("Kernel", shape, w, 512)))
                   for w in ("Route", "Plan", "Gather", "Combine")]
        if fwd and any(b for _, b in kernels):
            parts = ", ".join(f"{w} {ms(b):.3f} ms" for w, b in kernels if b)
            total = sum(ms(b) for _, b in kernels if b)
            print(f"\nNon-GEMM kernels at T = 512 (one thread each): {parts}; together "
                  f"{100 * total / ms(fwd):.1f}% of the fp32 forward ({ms(fwd):.1f} ms). "
                  "The layer no longer runs Gather (rows are read in place).")
        print()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
