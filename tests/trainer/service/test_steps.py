"""The service's operations on a real ``TrainWorker`` (tiny-random, fp32, in this process): a
``forward_backward`` that fails part-way leaves the gradients it found, ``forward`` touches none,
``optim_step`` needs gradients, and ``tracegym/grpo`` through these operations moves the weights exactly
as the trainer's own GRPO step on the same batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tracegym.trainer.algorithms.registry import UnknownNameError
from tracegym.trainer.service import steps
from tracegym.trainer.settings import OptimConfig
from tracegym.trainer.workers.batches import TrainBatch, TrainSample, plan_step
from tracegym.trainer.workers.group import WorkerGroup
from tracegym.trainer.workers.train_config import TrainConfig

ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "grad_clip_norm": 1.0}
OPTIM = OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, grad_clip=1.0, dtype="float32",
                    micro_batch_tokens=64)


def _group(model_dir: Path) -> WorkerGroup:
    return WorkerGroup(model_dir, num_workers=1, train_cfg=TrainConfig(optim=OPTIM, device="cpu"), use_ray=False)


def _grads(group: WorkerGroup) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in group._workers[0].model.parameters()]


def _datum(rng: np.random.Generator, n: int, vocab: int = 4000) -> steps.Datum:
    ids = rng.integers(3, vocab, n + 1)
    return steps.Datum(ids[:-1], ids[1:], {"weights": np.ones(n, np.float32)})


@pytest.mark.parametrize(("loss", "why"), [
    ("tracegym/dpo", "it needs a frozen reference model, which a run does not hold"),
    ("tracegym/distill", "it needs a teacher model, which a run does not hold"),
])
def test_objectives_that_need_another_model_are_refused_saying_why(loss: str, why: str) -> None:
    with pytest.raises(UnknownNameError) as e:
        steps.check_loss(loss, {})
    assert str(e.value).startswith(f"unknown loss_fn {loss!r} ({why}")
    assert str(e.value).endswith("; valid: " + ", ".join(steps.loss_names()))


def test_a_failed_forward_backward_leaves_the_earlier_gradients(tiny_model_dir: Path, trainer_imports: None) -> None:
    group, rng = _group(tiny_model_dir), np.random.default_rng(0)
    with pytest.raises(steps.NoGradientsError, match="run forward_backward"):
        group.run_on_ranks(steps.optim_step, ADAM)
    [(outputs, metrics)] = group.run_on_ranks(steps.forward_backward, [_datum(rng, 40)], "cross_entropy", {})
    assert metrics["loss:sum"] == pytest.approx(-outputs[0]["logprobs"].sum(), rel=1e-5)
    before = _grads(group)
    bad = _datum(rng, 40)
    bad.targets[-1] = 10**6  # outside the vocabulary: the second micro-batch fails after the first's backward
    with pytest.raises((IndexError, RuntimeError)):
        group.run_on_ranks(steps.forward_backward, [_datum(rng, 40), bad], "cross_entropy", {})
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before, _grads(group), strict=True))
    group.run_on_ranks(steps.forward, [_datum(rng, 40)], "cross_entropy", {})
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before, _grads(group), strict=True))
    [m] = group.run_on_ranks(steps.optim_step, ADAM)
    assert m["step"] == 1 and m["skipped"] == 0 and m["grad_norm"] > 0
    assert all(g is None for g in _grads(group))
    group.shutdown()


def test_tracegym_grpo_moves_the_weights_exactly_as_the_trainer_step(tiny_model_dir: Path,
                                                                     trainer_imports: None) -> None:
    rng = np.random.default_rng(1)
    samples = []
    for n, prompt, adv in ((14, 5, 1.0), (9, 3, -0.5), (20, 8, 0.25)):
        mask = np.zeros(n, np.int8)
        mask[prompt:] = 1
        samples.append(TrainSample(rng.integers(3, 4000, n), mask, rng.normal(-2, 0.5, n) * mask, adv))
    trainer = _group(tiny_model_dir)
    trainer.train_step(TrainBatch(samples), objective="grpo")
    service = _group(tiny_model_dir)
    (groups,), _ = plan_step([len(s.token_ids) for s in samples], 1, OPTIM.micro_batch_tokens)
    [order] = groups  # one micro-batch: the trainer's row order is the order to send the datums in
    data = [steps.Datum(s.token_ids[:-1], s.token_ids[1:], {
        "weights": s.loss_mask[1:].astype(np.float32),
        "advantages": np.full(len(s.token_ids) - 1, s.advantage, np.float32),
        "logprobs": s.engine_logprobs[1:].astype(np.float32)}) for s in (samples[i] for i in order)]
    service.run_on_ranks(steps.forward_backward, data, "tracegym/grpo", {})
    service.run_on_ranks(steps.optim_step, ADAM)
    ours = dict(service._workers[0].model.named_parameters())
    theirs = dict(trainer._workers[0].model.named_parameters())
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    start = dict(_group(tiny_model_dir)._workers[0].model.named_parameters())
    assert max(float((theirs[k] - start[k]).abs().max()) for k in theirs) > 1e-4  # the step moved them
    trainer.shutdown()
    service.shutdown()
