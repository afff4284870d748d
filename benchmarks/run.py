"""Run the benchmarks: every ``benchmarks/bench_*.py`` module's ``main()``, in name order.

Usage:
  python benchmarks/run.py              # all of them
  python benchmarks/run.py convert      # only bench_convert.py (``bench_convert`` works too)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def discover() -> dict[str, Path]:
    """Benchmark name (file stem without ``bench_``) -> path, for every bench_*.py here."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(HERE.glob("bench_*.py"))}


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmarks.{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    found = discover()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default all): {list(found)}")
    args = parser.parse_args(argv)
    names = [n.removeprefix("bench_").removesuffix(".py") for n in args.names] or list(found)
    unknown = [n for n in names if n not in found]
    if unknown:
        parser.error(f"no benchmark named {unknown}; available: {list(found)}")
    for name in names:
        module = load(found[name])
        if not callable(getattr(module, "main", None)):
            parser.error(f"{found[name].name} defines no main()")
        print(f"## {name}\n", flush=True)
        start = time.perf_counter()
        module.main()
        print(f"\n({found[name].name}: {time.perf_counter() - start:.1f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
