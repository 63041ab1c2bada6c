"""This code against an earlier commit, side by side in one run: the gateway overhead, span ingest and
assembly benchmarks of each tree, alternating (baseline, this, baseline, this, ...), so that drift of a
shared machine hits both alike. Prints each pair, the medians, the ratios and the targets.

    python -m benchmarks.side_by_side --baseline REF [--rounds 3] [--only gateway,ingest,assembly]

The baseline is the tree of REF (a commit, tag or branch; ``git archive``) with a ``tracegym`` package put
together as that tree's ``pyproject.toml`` maps its folders (``sdk/`` with ``gateway/``, ``trainer/`` and the
others inside), first on PYTHONPATH; each tree runs its own ``benchmarks/`` (so each measures with the
benchmark code of its time: both print the rows read here)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bench:
    name: str
    argv: list[str]
    read: Callable[[str], dict[str, float]]
    targets: dict[str, dict[str, tuple[str, float]]]
    """variant of this code → metric → (">=" or "<=", bound)."""
    variants: tuple[tuple[str, list[str]], ...] = (("", []),)
    """The runs: (label, extra arguments), each run by the baseline and by this code, alternating."""


def read_gateway(out: str) -> dict[str, float]:
    """From ``benchmarks.gateway_overhead``: req/s, p99 and (the gateway's, all threads) CPU per call at each
    concurrency, and the added p50."""
    got: dict[str, float] = {}
    for line in out.splitlines():
        if m := re.search(r"\b(\d+) gateway\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\d+\s+([\d.]+)", line):
            got[f"gateway req/s c={m[1]}"] = float(m[2])
            got[f"gateway p99 ms c={m[1]}"] = float(m[4])
            got[f"gateway CPU us/call c={m[1]}"] = float(m[5])  # all the gateway's threads
        elif m := re.search(r"\b(\d+) direct\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", line):
            got[f"direct req/s c={m[1]}"] = float(m[2])
            got[f"direct p99 ms c={m[1]}"] = float(m[4])
        elif m := re.search(r"\b(\d+) added\s+p50 ([+-][\d.]+) ms", line):
            got[f"added p50 ms c={m[1]}"] = float(m[2])
        elif "stored spans" in line:
            got["stored spans ok"] = 1.0 if line.rstrip().endswith("OK") else 0.0
    return got


def read_ingest(out: str) -> dict[str, float]:
    """From ``benchmarks.store_ingest``: spans/s end to end per store."""
    return {f"{m[1]} spans/s": float(m[2]) for m in re.finditer(r"(?m)^(\S+)\s+end to end\s+([\d.]+) spans/s", out)}


def read_assembly(out: str) -> dict[str, float]:
    """From ``benchmarks.assembly``: fetch+assemble spans/s at 1x and at the larger size, and their time ratio."""
    m = re.search(r"(?m)^\s+fetch\+assemble\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)", out)
    if not m:
        return {}
    return {"fetch+assemble spans/s 1x": float(m[1].replace(",", "")),
            "fetch+assemble spans/s 10x": float(m[2].replace(",", "")), "time ratio 10x": float(m[3])}


BENCHES = {
    # Each durability mode of the code before beside the same mode of this code; commit (answer once the span
    # is committed, the default) has its own targets.
    "gateway": Bench("gateway overhead (chat, SQLite recording)", ["benchmarks.gateway_overhead"], read_gateway,
                     {"async": {"added p50 ms c=1": ("<=", 1.0), "gateway req/s c=32": (">=", 2000.0)},
                      "commit": {"added p50 ms c=1": ("<=", 1.5), "gateway req/s c=32": (">=", 2000.0)}},
                     (("async", ["--durability", "async"]), ("commit", ["--durability", "commit"]))),
    "ingest": Bench("span ingest, end to end", ["benchmarks.store_ingest", "--spans", "40000"], read_ingest,
                    {"": {"sqlite spans/s": (">=", 30_000.0), "postgresql spans/s": (">=", 10_000.0)}}),
    "assembly": Bench("trajectory assembly", ["benchmarks.assembly"], read_assembly,
                      {"": {"fetch+assemble spans/s 10x": (">=", 50_000.0)}}),
}


def baseline_tree(commit: str, tmp: Path) -> tuple[Path, str]:
    """The commit's files in ``tmp/src`` and a PYTHONPATH whose ``tracegym`` is that commit's package."""
    src, pkg = tmp / "src", tmp / "path" / "tracegym"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    mapping = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.copytree(src / mapping["tracegym"], pkg, symlinks=True)
    for name, folder in mapping.items():
        if name != "tracegym":
            (pkg / name.removeprefix("tracegym.")).symlink_to(src / folder)
    return src, os.pathsep.join([str(pkg.parent), str(src)])


def tree_env(pythonpath: str | None) -> dict[str, str]:
    """This environment with ``pythonpath`` (the baseline's package; None for this tree) first on PYTHONPATH."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run(bench: Bench, tree: Path, pythonpath: str | None, extra: list[str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-m", *bench.argv, *extra], cwd=tree, env=tree_env(pythonpath),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{bench.argv[0]} failed in {tree} ({proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-3000:]}")
    got = bench.read(proc.stdout)
    if not got:
        raise SystemExit(f"no result read from {bench.argv[0]} in {tree}:\n{proc.stdout[-3000:]}")
    return got


def which_tracegym(pythonpath: str | None, tree: Path) -> str:
    """Where the tree's ``tracegym.gateway`` is imported from (a check that PYTHONPATH wins over the
    editable install)."""
    code = "import tracegym.gateway as g; print(g.__file__)"
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=tree_env(pythonpath), capture_output=True,
                          text=True, check=True).stdout.strip()


def _report(before: list[dict[str, float]], this: list[dict[str, float]],
            targets: dict[str, tuple[str, float]]) -> bool:
    """Print each metric's medians and ratio, and whether this code meets its target; True if all met."""
    ok = True
    for key in this[0]:
        b = statistics.median(x[key] for x in before if key in x) if any(key in x for x in before) else None
        t = statistics.median(x[key] for x in this)
        line = f"  {key:28s} before {b:>12,.3f}" if b is not None else f"  {key:28s} before {'-':>12}"
        line += f"  this {t:>12,.3f}" + (f"  ratio {t / b:5.2f}" if b else "")
        if key in targets:
            op, bound = targets[key]
            met = t >= bound if op == ">=" else t <= bound
            ok &= met
            line += f"  target {op} {bound:,g}: {'met' if met else 'NOT met'}"
        print(line)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the commit (or tag, branch) to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="gateway,ingest,assembly", help="comma-separated: " + ", ".join(BENCHES))
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    if unknown := [n for n in names if n not in BENCHES]:
        raise SystemExit(f"unknown benchmark {unknown}; choose from {sorted(BENCHES)}")

    from benchmarks.machine import describe

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="tg-side-by-side-"))
    try:
        base_src, base_path = baseline_tree(args.baseline, tmp)
        before, this = f"{args.baseline} (before)", f"{head} (this)"
        print(f"{before}: tracegym.gateway from {which_tracegym(base_path, base_src)}", flush=True)
        print(f"{this}: tracegym.gateway from {which_tracegym(None, REPO)}", flush=True)
        print(describe(), flush=True)
        results: dict[str, dict[str, list[dict[str, float]]]] = {}
        for name in names:
            bench = BENCHES[name]
            print(f"\n== {bench.name}: {' '.join(bench.argv)}", flush=True)
            sides = []
            for v, extra in bench.variants:  # each variant of the baseline beside the same of this code
                sides += [(f"{before} {v}".rstrip(), base_src, base_path, extra),
                          (f"{this} {v}".rstrip(), REPO, None, extra)]
            for r in range(args.rounds):
                for label, tree, path, extra in sides:
                    got = run(bench, tree, path, extra)
                    results.setdefault(name, {}).setdefault(label, []).append(got)
                    shown = ", ".join(f"{k} {v:,.3f}" if abs(v) < 10 else f"{k} {v:,.0f}" for k, v in got.items())
                    print(f"  round {r + 1} {label}: {shown}", flush=True)
        print(f"\n{describe()}\nmedians of {args.rounds} rounds (ratio = this / before; targets on this code)")
        ok = True
        for name in names:
            bench = BENCHES[name]
            for variant, _ in bench.variants:
                label = f"{this} {variant}".rstrip()
                print(f"{bench.name}{f', this code with {variant}' if variant else ''}")
                base = results[name][f"{before} {variant}".rstrip()]
                ok &= _report(base, results[name][label], bench.targets.get(variant, {}))
        return 0 if ok else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
