#!/usr/bin/env python3
"""Let the FP8 GEMMs' promotion instructions yield: a post-compile patch of an object's SASS.

The FP8 grouped GEMM's consumers add each 128-long K-block's wgmma result into the fp32 sum
(the promotion: 64 FFMA per thread, and 64 FMUL more in the weight gradients). ptxas marks
about every other one of them "no yield" so that it can keep an operand in the register reuse
cache for the next one; while a warp runs such a stretch, the other consumer warpgroup's warp on
the same scheduler waits to issue its wgmma. This script sets the yield hint on every FFMA and
FMUL of each promotion stretch (or on the first half of it) and clears their reuse flags, which
a yielding instruction must not carry: the next instruction then reads the register file. The
math is unchanged instruction for instruction (same operands, same order), so the bits are too.
DeepGEMM describes the same lever for its FP8 kernels; this is mok's own implementation.

The 128-bit sm_90 instruction word keeps its scheduling controls in the high 64 bits: bit 45 is
the yield hint (0 lets the scheduler switch warps after the instruction; ptxas writes 1 on every
instruction that sets a reuse flag), bits 58-61 the reuse flags of the source operands.

Usage: sass_yield.py OBJECT [--out PATCHED] [--mode all|first-half] [--kernel REGEX]
Needs cuobjdump (and the nvdisasm it calls) on PATH. The object's fatbinary must hold its cubin
uncompressed (nvcc -no-compress); every instruction is checked against the SASS listing's
encoding before it is rewritten, and the script refuses anything it cannot find exactly.
"""

import argparse
import re
import struct
import subprocess
import sys

YIELD_BIT = 1 << 45  # in the high word: 1 = stay on this warp
REUSE_BITS = 0xF << 58  # in the high word: the operand reuse flags
PROMOTION_OPS = ("FFMA", "FMUL")
# A promotion stretch runs from a wgmma wait to the next instruction of these kinds or the next
# wait on a barrier (SYNCS.PHASECHK; an arrival, SYNCS.ARRIVE, does not end it).
STRETCH_END = ("QGMMA", "BRA", "BAR", "WARPGROUP", "EXIT", "RET")
MIN_STRETCH = 32  # FFMA/FMUL in a stretch for it to count as a promotion


def listing(obj):
    """[(function, address, text, low word, high word)] from cuobjdump -sass."""
    out = subprocess.run(
        ["cuobjdump", "-sass", obj], check=True, capture_output=True, text=True
    ).stdout.split("\n")
    instructions, function = [], None
    pattern = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s+/\* (0x[0-9a-f]{16}) \*/")
    i = 0
    while i < len(out):
        line = out[i]
        if "Function :" in line:
            function = line.split(":", 1)[1].strip()
        match = pattern.match(line)
        if match and i + 1 < len(out):
            high = re.search(r"/\* (0x[0-9a-f]{16}) \*/", out[i + 1])
            if high is None:
                sys.exit(f"sass_yield: no control word after line {i}: {line.strip()}")
            instructions.append(
                (
                    function,
                    int(match.group(1), 16),
                    match.group(2).strip(),
                    int(match.group(3), 16),
                    int(high.group(1), 16),
                )
            )
            i += 2
            continue
        i += 1
    return instructions


def opcode(text):
    """The instruction's opcode without a predicate or modifiers (`@!P0 FFMA.FTZ` -> FFMA)."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def promotion_stretches(instructions):
    """Lists of indices of the FFMA/FMUL in each stretch after a WARPGROUP.DEPBAR."""
    stretches, current, inside = [], [], False
    for index, (_, _, text, _, _) in enumerate(instructions):
        op = opcode(text)
        if text.startswith("WARPGROUP.DEPBAR") or " WARPGROUP.DEPBAR" in text:
            if inside and len(current) >= MIN_STRETCH:
                stretches.append(current)
            current, inside = [], True
            continue
        if not inside:
            continue
        if op in STRETCH_END or "SYNCS.PHASECHK" in text:
            if len(current) >= MIN_STRETCH:
                stretches.append(current)
            current, inside = [], False
        elif op in PROMOTION_OPS:
            current.append(index)
    if inside and len(current) >= MIN_STRETCH:
        stretches.append(current)
    return stretches


def embedded_elfs(data):
    """(start, {section name: (file offset, size)}) of each device ELF inside the object."""
    found = []
    start = data.find(b"\x7fELF", 1)
    while start != -1:
        try:
            (shoff,) = struct.unpack_from("<Q", data, start + 0x28)
            shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, start + 0x3A)
            headers = []
            for s in range(shnum):
                base = start + shoff + s * shentsize
                name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, base)
                headers.append((name, offset, size))
            _, strtab_offset, _ = headers[shstrndx]
            sections = {}
            for name, offset, size in headers:
                end = data.index(b"\0", start + strtab_offset + name)
                sections[data[start + strtab_offset + name : end].decode()] = (start + offset, size)
            found.append((start, sections))
        except (struct.error, ValueError, IndexError, UnicodeDecodeError):
            pass  # ELF magic inside other data: not a device image
        start = data.find(b"\x7fELF", start + 4)
    return found


def patch(obj, out, mode, kernel):
    with open(obj, "rb") as f:
        data = bytearray(f.read())
    instructions = listing(obj)
    elfs = embedded_elfs(bytes(data))
    if not elfs:
        sys.exit(f"sass_yield: no uncompressed device ELF in {obj} (build it with -no-compress)")
    functions = sorted({f for f, *_ in instructions if f and re.search(kernel, f)})
    if not functions:
        sys.exit(f"sass_yield: no function of {obj} matches {kernel!r}")
    total = 0
    for function in functions:
        body = [x for x in instructions if x[0] == function]
        places = [s[f".text.{function}"] for _, s in elfs if f".text.{function}" in s]
        if len(places) != 1:
            sys.exit(f"sass_yield: {function}: {len(places)} .text sections (expected 1)")
        text_offset, text_size = places[0]
        changed = 0
        for stretch in promotion_stretches(body):
            chosen = stretch if mode == "all" else stretch[: len(stretch) // 2]
            for index in chosen:
                _, address, text, low, high = body[index]
                if address + 16 > text_size:
                    sys.exit(f"sass_yield: {function}+{address:#x} past its section")
                at = text_offset + address
                if struct.unpack_from("<QQ", data, at) != (low, high):
                    sys.exit(f"sass_yield: {function}+{address:#x} ({text}): bytes differ")
                new_high = high & ~YIELD_BIT & ~REUSE_BITS
                if new_high != high:
                    struct.pack_into("<QQ", data, at, low, new_high)
                    changed += 1
        print(f"sass_yield: {function}: {changed} instructions set to yield ({mode})")
        total += changed
    with open(out, "wb") as f:
        f.write(data)
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("object")
    parser.add_argument("--out", help="the patched object (default: in place)")
    parser.add_argument("--mode", choices=("all", "first-half"), default="all")
    parser.add_argument("--kernel", default="fp8_grouped_gemm_kernel")
    args = parser.parse_args()
    if patch(args.object, args.out or args.object, args.mode, args.kernel) == 0:
        sys.exit("sass_yield: nothing to change (already patched?)")


if __name__ == "__main__":
    main()
