"""Named models: the prepared cache layout, idempotence, atomic/locked preparation, clear errors."""

from __future__ import annotations

import json
import threading
import time
from argparse import Namespace
from pathlib import Path

import pytest

from tracegym.models import ModelNotFoundError
from tracegym.trainer import models


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

    model = models.load_model(tiny_model_dir, device="cpu", dtype="float32")
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
