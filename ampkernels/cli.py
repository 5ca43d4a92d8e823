"""Command line: `ampkernels doctor`, `ampkernels bench`, `ampkernels --version` (also `python -m ampkernels ...`)."""
import sys

USAGE = """usage: ampkernels {doctor,bench,--version} [options]

  doctor   which backends are live on this machine and why not (--json for machines)
  bench    side-by-side benchmarks against PyTorch eager, torch.compile and public
           kernels; writes results.jsonl and a target report (see `ampkernels bench -h`)
"""


def _bench_main():
    from .bench.run import main
    return main


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"ampkernels {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "doctor":
        from .doctor import main as doctor_main
        return doctor_main(rest)
    if command == "bench":
        return _bench_main()(rest)
    print(f"ampkernels: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
