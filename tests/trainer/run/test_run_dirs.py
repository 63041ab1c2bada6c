"""One directory per run: timestamped directories with a ``latest`` link, a fixed run_dir refused
once it holds a run unless --resume or --overwrite, and the run directory's size."""

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
