"""Instruction mix of an Nsight Compute source page (scripts/ncu_norm.sh NCU_SOURCE=1 writes
one CSV per case): executed warp instructions and warp-stall samples per SASS opcode, then the
SASS lines with the most stall samples.

    python scripts/ncu_source_summary.py ncu-source-*.csv [--top 15]
"""
import argparse
import collections
import csv


def _int(text):
    try:
        return int(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0


def summarize(path, top):
    with open(path) as f:
        lines = f.read().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    rows = [r for r in csv.DictReader(lines[header:]) if r.get("Source", "").strip()]
    executed, stalls = collections.Counter(), collections.Counter()
    for r in rows:
        words = r["Source"].split()
        opcode = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]
        executed[opcode] += _int(r["Instructions Executed"])
        stalls[opcode] += _int(r["Warp Stall Sampling (All Samples)"])
    total, total_stalls = sum(executed.values()) or 1, sum(stalls.values()) or 1
    print(f"{path}: {total} warp instructions executed, {total_stalls} stall samples")
    print(f"  {'opcode':10s} {'instr %':>8s} {'stalls %':>9s}")
    for opcode, n in executed.most_common():
        if n / total >= 0.005:
            print(f"  {opcode:10s} {100 * n / total:8.1f} {100 * stalls[opcode] / total_stalls:9.1f}")
    print("  SASS lines with the most stall samples:")
    for r in sorted(rows, key=lambda r: -_int(r["Warp Stall Sampling (All Samples)"]))[:top]:
        print(f"    {r['Address']:>6s} {_int(r['Warp Stall Sampling (All Samples)']):6d}  {r['Source'].strip()}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", nargs="+")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    for path in args.csv:
        summarize(path, args.top)
