"""KV-batch mechanics: a row's logits do not depend on which rows share its batch, or when they joined."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracegym.engine import kv_batch as kvb
from tracegym.modelfiles.load import load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return load_model(tiny_model_dir, device="cpu", dtype="float32")


def _solo(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    batch, logits = kvb.prefill(model, [prompt], CPU)
    out, tokens = [logits[0]], []
    for _ in range(steps):
        tokens.append(int(logits[0].argmax()))
        logits = kvb.decode(model, batch, [tokens[-1]])
        out.append(logits[0])
    return tokens, torch.stack(out)


@torch.inference_mode()
def test_left_padding_select_and_merge_match_solo_runs(model) -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(3, 49152, (5,), generator=gen).tolist()
    b = torch.randint(3, 49152, (17,), generator=gen).tolist()
    ta, la = _solo(model, a, 4)
    tb, lb = _solo(model, b, 4)

    batch, logits = kvb.prefill(model, [a, b], CPU)
    torch.testing.assert_close(logits, torch.stack([la[0], lb[0]]), atol=1e-5, rtol=0)
    logits = kvb.decode(model, batch, [ta[0], tb[0]])
    torch.testing.assert_close(logits, torch.stack([la[1], lb[1]]), atol=1e-5, rtol=0)

    only_a = kvb.select(batch, [0], model.config)
    assert only_a.mask.shape == (1, 6)  # the 12 columns that were padding for every kept row are gone
    logits = kvb.decode(model, only_a, [ta[1]])
    torch.testing.assert_close(logits[0], la[2], atol=1e-5, rtol=0)

    late_b, first = kvb.prefill(model, [b], CPU)  # b joins a running batch
    merged = kvb.merge(only_a, late_b, model.config)
    assert merged.size == 2
    logits = kvb.decode(model, merged, [ta[2], tb[0]])
    torch.testing.assert_close(logits, torch.stack([la[3], lb[1]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(first[0], lb[0], atol=1e-5, rtol=0)
