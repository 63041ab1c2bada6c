"""Every recipe key has one home: its field in ``trainer/settings.py`` (or ``recipe.py`` for the top level),
with its one default. The table below is that list; a changed or new default is changed here on purpose.
The code takes the recipe's sections themselves, so no dataclass of the trainer repeats their fields."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from typing import Any

from pydantic import BaseModel

import tracegym.trainer
from tracegym.judge import JudgeSettings
from tracegym.trainer import settings
from tracegym.trainer.recipe import TrainRecipe
from tracegym.trainer.settings import JudgeConfig

REQUIRED = object()

RECIPE_DEFAULTS: dict[str, Any] = {
    'model': REQUIRED,
    'data.path': REQUIRED,
    'data.eval_path': None,
    'data.eval_size': 64,
    'data.shuffle_seed': 0,
    'agent.target': REQUIRED,
    'agent.concurrency': 8,
    'agent.lease_seconds': 120.0,
    'agent.external': False,
    'group_size': 4,
    'batch_size': 8,
    'steps': 60,
    'mode': 'sync',
    'max_staleness': 1,
    'group_timeout_s': 300.0,
    'algorithm.advantage': 'grpo',
    'algorithm.drop_zero_signal_groups': True,
    'algorithm.loss': 'ppo_clip',
    'algorithm.clip_low': 0.2,
    'algorithm.clip_high': 0.2,
    'algorithm.agg': 'token-mean',
    'algorithm.kl_coef': 0.0,
    'algorithm.kl_estimator': 'k3',
    'algorithm.cispo_clip_low': 1.0,
    'algorithm.cispo_clip_high': 0.28,
    'algorithm.tis_cap': None,
    'reward.agent_weight': 1.0,
    'reward.judge': None,
    'reward.judge.rubric': REQUIRED,
    'reward.judge.base_url': None,
    'reward.judge.model': None,
    'reward.judge.weight': 1.0,
    'reward.judge.api_key_env': None,
    'reward.judge.retries': 2,
    'reward.judge.temperature': 0.0,
    'reward.judge.max_tokens': 512,
    'reward.judge.max_chars': 4000,
    'reward.judge.timeout_s': 300.0,
    'reward.judge.concurrency': 4,
    'optim.lr': 1e-05,
    'optim.weight_decay': 0.0,
    'optim.betas': (0.9, 0.999),
    'optim.warmup_steps': 0,
    'optim.grad_clip': 1.0,
    'optim.micro_batch_tokens': None,
    'optim.dtype': 'bfloat16',
    'optim.eps': 1e-08,
    'optim.schedule': 'constant',
    'optim.min_lr_ratio': 0.0,
    'upstream.url': None,
    'upstream.urls': [],
    'upstream.engines': 1,
    'upstream.kind': 'sglang',
    'upstream.engine_dtype': 'bfloat16',
    'upstream.max_batch_size': 32,
    'upstream.weight_sync': 'disk',
    'upstream.weight_sync_address': None,
    'upstream.engine_ranks': 1,
    'lora': None,
    'lora.rank': 8,
    'lora.alpha': 16.0,
    'lora.dropout': 0.0,
    'lora.target_modules': None,
    'lora.adapters': None,
    'gateway_url': None,
    'store': 'sqlite:///{run_dir}/tracegym.db',
    'workers': 1,
    'use_ray': False,
    'ray': None,
    'ray.address': None,
    'ray.namespace': None,
    'ray.runtime_env': {},
    'ray.cpus_per_worker': 1.0,
    'ray.gpus_per_worker': 0.0,
    'ray.placement': None,
    'eval_samples': 2,
    'eval_interval': 20,
    'run_dir': None,
    'name': 'run',
    'checkpoint_interval': 0,
    'keep': 'weights',
    'seed': 0,
    'tensorboard': False,
    'wandb_project': None,
    'objective': 'grpo',
    'phases': None,
    'sft.runs': [],
    'sft.files': [],
    'sft.min_reward': None,
    'dpo.runs': [],
    'dpo.files': [],
    'dpo.beta': 0.1,
    'dpo.min_margin': 0.0,
    'distill': None,
    'distill.teacher': REQUIRED,
    'distill.reward_weight': 0.0,
    'mlflow': None,
    'mlflow.tracking_uri': 'sqlite:///{run_dir}/mlflow.db',
    'mlflow.experiment': 'tracegym',
}
"""Every recipe key → its default (``REQUIRED``: no default; an optional section's own row: None = absent)."""


def _walk(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        inner = [a for a in typing.get_args(f.annotation) if a is not type(None)] or [f.annotation]
        sections = [a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)]
        if sections:
            if not f.is_required() and f.default is None:
                out[prefix + name] = None
            out |= _walk(sections[0], f"{prefix}{name}.")
            continue
        if f.is_required():
            out[prefix + name] = REQUIRED
        else:
            out[prefix + name] = f.default if f.default_factory is None else f.default_factory()
    return out


def test_every_recipe_key_with_its_one_default() -> None:
    assert _walk(TrainRecipe) == RECIPE_DEFAULTS


SECTIONS = {name for name, obj in vars(settings).items()
            if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == settings.__name__}
NOT_RECIPE_KEYS = {
    ("TrainConfig", "seed"): "its default is read from TrainRecipe",
    ("DistributedWeightSync", "timeout_s"): "the weight push's HTTP timeout, not the judge's",
}


def test_no_trainer_dataclass_repeats_a_recipe_field() -> None:
    """A dataclass field named like a recipe key, with a default of its own, would be a second home (a
    field that holds a recipe section is that section, not a copy)."""
    leaves = {key.rsplit(".", 1)[-1] for key in RECIPE_DEFAULTS}
    twins = []
    for info in pkgutil.walk_packages(tracegym.trainer.__path__, "tracegym.trainer."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if not (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == info.name):
                continue
            for f in dataclasses.fields(obj):
                has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                holds_section = any(section in str(f.type) for section in SECTIONS)
                if f.name in leaves and has_default and not holds_section and (obj.__name__, f.name) not in NOT_RECIPE_KEYS:
                    twins.append(f"{obj.__name__}.{f.name}")
    assert twins == []


def test_the_judge_section_takes_the_sdk_judges_defaults() -> None:
    sdk = {f.name: f.default for f in dataclasses.fields(JudgeSettings)}
    for name, field in JudgeConfig.model_fields.items():
        if name in sdk and sdk[name] is not dataclasses.MISSING:
            assert field.default == sdk[name], name
