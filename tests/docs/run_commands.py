#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""docs: every documented command runs.

Runs, as written, every command line of the fenced shell blocks of the markdown files given
(README.md, docs/*.md, examples/README.md, bench/README.md) that calls one of moe's tools, and
the inline `moe_...` spans that are whole commands (they name --model and at least one other
option), on files the repository's own tools make:

  work/DIR            moe_hf_make_tiny_checkpoint DIR qwen3_moe --whole-model, 256 wide (so
                      that 256-blocks such as q4_k fit), with its tokenizer and x.safetensors
  work/FILE.gguf      moe_quantize --model DIR --out FILE.gguf --mix q4_k_m
  Qwen3-30B-A3B, model.gguf, Qwen3-30B-A3B-Q4_K_M.gguf, x.safetensors: links to those
  prompt.txt          a line of text
  build/release/{examples,bench}: links to the build's tool directories, so that
                      ./build/release/bench/moe_bench ... runs the binary of this build
  docs/perf/          for the benches' --benchmark_out=docs/perf/... (run from the root)

The commands of each markdown file run in order, with bash, in a directory of that file's own
(work/in_<file>/, the files above linked into it: what one file's commands make never meets
another's), the tool directories first on PATH, and each must exit 0 within its time limit. Benchmark binaries get --benchmark_list_tests=true appended: the line is parsed
and its filter must match at least one benchmark, but nothing is timed. Lines that are synopses
(they hold `[`, `|` outside quotes or `...` as an argument) are not commands and are skipped;
so are the lines of SKIP below, each with the reason it cannot run here. A SKIP entry that no
longer matches any line fails the test, so the list cannot go stale.

A tool this configuration does not build (moe_tokenize without PCRE2 and ICU, the benches or
moe_expert_parallel when off) skips its lines, saying so; --no-text skips the text commands.

usage: run_commands.py --examples DIR [--bench DIR] [--no-text] --work DIR FILE.md...
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

# (file suffix, text the line contains) -> why it is not run.
SKIP = [
    ("examples/README.md", "moe_quickstart            #",
     "the full Qwen3 shape takes 4.9 GB and 10-25 s; its --small run on the next line is the "
     "same program"),
    ("docs/distributed.md", "mpirun -n 2", "an MPI launch: moe_dist_tests and "
     "'example: 04_expert_parallel' run the same program under mpirun"),
    ("docs/distributed.md", "mpirun -n 4", "an MPI launch (see above)"),
    ("docs/distributed.md", "mpirun --hostfile", "a cluster launch: needs the hosts it names"),
    ("docs/io.md", "/tmp/crash-", "reruns a crash file a fuzzing run wrote"),
    ("docs/tokenizer.md", "--decode 9707,11,1879",
     "Qwen3's ids: the tiny model's tokenizer has 259 (its --text line above runs)"),
]

TOOL = re.compile(r"^(?:\./)?(?:build/release/(?:examples|bench|tests/fuzz)/(?:[^/ ]+/)?)?"
                  r"(moe_[a-z0-9_]+|fuzz_[a-z0-9_]+)(?:\s|$)")


def commands(path):
    """(line number, command) of the tool commands in `path`, and its inline whole commands."""
    text = open(path, encoding="utf-8").read()
    out = []
    fence = re.compile(r"^```([A-Za-z+]*)\n(.*?)^```", re.S | re.M)
    for m in fence.finditer(text):
        if m.group(1) not in ("", "sh", "bash", "console", "shell"):
            continue
        first = text.count("\n", 0, m.start(2)) + 1
        lines = m.group(2).split("\n")
        i = 0
        while i < len(lines):
            line, number = lines[i], first + i
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            line = line.strip()
            for part in line.split("&&"):
                part = part.strip()
                if TOOL.match(part) or part.startswith("mpirun"):
                    out.append((number, part))
    prose = fence.sub("", text)
    for m in re.finditer(r"`(moe_[a-z0-9_]+ [^`\n]+)`", prose):
        span = m.group(1)
        options = re.findall(r"(?:^|\s)--[a-z]", span)
        if "--model" in span and len(options) >= 2:
            out.append((text.count("\n", 0, text.find(m.group(0))) + 1, span))
    return out


def synopsis(command):
    """Whether `command` is a usage line rather than a command."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return True
    return any(w.startswith("[") or w == "..." or ("|" in w and not w.startswith("--")
                                                     and "=" not in w) for w in words)


def run(cmd, cwd, env, timeout):
    p = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, timeout=timeout,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       errors="replace")
    return p.returncode, p.stdout, p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", required=True)
    ap.add_argument("--bench")
    ap.add_argument("--work", required=True)
    ap.add_argument("--no-text", action="store_true",
                    help="the build has no tokenizer (moe::text): text commands are skipped")
    ap.add_argument("markdown", nargs="+")
    a = ap.parse_args()

    work = a.work
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "build", "release"))
    env = dict(os.environ)
    path = [a.examples] + ([a.bench] if a.bench else [])
    env["PATH"] = os.pathsep.join(path + [env.get("PATH", "")])
    os.symlink(a.examples, os.path.join(work, "build", "release", "examples"))
    if a.bench:
        os.symlink(a.bench, os.path.join(work, "build", "release", "bench"))

    setup = [
        "moe_hf_make_tiny_checkpoint DIR qwen3_moe --whole-model --hidden 256 --expert-ffn 256 "
        "--dense-ffn 256 --head-dim 64",
        "moe_quantize --model DIR --out FILE.gguf --mix q4_k_m",
    ]
    for cmd in setup:
        code, _, err = run(cmd, work, env, 300)
        if code != 0:
            print(f"setup failed: {cmd}\n{err}")
            return 1
    with open(os.path.join(work, "prompt.txt"), "w", encoding="utf-8") as f:
        f.write("Why is the sky blue?\n")

    def file_dir(md):
        """A directory of its own for the commands of `md`, linking the shared files."""
        d = os.path.join(work, "in_" + re.sub(r"[^A-Za-z0-9]+", "_", md))
        os.makedirs(os.path.join(d, "docs", "perf"))  # benches' --benchmark_out=docs/perf/...
        for name, target in [("DIR", "DIR"), ("FILE.gguf", "FILE.gguf"),
                             ("Qwen3-30B-A3B", "DIR"), ("model.gguf", "FILE.gguf"),
                             ("Qwen3-30B-A3B-Q4_K_M.gguf", "FILE.gguf"),
                             ("x.safetensors", "DIR/x.safetensors"), ("prompt.txt", "prompt.txt"),
                             ("build", "build")]:
            src, dst = os.path.join(work, target), os.path.join(d, name)
            if os.path.isdir(src):
                os.symlink(src, dst)
            else:  # a hard link: a regular file, which a command may replace as its output
                os.link(src, dst)
        return d

    used = set()
    ran = skipped = synopses = failed = 0
    for md in a.markdown:
        shown = os.path.relpath(md, os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
        cwd = None
        for number, cmd in commands(md):
            where = f"{shown}:{number}"
            reason = None
            for i, (suffix, needle, why) in enumerate(SKIP):
                if shown.endswith(suffix) and needle in cmd:
                    reason = why
                    used.add(i)
            if reason:
                skipped += 1
                print(f"skip  {where}: {cmd}\n      ({reason})")
                continue
            if synopsis(cmd):
                synopses += 1
                continue
            tool = TOOL.match(cmd).group(1)
            bench = tool.startswith("moe_bench")
            missing = None
            if not any(os.path.exists(os.path.join(d, tool)) for d in path):
                missing = f"{tool} is not built in this configuration"
            elif a.no_text and re.search(r"moe_tokenize|--prompt |--prompt-file|--chat", cmd):
                missing = "this build has no tokenizer (moe::text needs PCRE2 and ICU)"
            if missing:
                skipped += 1
                print(f"skip  {where}: {cmd}\n      ({missing})")
                continue
            run_cmd = cmd
            if bench:
                run_cmd = re.sub(r"\s+#.*$", "", cmd) + " --benchmark_list_tests=true"
            if cwd is None:
                cwd = file_dir(shown)
            start = time.monotonic()
            try:
                code, out, err = run(run_cmd, cwd, env, 300)
            except subprocess.TimeoutExpired:
                code, out, err = -1, "", "timed out after 300 s"
            ok = code == 0 and (not bench or out.strip() != "")
            ran += 1
            print(f"{'ok   ' if ok else 'FAIL '} {where} ({time.monotonic() - start:.1f} s): {cmd}")
            if not ok:
                failed += 1
                why = "no benchmark matches" if code == 0 else f"exit status {code}"
                print(f"      {why}\n      stderr: {err.strip()[-2000:]}")
    for i, (suffix, needle, _) in enumerate(SKIP):
        if i not in used:
            failed += 1
            print(f"FAIL  SKIP entry ({suffix}, {needle!r}) matches no documented command: "
                  "remove it")
    print(f"{ran} commands run, {failed} failed; {skipped} skipped; "
          f"{synopses} synopsis lines not run")
    return 1 if failed or ran == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
