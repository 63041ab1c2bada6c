"""One directory per run: timestamped directories with a ``latest`` link, a fixed run_dir refused
once it holds a run unless --resume or --overwrite, what an ended run keeps (``keep``), and the run
directory's size."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from tracegym.trainer.recipe import RecipeError
from tracegym.trainer.run.run_dirs import (
    check_run_dir,
    disk_use,
    fmt_bytes,
    format_disk_use,
    open_run_dir,
    resume_dir,
    trim_run_dir,
)

NOW = datetime(2026, 11, 24, 10, 25, 30, tzinfo=UTC)


def test_every_run_gets_a_new_directory_and_latest_points_at_the_newest(tmp_path: Path) -> None:
    template = tmp_path / "runs" / "qs" / "{timestamp}"
    first = open_run_dir(template, "qs", resume=False, overwrite=False, now=NOW)
    (first.path / "summary.md").write_text("first run\n")
    second = open_run_dir(template, "qs", resume=False, overwrite=False, now=NOW)  # the same second
    assert first.path == tmp_path / "runs" / "qs" / "20261124-102530"
    assert second.path == tmp_path / "runs" / "qs" / "20261124-102530-2"
    assert (first.path / "summary.md").read_text() == "first run\n" and not any(second.path.iterdir())
    latest = tmp_path / "runs" / "qs" / "latest"
    assert latest.is_symlink() and latest.resolve() == second.path
    assert (first.run_id, second.run_id) == ("qs-20261124-102530", "qs-20261124-102530-2")
    # --resume continues the newest, under the same store run id
    resumed = open_run_dir(template, "qs", resume=True, overwrite=False)
    assert resumed == second and resume_dir(template) == second.path


def test_resume_without_an_earlier_run_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="no earlier run"):
        check_run_dir(tmp_path / "runs" / "{timestamp}", resume=True, overwrite=False)
    with pytest.raises(RecipeError, match="give one of them"):
        check_run_dir(tmp_path / "run", resume=True, overwrite=True)


def test_a_fixed_run_dir_holding_a_run_is_refused_without_resume_or_overwrite(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert open_run_dir(run, "exp", resume=False, overwrite=False).run_id == "exp"  # new: fine
    (run / "notes.txt").write_text("mine")  # not a run's file: does not count
    check_run_dir(run, resume=False, overwrite=False)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoint").mkdir()
    (run / "checkpoint" / "trainer_state.json").write_text("{}")
    with pytest.raises(RecipeError) as err:
        check_run_dir(run, resume=False, overwrite=False)
    msg = str(err.value)
    assert "already holds a run (metrics.jsonl, checkpoint)" in msg and "--resume" in msg and "--overwrite" in msg
    check_run_dir(run, resume=True, overwrite=False)
    assert open_run_dir(run, "exp", resume=True, overwrite=False).path == run
    assert (run / "metrics.jsonl").is_file()
    # --overwrite deletes the run's files, nothing else
    open_run_dir(run, "exp", resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_disk_use_by_part(tmp_path: Path) -> None:
    (tmp_path / "checkpoint" / "dcp").mkdir(parents=True)
    (tmp_path / "checkpoint" / "dcp" / "a.distcp").write_bytes(b"x" * 3000)
    (tmp_path / "weights" / "v3").mkdir(parents=True)
    (tmp_path / "weights" / "v3" / "model.safetensors").write_bytes(b"x" * 2000)
    (tmp_path / "tracegym.db").write_bytes(b"x" * 500)
    (tmp_path / "metrics.jsonl").write_bytes(b"x" * 10)
    parts = disk_use(tmp_path)
    assert parts == {"checkpoint": 3000, "weights": 2000, "store": 500, "logs": 0, "other": 10, "total": 5510}
    assert format_disk_use(parts) == "5.51 kB: checkpoint 3 kB, weights 2 kB, store 500 B, other 10 B"
    assert fmt_bytes(1_700_000_000) == "1.7 GB" and fmt_bytes(260_000_000) == "260 MB"


def _ended_run(d: Path, model_dir: Path) -> Path:
    """A run directory as the loop leaves it: a checkpoint, an aside copy, the last weights, the rest."""
    (d / "checkpoint" / "dcp").mkdir(parents=True)
    (d / "checkpoint" / "dcp" / "a.distcp").write_bytes(b"x" * 3000)
    (d / ".checkpoint.old").mkdir()
    (d / "weights" / "v3").mkdir(parents=True)
    (d / "weights" / "v3" / "model.safetensors").write_bytes(b"x" * 2000)
    (d / "tracegym.db").write_bytes(b"x" * 500)
    (d / "metrics.jsonl").write_bytes(b"x" * 10)
    model_dir.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        (model_dir / name).write_text(name)
    return d


@pytest.mark.parametrize(("keep", "left"), [
    ("checkpoint", [".checkpoint.old", "checkpoint", "metrics.jsonl", "tracegym.db", "weights"]),
    ("weights", ["metrics.jsonl", "tracegym.db", "weights"]),
    ("none", ["metrics.jsonl", "tokenizer", "tracegym.db"]),
])
def test_an_ended_run_keeps_what_keep_says(tmp_path: Path, keep: str, left: list[str]) -> None:
    run = _ended_run(tmp_path / "run", tmp_path / "model")
    trim_run_dir(run, keep, tmp_path / "model")
    assert sorted(p.name for p in run.iterdir()) == left
    parts = disk_use(run)
    assert (parts["checkpoint"], parts["weights"]) == {"checkpoint": (3000, 2000), "weights": (0, 2000),
                                                       "none": (0, 0)}[keep]
    if keep == "none":  # the inspector's tokens-as-text need the tokenizer, never the weights
        assert sorted(p.name for p in (run / "tokenizer").iterdir()) == [
            "config.json", "tokenizer.json", "tokenizer_config.json"]
    with pytest.raises(ValueError, match=r"none \| weights \| checkpoint, got .everything."):
        trim_run_dir(run, "everything", tmp_path / "model")
