"""The recipe's sections, each the settings the code that uses it takes (``recipe.TrainRecipe`` puts them
together). Every default is defined here once; the recipe reference in the docs is generated from these
fields, so their descriptions are the documentation."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tracegym.judge import JudgeSettings

DEFAULT_ADAPTER = "default"
"""The adapter's name when one adapter serves every call (``lora.adapters`` unset)."""


def _judge_default(name: str) -> Any:
    """The SDK judge's default for ``name`` (``tracegym.judge.JudgeSettings``), so both read one value."""
    return JudgeSettings.__dataclass_fields__[name].default


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Section):
    path: Path = Field(
        description="JSONL of tasks: one JSON object per line, passed to the agent as its task input."
    )
    eval_path: Path | None = Field(
        None, description="Held-out JSONL; if unset, `eval_size` tasks are split off `path`."
    )
    eval_size: int = Field(
        64, ge=0, description="Tasks held out of `path` for evaluation when `eval_path` is unset."
    )
    shuffle_seed: int = Field(
        0, description="Seed of the training-order shuffle (and of the held-out split)."
    )


class AgentConfig(_Section):
    target: str = Field(
        description="The agent, as `module:function` (importable from the recipe's directory)."
    )
    concurrency: int = Field(8, ge=1, description="Rollouts run at once by the runner.")
    lease_seconds: float = Field(120.0, gt=0, description="Lease of a claimed rollout; heartbeats renew it.")
    external: bool = Field(
        False,
        description="Runners run elsewhere (e.g. the compose `runner` service); the trainer only enqueues.",
    )


_ONE_UPDATE = " No effect yet: with one update per batch the ratio is always 1 (see `loss`)."


class AlgorithmConfig(_Section):
    advantage: str = Field(
        "grpo", description="Advantage estimator: grpo | dr_grpo | rloo | reinforce_pp_baseline."
    )
    drop_zero_signal_groups: bool = Field(
        True, description="Skip groups whose rewards are all equal (DAPO dynamic sampling)."
    )
    loss: str = Field(
        "ppo_clip",
        description="Policy loss: ppo_clip | gspo | cispo. The trainer makes one update per batch, so the"
        " new/old ratio is always 1 and clip_frac 0: the three give the same gradient (-A ∇log p, told apart"
        " only by `agg`) and the clip settings have no effect; they matter only once a batch gets several"
        " updates.",
    )
    clip_low: float = Field(0.2, ge=0, le=1, description="PPO lower clip (1 - clip_low)." + _ONE_UPDATE)
    clip_high: float = Field(
        0.2, ge=0, description="PPO upper clip (1 + clip_high); 0.28 is DAPO's clip-higher." + _ONE_UPDATE
    )
    agg: str = Field(
        "token-mean", description="Loss aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL penalty to the frozen reference model (0 = no reference model).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    cispo_clip_low: float = Field(
        1.0,
        ge=0,
        le=1,
        description="CISPO: lower bound of the clipped IS weight is 1 - this (1.0 = none)." + _ONE_UPDATE,
    )
    cispo_clip_high: float = Field(
        0.28, ge=0, description="CISPO: upper bound of the clipped IS weight is 1 + this." + _ONE_UPDATE
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling cap against the engine's logprobs (None = off).",
    )

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, v: str) -> str:
        from tracegym.trainer.algorithms.advantages import (
            ADVANTAGE_ESTIMATORS,  # the registry itself (imports torch)
        )
        from tracegym.trainer.algorithms.registry import lookup

        lookup(ADVANTAGE_ESTIMATORS, v, "advantage estimator")
        return v

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        from tracegym.trainer.algorithms.losses import POLICY_LOSSES
        from tracegym.trainer.algorithms.registry import lookup

        lookup(POLICY_LOSSES, v, "policy loss")
        return v

    @field_validator("agg")
    @classmethod
    def _known_agg(cls, v: str) -> str:
        from tracegym.trainer.algorithms.losses import AGGREGATIONS
        from tracegym.trainer.algorithms.registry import lookup

        lookup(AGGREGATIONS, v, "loss aggregation")
        return v


MICRO_BATCH_TOKENS, CPU_MICRO_BATCH_TOKENS = 4096, 1024
"""``OptimConfig.micro_batch_tokens`` where the recipe leaves it unset: on a GPU, and on a CPU."""


class OptimConfig(_Section):
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup steps.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    micro_batch_tokens: int | None = Field(
        None, ge=64, description="Token budget of one forward/backward micro-batch; unset: 4096 on a GPU, 1024 on a CPU "
        "(there a large step's peak memory halves; a batch of 1-4k tokens runs a little slower than in one piece)."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="Training compute dtype (bf16 autocast; master weights fp32; fp32 on a CPU where bf16 is slower)."
    )
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR after warmup: constant, or a linear or cosine decay to `min_lr_ratio` × lr at the last step."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Where the linear and cosine decays end, as a fraction of lr.")

    def micro_batch_budget(self, device_type: str) -> int:
        """``micro_batch_tokens``, or where unset the default for a rank on ``device_type`` (``cpu``, ``cuda``)."""
        if self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return CPU_MICRO_BATCH_TOKENS if device_type == "cpu" else MICRO_BATCH_TOKENS


class UpstreamConfig(_Section):
    url: str | None = Field(None, description="An SGLang server URL; unset = start the embedded engine.")
    urls: list[str] = Field(
        [],
        description="More servers of the same model beside `url`: one fleet (a rollout's calls on one engine, "
        "swaps on all or none).",
    )
    engines: int = Field(1, ge=1, description="Embedded engines to start when `url` is unset (a fleet of N).")
    kind: Literal["sglang", "openai", "litellm"] = "sglang"
    engine_dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="Embedded engine compute dtype (fp32 on a CPU where bf16 is slower), and the dtype of the weight files each swap pushes."
    )
    max_batch_size: int = Field(32, ge=1, description="Embedded engine: requests decoded together.")
    weight_sync: Literal["disk", "distributed"] = Field(
        "disk",
        description="How each step's weights reach the engines: `disk` (a weights directory the engines load:"
        " the run directory must be a path they see) or `distributed` (rank 0 broadcasts them over a"
        " weight-update group the engines join: gloo on CPU, NCCL on CUDA; no shared filesystem; full"
        " fine-tuning only). docs/ray.md.",
    )
    weight_sync_address: str | None = Field(
        None,
        description="distributed: the address the engines reach rank 0 at for the group's rendezvous (a free"
        " port there is picked). Unset = rank 0's node address as Ray knows it, or, without Ray, this"
        " machine's address on the route to the first engine.",
    )
    engine_ranks: int = Field(
        1, ge=1, description="distributed: the ranks each engine joins the group with (SGLang's tensor-parallel size)."
    )


_RAY_ADDRESS = re.compile(r"(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


class RayConfig(_Section):
    """Where the trainer's Ray workers run (docs/ray.md). A `ray` section runs the
    workers as Ray actors, as `use_ray: true` does."""

    address: str | None = Field(
        None,
        description="Join this running cluster: `HOST:PORT` of its head (GCS, port 6379 by default),"
        " `ray://HOST:10001` (Ray Client) or `auto`; the trainer disconnects at the end and never stops it."
        " Unset = start a local Ray (or join `RAY_ADDRESS` if set), stopped at the end.",
    )
    namespace: str | None = Field(None, description="Ray namespace of the trainer's job.")
    runtime_env: dict[str, Any] = Field(
        {}, description="Ray runtime environment of the job (`env_vars`, `pip`, `working_dir`...), passed as is."
    )
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs each trainer worker reserves.")
    gpus_per_worker: float = Field(
        0.0, ge=0, description="GPUs each trainer worker reserves (1 = one GPU per FSDP2 rank, NCCL); 0 = CPU (gloo)."
    )
    placement: Literal["STRICT_SPREAD", "SPREAD", "STRICT_PACK", "PACK"] | None = Field(
        None,
        description="Reserve the ranks together as one Ray placement group with this strategy: `STRICT_SPREAD`"
        " = every rank on a different node, `STRICT_PACK` = all on one node, `SPREAD` / `PACK` = as far as"
        " possible. Unset = Ray places each rank on its own (ranks may share a node).",
    )

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is None or v == "auto":
            return v
        m = _RAY_ADDRESS.fullmatch(v)
        if m is None or not 0 < int(m.group(3)) < 65536:
            raise ValueError(
                f"must be HOST:PORT (a cluster's head, e.g. 10.0.0.5:6379), ray://HOST:PORT or auto, got {v!r}"
            )
        return v

    def joins_cluster(self) -> bool:
        """Whether ``ray.init`` joins a running cluster (an address here or in ``RAY_ADDRESS``)."""
        return self.address is not None or bool(os.environ.get("RAY_ADDRESS"))

    def init_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``ray.init``. Joining a cluster passes only what a driver may set
        there (ray.init refuses resources and dashboard options for an existing cluster)."""
        kw: dict[str, Any] = {"log_to_driver": True}
        if self.address is None:
            kw["include_dashboard"] = False
        else:
            kw["address"] = self.address
        if self.namespace is not None:
            kw["namespace"] = self.namespace
        if self.runtime_env:
            kw["runtime_env"] = self.runtime_env
        return kw


class AdapterConfig(_Section):
    """One LoRA adapter's settings; unset fields take the `lora` section's values."""

    rank: int | None = Field(None, description="LoRA rank r (> 0).")
    alpha: float | None = Field(None, description="LoRA alpha (the update is scaled by alpha / rank).")
    dropout: float | None = Field(None, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] | None = Field(
        None, description="Names of the linear modules to adapt (default: the model family's)."
    )

    @field_validator("rank")
    @classmethod
    def _rank(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"must be > 0, got {v}")
        return v


class LoraConfig(AdapterConfig):
    """LoRA adapters instead of full fine-tuning (docs/lora.md)."""

    rank: int | None = Field(8, description="LoRA rank r (> 0).")
    alpha: float | None = Field(16.0, description="LoRA alpha (the update is scaled by alpha / rank).")
    dropout: float | None = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    adapters: dict[str, AdapterConfig] | None = Field(
        None,
        description="One adapter per agent role: agent name (`X-Agent-Name`, `tg.rollout(agent_name=...)`)"
        " → its adapter's overrides. Unset = one adapter (`default`) for every call.",
    )

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: dict[str, AdapterConfig] | None) -> dict[str, AdapterConfig] | None:
        if v is not None:
            if not v:
                raise ValueError("an empty adapter map: name at least one agent, or drop `adapters`")
            for name in v:
                if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                    raise ValueError(f"agent name {name!r} must match [A-Za-z0-9_.-]{{1,64}} (it names an adapter)")
        return v

    @property
    def per_agent(self) -> bool:
        """Whether the adapters are named after agents (``adapters`` set) rather than one ``default``."""
        return self.adapters is not None

    @property
    def names(self) -> list[str]:
        return [DEFAULT_ADAPTER] if self.adapters is None else list(self.adapters)

    def spec(self, name: str) -> AdapterConfig:
        """Adapter ``name``'s settings, every field set (its overrides, else this section's values)."""
        over = AdapterConfig() if self.adapters is None else self.adapters[name]
        keys = ("rank", "alpha", "dropout", "target_modules")
        return AdapterConfig(**{k: getattr(self, k) if getattr(over, k) is None else getattr(over, k) for k in keys})

    def named_specs(self) -> list[tuple[str, AdapterConfig]]:
        return [(name, self.spec(name)) for name in self.names]

    def adapter_for(self, agent_name: str | None) -> str | None:
        """The adapter that serves (and is trained on) ``agent_name``'s calls; None = no adapter (an agent
        the per-agent map does not name)."""
        if not self.per_agent:
            return DEFAULT_ADAPTER
        return agent_name if agent_name in self.names else None


class JudgeConfig(_Section):

    rubric: str = Field(min_length=1, description="What makes an attempt good, in the user's words.")
    base_url: str | None = Field(
        None,
        description="OpenAI-compatible base URL ending in /v1 (a provider, another served model); unset ="
        " the run's own gateway, whose calls are recorded as LLM spans.",
    )
    model: str | None = Field(None, description="The judge's model name; unset = the recipe's `model`.")
    weight: float = Field(1.0, description="Weight of the judge's score in the trained reward.")
    api_key_env: str | None = Field(
        None,
        description="Environment variable holding the judge's API key (unset: none, or the gateway's key).",
    )
    retries: int = Field(_judge_default("retries"), ge=0, description="Extra attempts when an answer is unusable.")
    temperature: float = Field(_judge_default("temperature"), ge=0)
    max_tokens: int = Field(_judge_default("max_tokens"), ge=1, description="Token limit of one judge answer.")
    max_chars: int = Field(_judge_default("max_chars"), ge=100, description="Each rollout's conversation is cut to its last N characters.")
    timeout_s: float = Field(
        _judge_default("timeout_s"), gt=0, description="Timeout of one judge request (a judge on a CPU engine can take minutes)."
    )
    concurrency: int = Field(4, ge=1, description="Groups judged at once.")


class RewardConfig(_Section):

    agent_weight: float = Field(1.0, description="Weight of the agent's own reward when a judge is set.")
    judge: JudgeConfig | None = Field(
        None, description="Score each completed group with an LLM judge (docs/agents.md)."
    )


def _known_objective(v: str) -> str:
    from tracegym.trainer.algorithms.objectives import check_objective  # the registry itself (imports torch)

    return check_objective(v)


class SourceConfig(_Section):
    """Where an offline objective (``sft``, ``dpo``) takes its examples from: runs in the trace store."""

    runs: list[str] = Field(
        [],
        description="Runs whose completed rollouts are the examples, by name: a `tracegym train` run's `name`"
        " (its training groups are `NAME-<id>-train-<n>`) or a dataset given to `tracegym import --name`."
        " They must be in this run's `store` (set `store` to the store that holds them). Empty = online:"
        " each step samples `batch_size` groups as GRPO does and trains on them.",
    )
    files: list[Path] = Field(
        [],
        description="Dataset files (relative to the recipe) imported into the run's store when the run first"
        " reads its examples, as `tracegym import FILE --name STEM` does (sft: chat JSONL with tool calls;"
        " dpo: preference pairs), and trained on beside `runs`: a file's groups are named after its name"
        " without the extension. A record the gateway refuses stops the run with its line; a resumed run"
        " imports nothing twice.",
    )

    @field_validator("files")
    @classmethod
    def _file_names(cls, v: list[Path]) -> list[Path]:
        for p in v:
            if not re.fullmatch(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*", dataset_name(p)):
                raise ValueError(f"{str(p)!r}: the dataset's name (the file name without its extension) may hold"
                                 " only letters, digits, '_', '.' and single '-' between them")
        return v

    def sources(self) -> list[str]:
        """The runs and imported datasets the examples come from, by name."""
        return [*self.runs, *(dataset_name(p) for p in self.files)]


def dataset_name(path: Path) -> str:
    """The name ``SourceConfig.files`` imports ``path`` under: its file name without the extension."""
    return path.stem


class SftConfig(SourceConfig):
    """Supervised fine-tuning (`objective: sft`): cross-entropy on the sampled (mask-1) tokens of
    demonstrations and of the agent's own rollouts whose reward passes `min_reward` (rejection sampling)."""

    min_reward: float | None = Field(
        None,
        description="Keep only rollouts with a reward >= this (unset = every rollout with a reward, and"
        " imported demonstrations without one). A filter that keeps nothing stops the run, saying how many"
        " rollouts it looked at.",
    )


class DpoConfig(SourceConfig):
    """DPO (`objective: dpo`): pairs of the highest- and lowest-reward rollout of one group (same prompt
    tokens), or imported pairs; the reference is the frozen start model (with LoRA: the base model)."""

    beta: float = Field(0.1, gt=0, description="DPO β: strength of the implicit KL to the reference.")
    min_margin: float = Field(
        0.0, ge=0, description="Pair two rollouts only when their rewards differ by more than this."
    )


class DistillConfig(_Section):
    """On-policy distillation (`objective: distill`): the student samples, the teacher scores the same
    tokens; per-token advantage = teacher logprob − student logprob."""

    teacher: str = Field(
        description="The teacher: a model name (`smollm2-135m`, ...), a local model directory, or a finished"
        " run's directory (the newest weights it kept, `keep: weights`); a relative directory is looked for"
        " beside the recipe, then in the current directory. It must share the student's tokenizer"
        " (token-level distillation needs one vocabulary)."
    )
    reward_weight: float = Field(
        0.0, ge=0, description="Add this × the rollout's GRPO advantage to every token's advantage (0 = pure distillation)."
    )


class PhaseConfig(_Section):
    """One phase of a chained recipe (`phases`)."""

    objective: str = Field(description="grpo | sft | dpo | distill.")
    steps: int = Field(ge=1, description="Training steps of this phase.")

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: str) -> str:
        return _known_objective(v)


class MlflowConfig(_Section):
    """Also log the run to MLflow (needs `mlflow-skinny` or `mlflow`: `pip install 'tracegym[tracking]'`)."""

    tracking_uri: str = Field(
        "sqlite:///{run_dir}/mlflow.db",
        description="MLflow tracking URI; `{run_dir}` is substituted. The default is a local store file in the"
        " run directory (`mlflow ui --backend-store-uri` it); an `http(s)://` URI logs to a tracking server.",
    )
    experiment: str = Field("tracegym", description="The MLflow experiment the run is filed under.")
