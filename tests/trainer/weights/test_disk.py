"""Weight export and the trainer's side of the weight pushes, always through a real gateway (the trainer
never talks to the engine's weight or pause routes; the gateway's coordinator runs the sequences).

Disk: a real ``tracegym engine`` process behind the gateway: the pushed weights are what the engine
serves afterwards; a corrupt push is refused and the old weights stay."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.gateway.app_support import ServerThread
from tests.procs import ManagedProcess, free_port, start_process
from tests.trainer.weights.gateway_support import weights_gateway
from tracegym.modelfiles.formats import write_weights_dir
from tracegym.trainer.weights.disk import DiskWeightSync
from tracegym.trainer.weights.gateway import WeightSyncError


def test_write_weights_dir_loads_with_from_pretrained(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tensors = {n: p.detach() + 0.5 for n, p in model.named_parameters()}  # tied lm_head appears once
    out = write_weights_dir(tensors, tiny_model_dir, tmp_path / "v3")
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for n, p in loaded.named_parameters():
        assert torch.equal(p, tensors[n]), n
    assert torch.equal(loaded.lm_head.weight, tensors["model.embed_tokens.weight"])


# --- disk ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[ManagedProcess, ServerThread]]:
    port = free_port()
    engine = start_process(["tracegym", "engine", "--model", str(tiny_model_dir), "--port", str(port)],
                           port=port, log_path=tmp_path_factory.mktemp("engine") / "engine.log")
    try:
        with weights_gateway(engine.base_url, tiny_model_dir, weights_dir=tmp_path_factory.getbasetemp()) as gw:
            yield engine, gw
    finally:
        engine.stop()


class PerturbedGroup:
    """What ``DiskWeightSync`` needs of a ``WorkerGroup``: tiny-random's weights, shifted per save."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.base = load_file(str(model_dir / "model.safetensors"))
        self.saves = 0

    def save_weights(self, out_dir: Path, dtype: str | None = None, reuse: Path | None = None) -> Path:
        self.saves += 1
        gen = torch.Generator().manual_seed(self.saves)
        tensors = {n: t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in self.base.items()}
        self.last = tensors
        return write_weights_dir(tensors, self.model_dir, out_dir, reuse)


def _logprobs(engine: ManagedProcess) -> tuple[list[float], str]:
    """The engine's greedy logprobs for a fixed prompt, and the version it reports (the test asks the
    engine directly to see what it serves)."""
    r = httpx.post(engine.base_url + "/generate", timeout=60, json={
        "input_ids": [1, 9690, 314, 253], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return [t[0] for t in meta["output_token_logprobs"]], meta["weight_version"]


def test_disk_push_through_the_gateway_into_a_real_engine(engine_gateway, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    engine, gw = engine_gateway
    before, _ = _logprobs(engine)
    sync = DiskWeightSync(gw.url, tmp_path / "weights", keep=2)
    group = PerturbedGroup(tiny_model_dir)
    root = tmp_path / "weights"
    results = [sync.push(group, 1)]
    v1_file = (root / "v1" / "model.safetensors").stat().st_ino
    results += [sync.push(group, v) for v in (2, 3)]
    assert (root / ".spare.safetensors").stat().st_ino == v1_file  # v1 pruned, its weights file kept aside
    results.append(sync.push(group, 4))
    status = httpx.get(gw.url + "/api/weights").json()
    assert status["weight_version"] == "4"
    assert status["last_swap"]["kind"] == "disk" and status["last_swap"]["model_path"] == str(root / "v4")
    after, version = _logprobs(engine)
    assert version == "4" and after != before
    # v4 was written into v1's file in place, and holds exactly v4's weights
    assert (root / "v4" / "model.safetensors").stat().st_ino == v1_file
    served = load_file(root / "v4" / "model.safetensors")
    assert all(torch.equal(served[n], t) for n, t in group.last.items())
    assert sorted(p.name for p in root.iterdir()) == [".spare.safetensors", "v3", "v4"]
    r = results[-1]
    assert r.version == "4" and r.path == root / "v4"
    assert r.total_s >= r.save_s + r.update_s - 1e-6 and r.update_s > 0
    with pytest.raises(ValueError, match="must match"):
        sync.version_dir("../x")
    sync.close()
    assert not (root / ".spare.safetensors").exists()
    # a restarted trainer (resume) counts the directories already there
    again = DiskWeightSync(gw.url, root, keep=2)
    again.push(group, 5)
    again.close()
    assert sorted(p.name for p in root.iterdir()) == ["v4", "v5"]


def test_a_refused_disk_push_raises_and_the_engine_keeps_its_weights(engine_gateway, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    engine, gw = engine_gateway
    before = _logprobs(engine)

    class CorruptGroup:
        def save_weights(self, out_dir: Path, dtype: str | None = None, reuse: Path | None = None) -> Path:
            out_dir.mkdir(parents=True)
            (out_dir / "config.json").write_text((tiny_model_dir / "config.json").read_text())
            (out_dir / "model.safetensors").write_bytes(b"not a safetensors file")
            return out_dir

    sync = DiskWeightSync(gw.url, tmp_path / "weights")
    with pytest.raises(WeightSyncError, match=r"/api/weights/update: gateway answered 400: .*Failed to update weights"):
        sync.push(CorruptGroup(), "bad")
    sync.close()
    assert _logprobs(engine) == before
    assert httpx.get(gw.url + "/api/weights").json()["last_swap"]["success"] is False


# --- distributed: the client's requests ----------------------------------------------------------------
