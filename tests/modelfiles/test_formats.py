"""``write_safetensors``: the format safetensors reads back exactly, and an older file overwritten in place
when it has the size the new one needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tracegym.modelfiles.formats import write_safetensors


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(7, 5, generator=g).bfloat16(), "norm": torch.randn(5, generator=g),
            "steps": torch.arange(3) + seed, "flag": torch.tensor(seed % 2 == 0), "empty": torch.zeros(0, 4),
            "view": torch.randn(4, 6, generator=g).t()}  # not contiguous


def test_what_it_writes_safetensors_reads_back_exactly(tmp_path: Path) -> None:
    t = _tensors(1)
    write_safetensors(t, tmp_path / "w.safetensors", metadata={"format": "pt"})
    back = load_file(tmp_path / "w.safetensors")
    assert set(back) == set(t)
    for name, want in t.items():
        assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    head = int.from_bytes((tmp_path / "w.safetensors").read_bytes()[:8], "little")
    assert head % 8 == 0  # the header is padded so the data starts aligned


def test_a_file_of_the_same_size_is_overwritten_in_place(tmp_path: Path) -> None:
    old = write_safetensors(_tensors(1), tmp_path / "old.safetensors")
    inode = old.stat().st_ino
    new = write_safetensors(_tensors(2), tmp_path / "new.safetensors", reuse=old)
    assert not old.exists() and new.stat().st_ino == inode
    back = load_file(new)
    assert all(torch.equal(back[n], t) for n, t in _tensors(2).items())


def test_a_file_of_another_size_is_left_alone(tmp_path: Path) -> None:
    old = write_safetensors({"w": torch.ones(3)}, tmp_path / "old.safetensors")
    before = old.read_bytes()
    new = write_safetensors(_tensors(2), tmp_path / "new.safetensors", reuse=old)
    assert old.read_bytes() == before and new.stat().st_ino != old.stat().st_ino
    assert torch.equal(load_file(new)["embed"], _tensors(2)["embed"])
    # a reuse path that is not there is no error either
    write_safetensors(_tensors(3), tmp_path / "third.safetensors", reuse=tmp_path / "missing")


def test_bad_input_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "c.safetensors")
