"""A checkpoint writes tied embeddings once (run directories stay small) and still restores the
model and AdamW exactly; checkpoints written before, with the tied tensor twice, load too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracegym.trainer.workers.fsdp import load_sharded, save_sharded, shard_model, tied_aliases


def _model_and_optimizer(model_dir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import AutoModelForCausalLM

    model = shard_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    ids = torch.arange(1, 9).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.filterwarnings("error::UserWarning")  # DCP's single-process warning was noise after every run
def test_tied_embeddings_are_written_once_and_restored_exactly(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, opt = _model_and_optimizer(tiny_model_dir)
    _step(model, opt)
    assert tied_aliases(get_model_state_dict(model)) == {"lm_head.weight": "model.embed_tokens.weight"}
    save_sharded(model, opt, tmp_path / "dcp")
    saved = set(dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata)
    assert "model.model.embed_tokens.weight" in saved and "model.lm_head.weight" not in saved
    want = {k: v.clone() for k, v in model.state_dict().items()}

    other, other_opt = _model_and_optimizer(tiny_model_dir)  # fresh weights, an optimizer not stepped
    _step(other, other_opt)
    _step(other, other_opt)
    load_sharded(other, other_opt, tmp_path / "dcp")
    assert other.lm_head.weight is other.model.embed_tokens.weight  # still tied
    for k, v in other.state_dict().items():
        assert torch.equal(v, want[k]), k
    # the same next step from both: the optimizer state came back too
    _step(model, opt)
    _step(other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))


def test_a_checkpoint_with_the_tied_tensor_twice_still_loads(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _model_and_optimizer(tiny_model_dir)
    _step(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "old"), no_dist=True)  # as before
    other, other_opt = _model_and_optimizer(tiny_model_dir)
    _step(other, other_opt)
    _step(other, other_opt)
    load_sharded(other, other_opt, tmp_path / "old")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))
