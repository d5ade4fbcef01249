#!/usr/bin/env python3
"""Compare the kernels' SASS of source files between a git revision and the working tree.

Every change to a GEMM kernel is checked this way before device time is spent: the kernels a
change should not touch must come out the same, instruction for instruction, and those it does
touch must change only where expected. Session 61 accepted "differs only by the ring fix" for
the 192-row FP8 GEMM without looking at how much: lane 0 reading a ring entry and shuffling it
to the other lanes had moved the tile walk off the uniform datapath (+184 instructions) and the
kernel ran ~15% slower (docs/perf.md, session 62). So this script prints, for each kernel, its
instruction count on both sides, the opcodes whose counts changed, and the share of
uniform-datapath instructions (U*, R2UR, S2UR), and flags growth or a uniform share that fell.

Usage:
  sass_diff.py [--base REV] FILE.cu [FILE.cu ...]   compile each file at REV (default HEAD)
                                                    and in the working tree, then compare
  sass_diff.py --objects OLD.o NEW.o                compare two objects
Needs nvcc (CUDA 13) and cuobjdump (scripts/fetch-sass-tools.sh puts one in .deps/sass-tools,
which this script adds to PATH). Exits 1 if any kernel is flagged, 0 otherwise.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The flags that change SASS in CMakeLists.txt's MOK_CUDA_FLAGS (-lineinfo does not).
NVCC_FLAGS = [
    "-DMOK_HAS_NCCL=1",
    "-Isrc",
    "-Iinclude",
    "-O3",
    "-DNDEBUG",
    "-gencode=arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr",
    "-std=c++20",
    "-x",
    "cu",
    "-c",
]
GROWTH_LIMIT = 0.02  # flag a kernel whose instruction count grew by more than this share
UNIFORM_DROP_LIMIT = 0.02  # flag a kernel whose uniform share fell by more than this


def nvcc():
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.exists(candidate):
            return candidate
    sys.exit("sass_diff: no nvcc (CUDA toolkit) found")


def compile_object(tree, source, out):
    command = [nvcc(), *NVCC_FLAGS, source, "-o", out]
    result = subprocess.run(command, cwd=tree, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"sass_diff: {source} did not compile in {tree}:\n{result.stderr[-3000:]}")


def kernels(obj):
    """{kernel name: [instruction text]} from cuobjdump -sass."""
    listing = subprocess.run(
        ["cuobjdump", "-sass", obj], check=True, capture_output=True, text=True
    ).stdout
    functions, current = {}, None
    for line in listing.split("\n"):
        if "Function :" in line:
            current = line.split(":", 1)[1].strip()
            functions[current] = []
            continue
        match = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if match and current is not None:
            functions[current].append(match.group(1))
    return {readable(name): body for name, body in functions.items()}


def readable(name):
    """The demangled kernel with its template arguments, without namespaces or parameters (an
    anonymous namespace's per-build hash gone, so that two builds' names match)."""
    if shutil.which("c++filt") is None:
        return re.sub(r"_GLOBAL__N__\w+?_\d+_", "_GLOBAL__N__", name)
    text = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
    text = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", text)  # the parameter list
    return re.sub(r"\b(?:\w+::)+(?=\w)", "", text.replace("(anonymous namespace)::", ""))


def opcode(instruction):
    """The opcode with its modifiers, the predicate guard removed."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def uniform(op):
    return op.startswith("U") or op.startswith("R2UR") or op.startswith("S2UR")


# A trailing template argument at its default: false, or an enum's first value (`(Form)0`).
DEFAULT_ARGUMENT = re.compile(r", (?:false|\(\w+\)0)>$")


def pair_by_added_flags(old, new):
    """A kernel given a new trailing template parameter (false or an enum's 0 by default) is
    compared with the old kernel without it: `k<a, false>` and `k<a, (Out)0>` against `k<a>`."""
    renamed = {}
    for name in new:
        if name in old:
            continue
        shorter = name
        while DEFAULT_ARGUMENT.search(shorter) and shorter not in old:
            shorter = DEFAULT_ARGUMENT.sub(">", shorter)
        if shorter in old and shorter not in new:
            renamed[shorter] = name
    return {renamed.get(name, name): body for name, body in old.items()}


def compare(old, new):
    old = pair_by_added_flags(old, new)
    flagged = False
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            side = "new" if name not in old else "old"
            print(f"only in the {side} object: {name}")
            continue
        a, b = old[name], new[name]
        if a == b:
            print(f"same     {len(a):6d}  {name}")
            continue
        ops_a = collections.Counter(opcode(x) for x in a)
        ops_b = collections.Counter(opcode(x) for x in b)
        share_a = sum(n for op, n in ops_a.items() if uniform(op)) / max(len(a), 1)
        share_b = sum(n for op, n in ops_b.items() if uniform(op)) / max(len(b), 1)
        growth = (len(b) - len(a)) / max(len(a), 1)
        warn = growth > GROWTH_LIMIT or share_a - share_b > UNIFORM_DROP_LIMIT
        flagged |= warn
        print(
            f"{'FLAG' if warn else 'changed':8s} {len(a):6d} -> {len(b):6d} ({growth:+.1%}), "
            f"uniform {share_a:.1%} -> {share_b:.1%}  {name}"
        )
        deltas = sorted(
            (
                (ops_b[op] - ops_a[op], op)
                for op in set(ops_a) | set(ops_b)
                if ops_a[op] != ops_b[op]
            ),
            key=lambda d: (-abs(d[0]), d[1]),
        )
        print("         " + ", ".join(f"{op} {ops_a[op]}->{ops_b[op]}" for _, op in deltas[:14]))
    return flagged


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sources", nargs="*", help="source files, relative to the repository")
    parser.add_argument("--base", default="HEAD", help="the revision to compare against")
    parser.add_argument("--objects", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    os.environ["PATH"] += os.pathsep + os.path.join(ROOT, ".deps", "sass-tools")
    if shutil.which("cuobjdump") is None:
        sys.exit("sass_diff: no cuobjdump on PATH; run scripts/fetch-sass-tools.sh")
    if args.objects:
        sys.exit(1 if compare(kernels(args.objects[0]), kernels(args.objects[1])) else 0)
    if not args.sources:
        parser.error("give source files or --objects OLD NEW")
    flagged = False
    with tempfile.TemporaryDirectory() as work:
        base_tree = os.path.join(work, "base")
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", base_tree, args.base], cwd=ROOT, check=True
        )
        try:
            for source in args.sources:
                print(f"== {source}: {args.base} -> working tree")
                old_obj, new_obj = os.path.join(work, "old.o"), os.path.join(work, "new.o")
                compile_object(base_tree, source, old_obj)
                compile_object(ROOT, source, new_obj)
                flagged |= compare(kernels(old_obj), kernels(new_obj))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", base_tree], cwd=ROOT, check=False
            )
    sys.exit(1 if flagged else 0)


if __name__ == "__main__":
    main()
