"""Named models: the prepared cache layout, idempotence, atomic/locked preparation, clear errors."""

from __future__ import annotations

import json
import os
import threading
import time
from argparse import Namespace
from pathlib import Path

import pytest

from tracegym.modelfiles import folders, load
from tracegym.modelfiles import prepare as models
from tracegym.models import ModelNotFoundError


def test_tiny_random_has_the_files_the_gateway_reads(tiny_model_dir: Path) -> None:
    for name in models.REQUIRED_FILES:
        assert (tiny_model_dir / name).is_file(), name
    tok_cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert tok_cfg["eos_token"] == "<|im_end|>"
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 2
    assert "quantization_config" not in config
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    size_mb = (tiny_model_dir / "model.safetensors").stat().st_size / 2**20
    assert 1 < size_mb < 30


def test_tiny_random_tokenizer_matches_smollm2(tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.decode(tok.encode("What is 2+3?").ids) == "What is 2+3?"


def test_prepare_is_idempotent_and_fast_when_cached(tiny_model_dir: Path) -> None:
    t0 = time.monotonic()
    assert models.prepare_model("tiny-random") == tiny_model_dir
    assert time.monotonic() - t0 < 1.0


def test_load_model_is_deterministic_eval_mode(tiny_model_dir: Path) -> None:
    import torch

    model = load.load_model(tiny_model_dir, device="cpu", dtype="float32")
    assert not model.training
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    torch.manual_seed(0)
    fresh = type(model)(models.tiny_random_config())
    assert torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_local_directory_is_used_as_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert models.prepare_model(str(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        models.prepare_model(str(tmp_path))


def test_unknown_model_fails_fast_with_the_places_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(ModelNotFoundError) as err:
        models.prepare_model("no-such-org/no-such-model")
    assert time.monotonic() - t0 < 1.0
    message = str(err.value)
    assert "not a local directory" in message and "HF_HUB_OFFLINE" in message and "smollm2-135m" in message


def test_hub_check_gives_up_quickly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    t0 = time.monotonic()
    models.hub_reachable(timeout=1.0)
    assert time.monotonic() - t0 < 1.5


def test_concurrent_preparation_builds_once(tmp_path: Path) -> None:
    dest = tmp_path / "models" / "m"
    dest.parent.mkdir()
    builds: list[int] = []

    def build(d: Path) -> None:
        builds.append(1)
        time.sleep(0.3)
        for name in models.REQUIRED_FILES:
            (d / name).write_text("{}")

    threads = [threading.Thread(target=models.build_atomically, args=(dest, build)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert sorted(p.name for p in dest.iterdir()) == sorted(models.REQUIRED_FILES)
    assert [p.name for p in dest.parent.iterdir() if not p.name.endswith(".lock")] == ["m"]


def test_failed_preparation_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "m"

    def build(d: Path) -> None:
        (d / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        models.build_atomically(dest, build)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]


def test_models_cli(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert models.main(Namespace(action="path", name="tiny-random")) == 0
    assert capsys.readouterr().out.strip() == str(tiny_model_dir)
    assert models.main(Namespace(action="path", name="no-such-model")) == 1
    assert "not prepared" in capsys.readouterr().err


def test_replace_dir_never_leaves_no_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest, aside = tmp_path / "ckpt", folders.aside_dir(tmp_path / "ckpt")

    def built(name: str, content: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "f").write_text(content)
        return d

    assert folders.replace_dir(built(".new1", "one"), dest) == dest  # no previous copy
    folders.replace_dir(built(".new2", "two"), dest)  # replaces it
    assert (dest / "f").read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    # a crash right after the old copy was renamed aside: dest is missing, the old copy is aside
    real_rename = models.os.rename

    def crash_on_second(src: Path, dst: Path, calls: list[int] = []) -> None:  # noqa: B006
        calls.append(1)
        if len(calls) == 2:
            raise OSError("killed")
        real_rename(src, dst)

    monkeypatch.setattr(folders.os, "rename", crash_on_second)
    with pytest.raises(OSError, match="killed"):
        folders.replace_dir(built(".new3", "three"), dest)
    monkeypatch.setattr(folders.os, "rename", real_rename)
    assert not dest.exists() and (aside / "f").read_text() == "two"
    # the next replacement keeps that only old copy until the new one is in place, then drops it
    folders.replace_dir(built(".new4", "four"), dest)
    assert (dest / "f").read_text() == "four" and not aside.exists()

    # or the interrupted state is recovered as it was
    folders.replace_dir(built(".new5", "five"), dest)
    real_rename(dest, aside)
    assert folders.recover_dir(dest) == dest and (dest / "f").read_text() == "five" and not aside.exists()
    assert folders.recover_dir(dest) == dest  # nothing to do


def test_hub_id_cache_dir_is_found_by_models_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tracegym models path org/name`` finds what ``prepare`` put in the cache (``org--name``)."""
    from tracegym.models import find_local_model_dir, model_cache_dir

    monkeypatch.setenv("TRACEGYM_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = model_cache_dir("some-org/some-model")
    assert d == tmp_path / "models" / "some-org--some-model"
    assert models.main(Namespace(action="path", name="some-org/some-model")) == 1
    assert "not prepared" in capsys.readouterr().err
    d.mkdir(parents=True)
    for name in models.REQUIRED_FILES:
        (d / name).write_text("{}")
    assert find_local_model_dir("some-org/some-model") == d
    assert models.prepare_model("some-org/some-model") == d  # the same directory, no hub needed
    assert models.main(Namespace(action="path", name="some-org/some-model")) == 0
    assert capsys.readouterr().out.strip() == str(d)


def test_bf16_compute_falls_back_to_fp32_on_a_cpu_without_fast_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(load, "cpu_bf16_is_fast", lambda: False)
    assert load.cpu_compute_dtype(torch.bfloat16) is torch.float32
    assert load.cpu_compute_dtype(torch.float32) is torch.float32
    monkeypatch.setattr(load, "cpu_bf16_is_fast", lambda: True)
    assert load.cpu_compute_dtype(torch.bfloat16) is torch.bfloat16


def test_bf16_speed_probe_times_a_small_llama(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv(load.CPU_BF16_ENV, raising=False)
    ratio = load.bf16_slowdown()
    assert 0 < ratio < 1000
    assert load.cpu_bf16_is_fast() == (torch.ops.mkldnn._is_mkldnn_bf16_supported() and ratio <= 1.0)
    want = torch.bfloat16 if load.cpu_bf16_is_fast() else torch.float32
    assert load.cpu_compute_dtype(torch.bfloat16) is want


def test_one_bf16_decision_for_the_processes_a_run_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$TRACEGYM_CPU_BF16`` decides without timing (``tracegym train`` sets it from its one probe, so its
    engine and trainer agree); a value other than fast/slow is an error, not a silent probe."""
    import torch

    def no_probe() -> float:
        raise AssertionError("timed although the environment decides")

    monkeypatch.setattr(load, "bf16_slowdown", no_probe)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.setenv(load.CPU_BF16_ENV, "slow")
    assert load.cpu_compute_dtype(torch.bfloat16) is torch.float32
    monkeypatch.setenv(load.CPU_BF16_ENV, "fast")
    assert load.cpu_compute_dtype(torch.bfloat16) is torch.bfloat16
    load.decide_cpu_bf16()  # already decided: kept
    assert os.environ[load.CPU_BF16_ENV] == "fast"
    monkeypatch.setenv(load.CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match="must be 'fast' or 'slow'"):
        load.cpu_bf16_is_fast()

    monkeypatch.delenv(load.CPU_BF16_ENV)
    monkeypatch.setattr(load, "bf16_slowdown", lambda: 1.4)
    load.decide_cpu_bf16()
    assert os.environ[load.CPU_BF16_ENV] == "slow"
    monkeypatch.setattr(load, "bf16_slowdown", no_probe)
    assert load.cpu_compute_dtype(torch.bfloat16) is torch.float32
