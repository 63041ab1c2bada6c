"""`tracegym train` with `upstream.weight_sync: distributed` on tiny-random: the engine, gateway and runner
are the real processes `tracegym train` starts, and every step's weights reach the engine by a gloo
broadcast from the trainer's rank 0 over the weight-update group, never through a weights directory.
Checked: every step runs, each swap is a distributed one that becomes the engine's weight version (the
gateway's log and its store, where a broadcast version has no path), the calls of the last evaluation
were answered under the last version with the logprobs of the trainer's final weights (written to the run
directory at the end), and a resumed run sets the group up again with its fresh engine and goes on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.e2e.test_train_loop import _trained, _write_recipe


def _logprobs_under(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


@pytest.mark.slow
def test_train_pushes_every_step_over_the_weight_update_group(tmp_path: Path, tiny_model_dir: Path) -> None:
    recipe = _write_recipe(tmp_path, steps=2, keep="checkpoint",
                           upstream={"engine_dtype": "float32", "weight_sync": "distributed"})
    res, _, train_rows = _trained(recipe, steps=[1, 2])
    run = tmp_path / "run"
    swaps = sum(1 for r in train_rows if "loss" in r)
    assert swaps >= 1, train_rows  # a step whose groups all tie trains nothing (rare: 2 groups of 4)
    setups = re.findall(r"weight sync: distributed \(gloo\), rank 0 at 127\.0\.0\.1:\d+ with 1 engine\(s\) of 1 "
                        r"rank\(s\), set up in [\d.]+s \((.*)\)", res.stderr)
    assert setups == ["first push"], res.stderr[-3000:]
    gateway_log = (run / "logs" / "gateway.log").read_text()
    assert re.findall(r"(\w+) weight swap to (\d+): ok", gateway_log) == \
        [("distributed", str(v)) for v in range(1, swaps + 1)]
    assert sorted((run / "weights").iterdir()) == [run / "weights" / f"v{swaps}"]  # written once, at the end

    from tracegym.gateway.traces.reads import list_call_records
    from tracegym.gateway.traces.store import Store
    from tracegym.modelfiles.load import load_model

    store = Store.open(f"sqlite:///{run / 'tracegym.db'}")
    try:
        versions = {v["version"]: v["path"] for v in store.list_weight_versions()}
        assert versions == {str(v): None for v in range(1, swaps + 1)}  # broadcast: no directory
        done, _ = store.list_rollouts(status="completed", limit=500)
        calls = [c for r in done for c in list_call_records(store, r["rollout_id"])
                 if c.weight_version == str(swaps) and c.prompt_ids]
    finally:
        store.close()
    assert len(calls) >= 4  # the final evaluation's, at least
    model = load_model(run / "weights" / f"v{swaps}", device="cpu", dtype="float32")
    base = load_model(tiny_model_dir, device="cpu", dtype="float32")
    worst, moved = 0.0, 0.0
    for c in calls:
        ch = c.choices[0]
        want = _logprobs_under(model, c.prompt_ids, ch.output_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(ch.output_logprobs, want, strict=True)))
        old = _logprobs_under(base, c.prompt_ids, ch.output_ids)
        moved = max(moved, max(abs(a - b) for a, b in zip(old, want, strict=True)))
    print(f"{len(calls)} calls on version {swaps}: engine vs trainer logprobs within {worst:.2e}, "
          f"{moved:.2e} from the base model's")
    assert worst < 1e-3 < moved  # the trainer's weights, not the base model's

    # resumed: a fresh engine and gateway; the group is set up again, the checkpoint's version pushed
    res, _, train_rows = _trained(recipe, "--resume", "--steps", "3", steps=[1, 2, 3])
    assert re.findall(r"weight sync: distributed \(gloo\).*\((.*)\)", res.stderr) == ["first push"]
    again = [str(swaps)] + ([str(swaps + 1)] if "loss" in train_rows[-1] else [])  # the checkpoint's, step 3's
    gateway_log = (run / "logs" / "gateway.log").read_text()  # both runs' gateways, one after the other
    assert re.findall(r"(\w+) weight swap to (\d+): ok", gateway_log) == \
        [("distributed", v) for v in [*map(str, range(1, swaps + 1)), *again]]
