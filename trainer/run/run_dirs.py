"""Where a ``tracegym train`` run keeps its files, one directory per run.

``run_dir`` ending in ``{timestamp}`` (the default: ``runs/{name}/{timestamp}`` under the current
directory): every run gets a new directory named by its start time (UTC, ``20261124-102530``; ``-2``,
``-3``... when that name is taken) and the sibling link ``latest`` points at the newest; ``--resume``
continues the run ``latest`` points at. Its metrics go to the store as run ``{name}-{timestamp}``, so
runs sharing a store stay apart.

Any other ``run_dir`` is one run's directory: a second run refuses it once it holds a run's files, unless
``--resume`` (continue it) or ``--overwrite`` (delete those files first) says what to do. Its metrics go
to the store as run ``{name}``.

What a run directory keeps (nothing grows with the step count): ``checkpoint/`` (the last resumable
checkpoint: fp32 model, AdamW moments, RNG, loop state), ``weights/v<N>/`` (the last weight version, in
``upstream.engine_dtype``), ``tracegym.db`` (the store, when it is the default SQLite file), ``logs/``,
``metrics.jsonl``, ``summary.md``, ``reward_curve.png``. Once the run has ended, the recipe's ``keep``
decides which of the model-sized parts stay (``trim_run_dir``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tracegym.trainer.recipe import TIMESTAMP, RecipeError

LATEST = "latest"
RUN_FILES = (
    "metrics.jsonl", "summary.md", "reward_curve.png", "checkpoint", ".checkpoint.old", ".checkpoint.tmp",
    "weights", "tokenizer", "logs", "tracegym.db", "tracegym.db-wal", "tracegym.db-shm", "tb", "wandb",
)  # fmt: skip
"""The files and directories a run writes into its directory (``--overwrite`` deletes these only)."""


@dataclass(frozen=True)
class RunDir:
    path: Path
    run_id: str
    """The run's name in the store (its metrics, the inspector's Runs page)."""


def is_per_run(template: Path) -> bool:
    """Whether ``run_dir`` makes a new directory for every run (its last part is ``{timestamp}``)."""
    return template.name == TIMESTAMP


def run_files(d: Path) -> list[str]:
    """The names of a run's files present in ``d``."""
    return [n for n in RUN_FILES if (d / n).exists() or (d / n).is_symlink()]


def resume_dir(template: Path) -> Path:
    """The directory ``--resume`` continues: the one ``latest`` points at, or ``template`` itself."""
    return (template.parent / LATEST).resolve() if is_per_run(template) else template


def check_run_dir(template: Path, *, resume: bool, overwrite: bool) -> None:
    """Raise ``RecipeError`` if the run cannot start in ``template`` as asked (checked before any process
    starts; ``open_run_dir`` makes the directory)."""
    if resume and overwrite:
        raise RecipeError("--resume continues a run and --overwrite deletes it: give one of them")
    if is_per_run(template):
        link = template.parent / LATEST
        if resume and not link.is_dir():
            raise RecipeError(f"--resume: no earlier run of this recipe to continue ({link} does not exist)")
        return
    found = run_files(template)
    if found and not resume and not overwrite:
        raise RecipeError(
            f"run_dir {template} already holds a run ({', '.join(found)}): --resume continues it, "
            "--overwrite deletes it and starts again; or set run_dir to a new directory (a run_dir ending "
            f"in /{TIMESTAMP} gets a new one every run)"
        )


def open_run_dir(
    template: Path, name: str, *, resume: bool, overwrite: bool, now: datetime | None = None
) -> RunDir:
    """Check (``check_run_dir``), then make the run's directory: a new timestamped one with ``latest``
    pointing at it, the one ``latest`` points at (``resume``), or ``template`` itself (emptied of a
    run's files with ``overwrite``)."""
    check_run_dir(template, resume=resume, overwrite=overwrite)
    if not is_per_run(template):
        if overwrite:
            for n in run_files(template):
                p = template / n
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        template.mkdir(parents=True, exist_ok=True)
        return RunDir(template, name)
    parent = template.parent
    if resume:
        path = resume_dir(template)
        return RunDir(path, f"{name}-{path.name}")
    parent.mkdir(parents=True, exist_ok=True)
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    for i in range(1, 1000):
        path = parent / (stamp if i == 1 else f"{stamp}-{i}")
        try:
            path.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise RecipeError(f"no free run directory name for {stamp} in {parent}")
    _point(parent / LATEST, path.name)
    return RunDir(path, f"{name}-{path.name}")


def _point(link: Path, target: str) -> None:
    """Make ``link`` a relative symlink to ``target``, replaced atomically."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


CHECKPOINT_DIRS = ("checkpoint", ".checkpoint.old", ".checkpoint.tmp")


def trim_run_dir(run_dir: Path, keep: str, model_dir: Path) -> None:
    """At the end of a run, delete the model-sized parts the recipe's ``keep`` does not ask for:
    ``checkpoint/`` (and an aside copy) unless ``keep`` is ``checkpoint``; ``weights/`` when it is
    ``none``, whose tokenizer files are copied to ``tokenizer/`` first from the model directory (the
    trace inspector shows tokens as text with them, ``tracegym inspect RUN_DIR``)."""
    from tracegym.modelfiles.formats import WEIGHT_SUFFIXES

    if keep not in ("none", "weights", "checkpoint"):
        raise ValueError(f"keep must be none | weights | checkpoint, got {keep!r}")
    if keep != "checkpoint":
        for name in CHECKPOINT_DIRS:
            shutil.rmtree(run_dir / name, ignore_errors=True)
    if keep == "none":
        tok = run_dir / "tokenizer"
        tok.mkdir(exist_ok=True)
        for f in Path(model_dir).iterdir():
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(f, tok / f.name)
        shutil.rmtree(run_dir / "weights", ignore_errors=True)


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed)."""
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def disk_use(run_dir: Path) -> dict[str, int]:
    """Bytes per part of a run directory: ``checkpoint``, ``weights``, ``store`` (the SQLite files),
    ``logs``, ``other``; and ``total``."""
    parts = {"checkpoint": 0, "weights": 0, "store": 0, "logs": 0, "other": 0}
    for p in run_dir.iterdir() if run_dir.is_dir() else ():
        n = p.name
        key = (
            "checkpoint" if "checkpoint" in n
            else "store" if n.startswith("tracegym.db")
            else n if n in ("weights", "logs")
            else "other"
        )  # fmt: skip
        parts[key] += dir_bytes(p)
    parts["total"] = sum(parts.values())
    return parts


def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def format_disk_use(parts: dict[str, int]) -> str:
    """``81.2 MB: checkpoint 50 MB, weights 31 MB, store 0.4 MB, ...``: the parts that are not empty."""
    shown = [f"{k} {fmt_bytes(v)}" for k, v in parts.items() if k != "total" and v]
    return fmt_bytes(parts["total"]) + (f": {', '.join(shown)}" if shown else "")
