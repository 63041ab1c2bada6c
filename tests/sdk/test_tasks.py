"""The JSONL task file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracegym.tasks import read_tasks


def test_read_tasks(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"task_id": "a", "input": {"q": 1}}\n\n{"q": 2}\n"plain"\n{"input": 3, "split": "test"}\n')
    assert read_tasks(f) == [
        {"task_id": "a", "input": {"q": 1}},
        {"input": {"q": 2}},
        {"input": "plain"},
        {"input": 3, "split": "test"},
    ]
    f.write_text('{"input": 1, "answer": 2}\n')
    with pytest.raises(ValueError, match="unknown task fields"):
        read_tasks(f)
    f.write_text("{oops\n")
    with pytest.raises(ValueError, match=r"t.jsonl:1: not valid JSON"):
        read_tasks(f)
