#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
"""The PyTorch eager baseline of moe_bench_hotpath's layer rows.

The Hugging Face sparse MoE block as transformers writes it (MixtralSparseMoeBlock /
Qwen3MoeSparseMoeBlock): router Linear, softmax, top-k, renormalisation, then per expert with
tokens an index_select, gate/up/down Linears with SiLU(gate) * up, the routing weight and an
index_add_. Same shapes as the bench (Qwen3, OLMoE, Mixtral-like; the DeepSeek-like one is
left out: its group-limited sigmoid routing is not this block), random weights, inputs
rotating like the bench's so that weights come from DRAM where they do in the bench.

Usage: /usr/bin/python3 bench/pytorch_baseline.py [--dtype bf16|fp32] [--threads 2] [--shapes Qwen3,Mixtral]
       [--tokens 1,8,32,128,512,2048] [--reps 10] [--train]
Prints one line per shape and T: best and mean ms per forward. With --train, per training step
as moe_bench_train times it: the forward with autograd, then backward of sum(y * dy) (dy uniform
in [-1/(T*D), 1/(T*D)), the gradients of every weight and of x accumulated; no optimizer step),
parameters and activations in --dtype (bf16: PyTorch's bf16 eager training, against moe's
bf16-compute mode). Debian 12: apt install
python3-torch (PyTorch 1.13, oneDNN inside: its bf16 Linears use AMX where the CPU has it).
"""
import argparse
import time

import torch

SHAPES = {  # name: (D, F, E, top_k), as bench_hotpath.cpp
    "Qwen3": (2048, 768, 128, 8),
    "OLMoE": (2048, 1024, 64, 8),
    "Mixtral": (1024, 3584, 8, 2),
}


class Block(torch.nn.Module):
    def __init__(self, d, f, e, k):
        super().__init__()
        self.k = k
        self.gate = torch.nn.Linear(d, e, bias=False)
        self.gate_proj = torch.nn.ModuleList(torch.nn.Linear(d, f, bias=False) for _ in range(e))
        self.up_proj = torch.nn.ModuleList(torch.nn.Linear(d, f, bias=False) for _ in range(e))
        self.down_proj = torch.nn.ModuleList(torch.nn.Linear(f, d, bias=False) for _ in range(e))

    def forward(self, x):
        logits = self.gate(x)
        w = torch.softmax(logits, dim=1, dtype=torch.float)
        w, sel = torch.topk(w, self.k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        y = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(sel, num_classes=len(self.gate_proj)).permute(2, 1, 0)
        for e in range(len(self.gate_proj)):
            idx, top = torch.where(mask[e])
            if top.numel() == 0:
                continue
            xe = x.index_select(0, top)
            h = torch.nn.functional.silu(self.gate_proj[e](xe)) * self.up_proj[e](xe)
            y.index_add_(0, top, self.down_proj[e](h) * w[top, idx, None])
        return y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="Qwen3,Mixtral")
    ap.add_argument("--tokens", default="1,8,32,128,512,2048")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--train", action="store_true", help="time forward + backward steps")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    print(f"torch {torch.__version__}, {a.threads} threads, {a.dtype}, "
          f"oneDNN bf16 AMX: {torch.backends.mkldnn.is_available()}")
    for name in a.shapes.split(","):
        d, f, e, k = SHAPES[name]
        torch.manual_seed(0)
        block = Block(d, f, e, k).to(dtype)
        if not a.train:
            block.eval()
        for t in [int(v) for v in a.tokens.split(",")]:
            if a.train:
                x = torch.rand(t, d, dtype=torch.float32).mul_(2).sub_(1).to(dtype).requires_grad_()
                g = 1.0 / (t * d)
                dy = torch.rand(t, d, dtype=torch.float32).mul_(2 * g).sub_(g).to(dtype)
                block(x).backward(dy)
                times = []
                for r in range(a.reps):
                    t0 = time.perf_counter()
                    block(x).backward(dy)
                    times.append(time.perf_counter() - t0)
                print(f"{name} T={t} train step: best {min(times) * 1e3:.2f} ms, "
                      f"mean {sum(times) / len(times) * 1e3:.2f} ms")
                continue
            inputs = [torch.rand(t, d, dtype=torch.float32).mul_(2).sub_(1).to(dtype) for _ in range(4)]
            times = []
            with torch.inference_mode():
                block(inputs[0])
                for r in range(a.reps):
                    t0 = time.perf_counter()
                    block(inputs[r % len(inputs)])
                    times.append(time.perf_counter() - t0)
            print(f"{name} T={t}: best {min(times) * 1e3:.2f} ms, mean {sum(times) / len(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
