"""Ray/FSDP2 trainer workers on CPU (2 ranks, gloo) with ``tiny-random``, and the disk weight hot-swap
into a real ``tracegym engine`` process."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.gateway.app_support import MemoryRecorder, ServerThread
from tests.procs import free_port, start_process
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings
from tracegym.trainer.settings import OptimConfig
from tracegym.trainer.weights.disk import DiskWeightSync
from tracegym.trainer.workers.batches import TrainBatch, TrainSample
from tracegym.trainer.workers.group import WorkerGroup
from tracegym.trainer.workers.train_config import TrainConfig

CFG = TrainConfig(optim=OptimConfig(lr=1e-3, warmup_steps=1, micro_batch_tokens=96, dtype="float32"))


def fixed_batch(advantages: list[float] | None = None, seed: int = 0) -> TrainBatch:
    rng = random.Random(seed)
    advs = advantages or [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]
    samples = []
    for adv in advs:
        p, c = rng.randint(4, 16), rng.randint(3, 10)
        ids = [rng.randint(3, 2000) for _ in range(p + c)]
        samples.append(TrainSample(ids, [0] * p + [1] * c, [-4.0] * (p + c), adv))
    return TrainBatch(samples)


@pytest.fixture(scope="module")
def group(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerGroup, Path]]:
    """Two Ray actors and a step-0 checkpoint every test can reset to."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    g = WorkerGroup(tiny_model_dir, num_workers=2, train_cfg=CFG, use_ray=True)
    start = g.save_checkpoint(tmp_path_factory.mktemp("ckpt") / "step0")
    try:
        yield g, start
    finally:
        g.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_a_step_changes_weights_identically_on_both_ranks_and_matches_one_worker(
    group: tuple[WorkerGroup, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    g, start = group
    g.load_checkpoint(start)
    before = g.state_dict_checksum()
    assert len(before) == 2 and before[0] == before[1]
    batch = fixed_batch()
    metrics = g.train_step(batch)
    after = g.state_dict_checksum()
    assert after[0] == after[1] != before[0]
    for key in (
        "loss",
        "kl",
        "clip_frac",
        "entropy",
        "mismatch",
        "grad_norm",
        "lr",
        "tokens",
        "tokens_per_s",
    ):
        assert key in metrics, key
    assert metrics["tokens"] == batch.num_tokens and metrics["loss_tokens"] == batch.num_loss_tokens
    assert metrics["lr"] == pytest.approx(0.5e-3)  # step 0 of a 1-step warmup

    # the same step on one in-process worker (no Ray, no sharding) gives the same update
    one = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=CFG, use_ray=False)
    try:
        w0 = load_file(one.save_weights(tmp_path / "zero") / "model.safetensors")
        m1 = one.train_step(batch)
        w1 = load_file(one.save_weights(tmp_path / "one") / "model.safetensors")
    finally:
        one.shutdown()
    w2 = load_file(g.save_weights(tmp_path / "two") / "model.safetensors")
    assert m1["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    assert m1["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-6)
    assert m1["nll"] == pytest.approx(metrics["nll"], rel=1e-5)
    assert w1.keys() == w2.keys() == w0.keys()
    # AdamW's first step is ~lr·sign(g), so float noise on near-zero gradients flips single elements;
    # compare the updates as a whole instead: they must agree to well within 1 % of their norm
    d1 = torch.cat([(w1[k] - w0[k]).flatten() for k in w0])
    d2 = torch.cat([(w2[k] - w0[k]).flatten() for k in w0])
    assert d1.norm() > 0
    print("relative update difference", float((d1 - d2).norm() / d1.norm()))
    assert (d1 - d2).norm() / d1.norm() < 1e-2


def test_a_step_reports_its_padded_shape(tiny_model_dir: Path) -> None:
    """``padded_tokens``: rows x the longest row of each micro-batch, summed (what the forwards ran, pads
    included); ``micro_batches``: how many ran. Both from the step's own plan."""
    from tracegym.trainer.workers.batches import plan_step

    batch = fixed_batch()
    lengths = [len(s.token_ids) for s in batch.samples]
    [plan], n_micro = plan_step(lengths, 1, CFG.optim.micro_batch_tokens)
    one = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=CFG, use_ray=False)
    try:
        m = one.train_step(batch)
    finally:
        one.shutdown()
    assert n_micro > 1  # the budget splits this batch, so the sum is over several micro-batches
    assert m["micro_batches"] == n_micro
    assert m["padded_tokens"] == sum(len(mb) * max(lengths[i] for i in mb) for mb in plan)
    assert m["padded_tokens"] > m["tokens"] == batch.num_tokens


def test_an_unset_budget_is_the_devices_default(tiny_model_dir: Path) -> None:
    """``optim.micro_batch_tokens`` unset: the ranks say what they train on, and a CPU's budget is 1024 tokens
    (a GPU's 4096): six rows of 300 tokens run as two micro-batches of three here, as one on a GPU."""
    from tracegym.trainer.settings import CPU_MICRO_BATCH_TOKENS, MICRO_BATCH_TOKENS

    assert OptimConfig().micro_batch_budget("cuda") == MICRO_BATCH_TOKENS == 4096
    assert OptimConfig().micro_batch_budget("cpu") == CPU_MICRO_BATCH_TOKENS == 1024
    assert OptimConfig(micro_batch_tokens=96).micro_batch_budget("cpu") == 96  # a recipe's value wins
    rng = random.Random(0)
    samples = [TrainSample([rng.randint(3, 2000) for _ in range(300)], [0] * 200 + [1] * 100, [-4.0] * 300, adv)
               for adv in (1.0, -1.0, 0.5, -0.5, 1.0, -1.0)]
    cfg = TrainConfig(optim=OptimConfig(lr=1e-3, dtype="float32"), device="cpu")
    one = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=cfg, use_ray=False)
    try:
        assert one.device_type == "cpu"
        m = one.train_step(TrainBatch(samples))
    finally:
        one.shutdown()
    assert m["micro_batches"] == 2 and m["padded_tokens"] == 1800


@pytest.mark.slow
def test_loss_falls_on_a_fixed_batch(group: tuple[WorkerGroup, Path]) -> None:
    """With every advantage +1 the policy-gradient objective is the sampled tokens' NLL (the PPO loss
    value itself is -mean(A) at ratio 1); it must fall step after step."""
    g, start = group
    g.load_checkpoint(start)
    batch = fixed_batch([1.0] * 6, seed=3)
    nll = [g.train_step(batch)["nll"] for _ in range(5)]
    assert all(b < a for a, b in itertools.pairwise(nll)), nll
    assert nll[-1] < nll[0] - 0.05, nll


@pytest.mark.slow
def test_fewer_samples_than_ranks(group: tuple[WorkerGroup, Path]) -> None:
    """One sample on two ranks: the idle rank runs an empty micro-batch so the collectives still match."""
    g, _ = group
    batch = TrainBatch(fixed_batch().samples[:1])
    metrics = g.train_step(batch)
    assert metrics["loss_tokens"] == batch.num_loss_tokens and metrics["grad_norm"] > 0
    sums = g.state_dict_checksum()
    assert sums[0] == sums[1]


@pytest.mark.slow
def test_checkpoint_resume_continues_identically(group: tuple[WorkerGroup, Path], tmp_path: Path) -> None:
    g, start = group
    g.load_checkpoint(start)
    batch = fixed_batch(seed=5)
    g.train_step(batch)
    ckpt = g.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 17})
    next_metrics = g.train_step(batch)
    next_sum = g.state_dict_checksum()
    g.train_step(batch)
    assert g.step == 3
    extra = g.load_checkpoint(ckpt)
    assert extra == {"data_position": 17, "step": 1} and g.step == 1
    again = g.train_step(batch)
    for k in ("loss", "nll", "grad_norm", "lr", "mismatch", "entropy"):
        assert again[k] == next_metrics[k], k
    assert g.state_dict_checksum() == next_sum


def _generate(url: str, prompt: list[int], *, temperature: float, seed: int | None = None) -> dict:
    params: dict = {"max_new_tokens": 6, "temperature": temperature, "ignore_eos": True}
    if seed is not None:
        params["sampling_seed"] = seed
    r = httpx.post(
        f"{url}/generate",
        json={"input_ids": prompt, "sampling_params": params, "return_logprob": True},
        timeout=60,
    )
    r.raise_for_status()
    return r.json()


@pytest.mark.slow
def test_swap_into_a_real_engine(
    group: tuple[WorkerGroup, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    g, start = group
    g.load_checkpoint(start)
    port = free_port()
    engine = start_process(
        ["tracegym", "engine", "--model", str(tiny_model_dir), "--port", str(port)],
        port=port,
        log_path=tmp_path / "engine.log",
    )
    try:
        prompt = [1, 9690, 314, 253, 1345, 30]
        # sampled by the engine, trained on with its logprobs: the trainer's recomputation must agree
        samples = []
        for i, adv in enumerate([1.0, -1.0, 1.0, -1.0]):
            out = _generate(engine.base_url, prompt, temperature=1.0, seed=i)
            lps = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
            n = len(out["output_ids"])
            samples.append(
                TrainSample(
                    prompt + out["output_ids"], [0] * len(prompt) + [1] * n, [0.0] * len(prompt) + lps, adv
                )
            )
        before = _generate(engine.base_url, prompt, temperature=0.0)
        metrics = g.train_step(TrainBatch(samples))
        print("engine-trainer mismatch (mean |Δlogprob|)", metrics["mismatch"])
        assert metrics["mismatch"] < 1e-4, metrics["mismatch"]

        # the trainer asks the gateway, which runs the swap against the engine
        settings = GatewaySettings(upstream_url=engine.base_url, model=str(tiny_model_dir), store_url=None,
                                   weights_dir=str(tmp_path / "weights"))
        with ServerThread(create_app(settings, recorder=MemoryRecorder())) as gw:
            sync = DiskWeightSync(gw.url, tmp_path / "weights", keep=2)
            result = sync.push(g, "1")
        assert result.path == tmp_path / "weights" / "v1" and result.total_s > 0
        info = httpx.get(f"{engine.base_url}/model_info", timeout=10).json()
        assert info["weight_version"] == "1"
        after = _generate(engine.base_url, prompt, temperature=0.0)
        assert after["meta_info"]["weight_version"] == "1"
        old = [t[0] for t in before["meta_info"]["output_token_logprobs"]]
        new = [t[0] for t in after["meta_info"]["output_token_logprobs"]]
        assert old != new
        sync.close()
    finally:
        engine.stop()


def test_lr_schedule_warmup_and_decay() -> None:
    from tracegym.trainer.algorithms.optim import lr_multiplier

    warm = OptimConfig(lr=1.0, warmup_steps=3)
    assert [lr_multiplier(i, warm) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = OptimConfig(lr=1.0, warmup_steps=1, schedule="cosine", min_lr_ratio=0.1)
    vals = [lr_multiplier(i, cos, 5) for i in range(7)]
    assert (
        vals[0] == 0.5 and vals[1] == 1.0 and vals[5] == pytest.approx(0.1) and vals[6] == pytest.approx(0.1)
    )
    assert all(b <= a for a, b in itertools.pairwise(vals[1:]))
    lin = OptimConfig(lr=1.0, schedule="linear")
    assert [lr_multiplier(i, lin, 4) for i in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match=r"needs more steps than optim\.warmup_steps"):
        lr_multiplier(0, OptimConfig(schedule="cosine"))


def test_failed_setup_shuts_the_group_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A worker whose setup fails is closed before the error surfaces."""
    from tracegym.trainer.workers import worker as workers

    def broken_setup(self: workers.TrainWorker, addr: str, port: int) -> None:
        raise RuntimeError("no model here")

    closed: list[int] = []
    monkeypatch.setattr(workers.TrainWorker, "setup", broken_setup)
    monkeypatch.setattr(workers.TrainWorker, "close", lambda self: closed.append(self.rank))
    with pytest.raises(RuntimeError, match="no model here"):
        WorkerGroup(tmp_path, num_workers=1, train_cfg=CFG, use_ray=False)
    assert closed == [0]


def test_shutdown_is_best_effort(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead actor does not stop the others from being killed, nor a Ray the group started from stopping."""
    import ray

    from tracegym.trainer.workers import group as workers

    events: list[str] = []

    class Method:
        def __init__(self, name: str, dead: bool) -> None:
            self.name, self.dead = name, dead

        def remote(self) -> str:
            if self.dead:
                raise RuntimeError(f"{self.name} is dead")
            return f"ref:{self.name}"

    class Actor:
        def __init__(self, name: str, dead: bool = False) -> None:
            self.name, self.close = name, Method(name, dead)

    def get(ref: str, timeout: float) -> None:
        events.append(f"get {ref}")
        if ref == "ref:a1":
            raise RuntimeError("actor died while closing")

    def kill(actor: Actor) -> None:
        events.append(f"kill {actor.name}")
        if actor.name == "a0":
            raise RuntimeError("already gone")

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(ray, "shutdown", lambda: events.append("ray shutdown"))
    g = workers.WorkerGroup.__new__(workers.WorkerGroup)
    g.use_ray, g._owns_ray, g._placement = True, True, None
    g._workers = [Actor("a0", dead=True), Actor("a1"), Actor("a2")]
    g.shutdown()
    g.shutdown()  # twice is harmless
    assert events == [
        "kill a0", "get ref:a1", "kill a1", "get ref:a2", "kill a2", "ray shutdown",
    ]  # fmt: skip
