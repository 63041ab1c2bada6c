"""``load.own_weights``: a model loaded from a safetensors file holds its weights in the process's own
memory, not as copy-on-write views of the mapped file, with its tied parameters still one."""

from __future__ import annotations

from pathlib import Path

import torch


def _file_mappings(name: str) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(name):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((lo, hi))
    return out


def _mapped(p: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= p.data_ptr() < hi for lo, hi in ranges)


def test_loaded_weights_are_the_processs_own_and_ties_stay(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tracegym.modelfiles.load import load_model, own_weights

    path = tiny_model_dir / "model.safetensors"
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    # what transformers gives: views of the mapped file (else this test has nothing to check)
    assert any(_mapped(p, _file_mappings(str(path))) for p in plain.parameters())
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    own_weights(plain)
    assert not any(_mapped(p, _file_mappings(str(path))) for p in plain.parameters())
    assert all(p.untyped_storage().resizable() for p in plain.parameters())
    assert all(torch.equal(p, before[n]) for n, p in plain.named_parameters())
    assert plain.get_output_embeddings().weight is plain.get_input_embeddings().weight  # tied: still one

    model = load_model(tiny_model_dir, dtype=torch.float32)
    assert all(p.untyped_storage().resizable() for p in model.parameters())
    with torch.no_grad():  # a write reaches the tied parameter's other name too
        model.get_input_embeddings().weight[0, 0] = 7.0
    assert model.get_output_embeddings().weight[0, 0].item() == 7.0
