#!/usr/bin/env python3
"""Where a kernel's warps stall, per SASS instruction, from ncu's source page.

Usage: ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv
       scripts/ncu_stall_sites.py source.csv [--top 40]

The page holds one block per profiled kernel: a header row (with "Source" and the "Warp Stall
Sampling (All Samples)" column) and one row per SASS instruction. For each block this prints
the stall reasons summed over the kernel, then the instructions holding the most samples, each
with its share of the kernel's samples, its three largest stall reasons and the SASS text,
so a stall (say the L1TEX scoreboard) can be traced to the wait or load that causes it.
"""

import argparse
import csv
import sys

ALL_SAMPLES = "Warp Stall Sampling (All Samples)"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def blocks(rows):
    """Yields (title, header, data rows) per kernel block of the page."""
    title, header, data = "", None, []
    previous = []
    for row in rows:
        if "Source" in row and ALL_SAMPLES in row:
            if header is not None:
                yield title, header, data
            title = " ".join(cell for cell in previous if cell).strip() or "kernel"
            header, data = row, []
        elif header is not None and len(row) == len(header):
            data.append(row)
        else:
            if header is not None and data:
                yield title, header, data
                header, data = None, []
            previous = row
    if header is not None:
        yield title, header, data


def report(title, header, data, top):
    column = {name: i for i, name in enumerate(header)}
    samples_idx = column[ALL_SAMPLES]
    source_idx = column["Source"]
    address_idx = next((column[n] for n in ("# Address", "Address") if n in column), None)
    stall_cols = [(name, i) for name, i in column.items() if name.startswith("stall_")]
    if not stall_cols:  # another ncu's naming: any per-reason stall column
        stall_cols = [
            (name, i)
            for name, i in column.items()
            if "stall" in name.lower() and not name.startswith("Warp Stall Sampling")
        ]
        print("   (no stall_* columns; the page's columns: " + "; ".join(header) + ")")
    total = sum(number(r[samples_idx]) for r in data) or 1.0
    print(f"== {title[:200]}")
    print(f"   {len(data)} instructions, {int(total)} samples")
    sums = sorted(((sum(number(r[i]) for r in data), name) for name, i in stall_cols), reverse=True)
    print(
        "   stall reasons: " + ", ".join(f"{n} {100 * s / total:.1f}%" for s, n in sums[:10] if s)
    )
    ranked = sorted(data, key=lambda r: number(r[samples_idx]), reverse=True)
    for row in ranked[:top]:
        samples = number(row[samples_idx])
        if samples == 0:
            break
        reasons = sorted(((number(row[i]), name) for name, i in stall_cols), reverse=True)[:3]
        why = " ".join(
            f"{n.removeprefix('stall_')}={100 * s / samples:.0f}%" for s, n in reasons if s
        )
        address = row[address_idx] if address_idx is not None else ""
        print(
            f"   {100 * samples / total:5.1f}%  {address:>6}  {row[source_idx].strip()[:70]:<70}  {why}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_path")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with open(args.csv_path, newline="") as f:
        rows = list(csv.reader(f))
    found = False
    previous = None
    for title, header, data in blocks(rows):
        found = True
        if (title, data) == previous:
            continue  # ncu's page can list a kernel's source twice
        previous = (title, data)
        report(title, header, data, args.top)
    if not found:
        print(f"ncu_stall_sites: no source block with '{ALL_SAMPLES}' in {args.csv_path}")
        print("".join(",".join(r)[:200] + "\n" for r in rows[:5]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
