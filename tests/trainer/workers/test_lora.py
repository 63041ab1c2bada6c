"""LoRA training on ``tiny-random``: adapters only (base frozen, optimizer over adapter parameters), the
KL reference as the adapter-disabled model, per-agent adapters, adapter files, checkpoint and resume,
and the bad-input rules."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.trainer.workers.test_worker import fixed_batch
from tracegym.modelfiles.formats import BASE_KEY, base_fingerprint
from tracegym.trainer.recipe import RecipeError, TrainRecipe
from tracegym.trainer.run.build_batch import build_train_batch
from tracegym.trainer.settings import AdapterConfig, AlgorithmConfig, LoraConfig, OptimConfig
from tracegym.trainer.workers.batches import TrainBatch, TrainSample
from tracegym.trainer.workers.group import WorkerGroup
from tracegym.trainer.workers.lora import (
    LoraError,
    check_model,
    peft_key,
)
from tracegym.trainer.workers.train_config import TrainConfig
from tracegym.types import Sequence, Trajectory

ONE = LoraConfig(rank=4, alpha=8.0)
TWO = LoraConfig(rank=4, alpha=8.0, adapters={
    "planner": AdapterConfig(target_modules=["q_proj", "v_proj"]), "executor": AdapterConfig(rank=2, alpha=4.0)})


def cfg(lora: LoraConfig, kl: float = 0.0) -> TrainConfig:
    return TrainConfig(optim=OptimConfig(lr=1e-2, micro_batch_tokens=96, dtype="float32"), lora=lora,
                       algorithm=AlgorithmConfig(kl_coef=kl))


def params(g: WorkerGroup) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in g._workers[0].model.named_parameters()}


def changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], part: str) -> set[str]:
    return {n for n in a if part in n and not torch.equal(a[n], b[n])}


def test_recipe_rejects_bad_lora_settings(tmp_path: Path) -> None:
    base = {"model": "tiny-random", "data": {"path": "t.jsonl"}, "agent": {"target": "a:f"}}
    with pytest.raises(ValueError, match="must be > 0"):
        TrainRecipe.model_validate({**base, "lora": {"rank": 0}})
    with pytest.raises(ValueError, match="must be > 0"):
        TrainRecipe.model_validate({**base, "lora": {"adapters": {"planner": {"rank": -2}}}})
    with pytest.raises(ValueError, match="empty adapter map"):
        TrainRecipe.model_validate({**base, "lora": {"adapters": {}}})
    r = TrainRecipe.model_validate({**base, "lora": {"adapters": {"planner": {}, "executor": {"rank": 2}}}})
    s = r.lora
    assert s is not None and s.per_agent and s.names == ["planner", "executor"]
    assert s.spec("executor").rank == 2 and s.spec("planner").rank == 8 and s.spec("planner").alpha == 16.0
    assert s.adapter_for("planner") == "planner" and s.adapter_for("critic") is None
    assert TrainRecipe.model_validate({**base, "lora": {}}).lora.adapter_for(None) == "default"


def test_unknown_target_module_fails_before_training(tiny_model_dir: Path) -> None:
    bad = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "qkv_proj"])
    with pytest.raises(LoraError, match=r"\['qkv_proj'\] not found") as e:
        check_model(bad, tiny_model_dir)
    assert "\n" not in str(e.value)
    check_model(ONE, tiny_model_dir)  # the family defaults exist


def test_one_worker_trains_only_the_adapter_with_the_disabled_adapter_as_reference(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    g = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=cfg(ONE, kl=0.5), use_ray=False)
    try:
        w = g._workers[0]
        assert w.ref_model is None  # no second copy of the weights
        opt_params = {id(p) for grp in w.optimizer.param_groups for p in grp["params"]}
        lora_params = {id(p) for n, p in w.model.named_parameters() if "lora_" in n}
        assert opt_params == lora_params and lora_params
        before = params(g)
        m1 = g.train_step(fixed_batch())
        assert m1["kl"] == pytest.approx(0.0, abs=1e-6)  # lora_B starts at 0: policy == reference
        after = params(g)
        assert not changed(before, after, "base_layer") and not changed(before, after, "embed")
        assert changed(before, after, "lora_B")
        m2 = g.train_step(fixed_batch())
        assert m2["kl"] > 0  # the adapter moved away from the base

        paths = g.save_adapters(tmp_path / "v2")
        d = paths["default"]
        conf = json.loads((d / "adapter_config.json").read_text())
        assert conf["r"] == 4 and conf["lora_alpha"] == 8.0 and "q_proj" in conf["target_modules"]
        with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
            keys = set(f.keys())
            assert f.metadata()[BASE_KEY] == base_fingerprint(w.model.get_base_model().config)
        names = {n for n in after if "lora_" in n}
        assert keys == {peft_key(n, "default") for n in names}
        assert all(".default." not in k for k in keys)
    finally:
        g.shutdown()


def test_checkpoint_holds_adapter_and_optimizer_and_resume_continues_identically(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    a = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=cfg(ONE), use_ray=False)
    try:
        a.train_step(fixed_batch())
        a.save_checkpoint(tmp_path / "ckpt")
        a.train_step(fixed_batch(seed=1))
        want = params(a)
    finally:
        a.shutdown()
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    # the adapters only: not the frozen output layer tied to the embeddings (113 MB of SmolLM2's)
    assert model_keys and all(".lora_" in k for k in model_keys), [k for k in model_keys if ".lora_" not in k]
    b = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=cfg(ONE), use_ray=False)
    try:
        assert b.load_checkpoint(tmp_path / "ckpt")["step"] == 1
        assert b._workers[0].optimizer.state  # Adam's moments came back
        b.train_step(fixed_batch(seed=1))
        got = params(b)
        assert all(torch.equal(got[n], want[n]) for n in want)
    finally:
        b.shutdown()
    state_file = tmp_path / "ckpt" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "lora_base": "0123456789abcdef"}))
    c = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=cfg(ONE), use_ray=False)
    try:
        with pytest.raises(LoraError, match="trained on another base model") as e:
            c.load_checkpoint(tmp_path / "ckpt")
        assert "\n" not in str(e.value)
    finally:
        c.shutdown()


def test_per_agent_adapters_train_on_their_own_samples(tiny_model_dir: Path) -> None:
    g = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=cfg(TWO), use_ray=False)
    try:
        planner_only = TrainBatch([TrainSample(s.token_ids, s.loss_mask, s.engine_logprobs, s.advantage, "planner")
                                   for s in fixed_batch().samples])
        before = params(g)
        m = g.train_step(planner_only)
        mid = params(g)
        assert changed(before, mid, ".planner.") and not changed(before, mid, ".executor.")
        assert "loss/planner" in m and "loss/executor" not in m and g.step == 1
        mixed = TrainBatch([TrainSample(s.token_ids, s.loss_mask, s.engine_logprobs, s.advantage,
                                        "executor" if i % 2 else "planner")
                            for i, s in enumerate(fixed_batch(seed=3).samples)])
        m = g.train_step(mixed)
        after = params(g)
        assert changed(mid, after, ".planner.") and changed(mid, after, ".executor.")
        assert m["loss_tokens/planner"] + m["loss_tokens/executor"] == mixed.num_loss_tokens
        assert g.step == 2  # one training step, however many adapters it moved
        # executor targets every projection, planner only q and v
        assert any(".executor." in n and "down_proj" in n for n in after)
        assert not any(".planner." in n and "down_proj" in n for n in after)
    finally:
        g.shutdown()


def _traj(rid: str, reward: float, agents: list[str]) -> Trajectory:
    seqs = [Sequence([1, 2, 3, 4], [0, 0, 1, 1], [None, None, -1.0, -1.0], agent_name=a) for a in agents]
    return Trajectory(rollout_id=rid, task_id="t", reward=reward, sequences=seqs)


def test_batch_routes_sequences_to_their_agents_adapters(caplog: pytest.LogCaptureFixture) -> None:
    groups = [("g", [_traj("a", 1.0, ["planner", "executor", "critic"]), _traj("b", 0.0, ["planner", "critic"])])]
    with caplog.at_level(logging.WARNING):
        batch, stats = build_train_batch(groups, advantage="grpo", drop_zero_signal=True, lora=TWO)
    assert batch is not None
    assert [s.adapter for s in batch.samples] == ["planner", "executor", "planner"]
    assert stats["unrouted_sequences"] == 2
    warned = [r.getMessage() for r in caplog.records if "LoRA" in r.getMessage()]
    assert len(warned) == 1 and "critic" in warned[0] and "agents seen" in warned[0]
    caplog.clear()
    only_planner = [("g", [_traj("a", 1.0, ["planner"]), _traj("b", 0.0, ["planner"])])]
    with caplog.at_level(logging.WARNING):
        build_train_batch(only_planner, advantage="grpo", drop_zero_signal=True, lora=TWO)
    warned = [r.getMessage() for r in caplog.records if "LoRA" in r.getMessage()]
    assert len(warned) == 1 and "['executor'] that sent no trainable sequence" in warned[0]


def test_a_recipe_error_names_a_missing_module(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tracegym.trainer.run.loop import train

    (tmp_path / "t.jsonl").write_text('{"q": 1}\n' * 10)
    recipe = TrainRecipe.model_validate({
        "model": str(tiny_model_dir), "data": {"path": str(tmp_path / "t.jsonl")}, "agent": {"target": "a:f"},
        "lora": {"target_modules": ["nope_proj"]}, "run_dir": str(tmp_path / "run")})
    with pytest.raises(RecipeError, match="nope_proj"):
        train(recipe, recipe_dir=tmp_path)


@pytest.mark.slow
def test_two_ray_workers_fsdp2_match_one_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    import ray

    one = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=cfg(ONE, kl=0.1), use_ray=False)
    try:
        one.train_step(fixed_batch())
        want = one.save_adapters(tmp_path / "one")["default"]
    finally:
        one.shutdown()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        two = WorkerGroup(tiny_model_dir, num_workers=2, train_cfg=cfg(ONE, kl=0.1), use_ray=True)
        try:
            m = two.train_step(fixed_batch())
            assert m["loss_tokens"] == fixed_batch().num_loss_tokens
            got = two.save_adapters(tmp_path / "two")["default"]
            two.save_checkpoint(tmp_path / "ckpt2")
            assert two.load_checkpoint(tmp_path / "ckpt2")["step"] == 1
        finally:
            two.shutdown()
        # per-agent adapters over two FSDP2 ranks: each adapter's step runs on every rank (a rank without
        # samples of it runs a dummy micro-batch), so the shards' collectives stay matched
        per_agent = WorkerGroup(tiny_model_dir, num_workers=2, train_cfg=cfg(TWO), use_ray=True)
        try:
            samples = fixed_batch(seed=4).samples
            mixed = TrainBatch([TrainSample(x.token_ids, x.loss_mask, x.engine_logprobs, x.advantage,
                                            "executor" if i == 0 else "planner") for i, x in enumerate(samples)])
            m = per_agent.train_step(mixed)
            assert m["loss_tokens/planner"] + m["loss_tokens/executor"] == mixed.num_loss_tokens
            saved = per_agent.save_adapters(tmp_path / "per-agent")
            for name in ("planner", "executor"):
                t = load_file(str(saved[name] / "adapter_model.safetensors"))
                assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in t.items()), name
        finally:
            per_agent.shutdown()
    finally:
        ray.shutdown()
    a, b = load_file(str(want / "adapter_model.safetensors")), load_file(str(got / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a), max(float((a[k] - b[k]).abs().max()) for k in a)
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a)

