"""The training recipe: one pydantic model, loaded from YAML and validated with clear messages.

The README's recipe reference is generated from these fields (``python -m tracegym.trainer.config``),
so the docstrings here are the documentation.
"""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tracegym.trainer.judge_rewards import RewardConfig

TIMESTAMP = "{timestamp}"
"""As the last part of ``run_dir``: a new directory per run, named by its start time (``run_dirs``)."""


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
        from tracegym.trainer.advantages import ADVANTAGE_ESTIMATORS  # the registry itself (imports torch)
        from tracegym.trainer.registry import lookup

        lookup(ADVANTAGE_ESTIMATORS, v, "advantage estimator")
        return v

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        from tracegym.trainer.losses import POLICY_LOSSES
        from tracegym.trainer.registry import lookup

        lookup(POLICY_LOSSES, v, "policy loss")
        return v

    @field_validator("agg")
    @classmethod
    def _known_agg(cls, v: str) -> str:
        from tracegym.trainer.losses import AGGREGATIONS
        from tracegym.trainer.registry import lookup

        lookup(AGGREGATIONS, v, "loss aggregation")
        return v


class OptimConfig(_Section):
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup steps.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    micro_batch_tokens: int = Field(
        4096, ge=64, description="Token budget of one forward/backward micro-batch."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="Training compute dtype (bf16 autocast; master weights fp32; fp32 on a CPU where bf16 is slower)."
    )


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


_RAY_ADDRESS = re.compile(r"(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


class RayConfig(_Section):
    """Where the trainer's Ray workers run (README: Training on a Ray cluster). A `ray` section runs the
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
    """LoRA adapters instead of full fine-tuning (see README, "LoRA")."""

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
        import re

        if v is not None:
            if not v:
                raise ValueError("an empty adapter map: name at least one agent, or drop `adapters`")
            for name in v:
                if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                    raise ValueError(f"agent name {name!r} must match [A-Za-z0-9_.-]{{1,64}} (it names an adapter)")
        return v


class TrainRecipe(_Section):
    """A `tracegym train` recipe. Relative paths are relative to the recipe file."""

    model: str = Field(
        description="Model name (`smollm2-135m`, `tiny-random`, `qwen3-tiny`), a local directory, or a hub id."
    )
    data: DataConfig
    agent: AgentConfig
    group_size: int = Field(4, description="Rollouts per task (the GRPO group); at least 2.")
    batch_size: int = Field(8, ge=1, description="Tasks per step (so batch_size × group_size rollouts).")
    steps: int = Field(60, ge=1, description="Training steps.")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate then train; async: runners never stop."
    )
    max_staleness: int = Field(
        1, ge=0, description="async: accept trajectories at most this many weight versions old."
    )
    group_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Wait at most this long for a step's groups; late rollouts are dropped and counted.",
    )
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward: RewardConfig = RewardConfig()
    optim: OptimConfig = OptimConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters (peft) instead of the full model; unset = full fine-tuning."
    )
    gateway_url: str | None = Field(
        None,
        description="Use this running gateway; unset = start one (and the embedded engine unless `upstream.url` is set).",
    )
    store: str = Field(
        "sqlite:///{run_dir}/tracegym.db", description="Trace store URL; `{run_dir}` is substituted."
    )
    workers: int = Field(1, ge=1, description="Trainer workers (Ray actors, one FSDP2 shard each).")
    use_ray: bool = Field(False, description="Run workers as Ray actors even with workers=1.")
    ray: RayConfig | None = Field(
        None, description="Run the workers on Ray: a local Ray, or join a cluster (`ray.address`)."
    )
    eval_samples: int = Field(2, ge=1, description="Sampled rollouts per held-out task at each evaluation.")
    eval_interval: int = Field(
        20, ge=0, description="Evaluate on the held-out split every N steps (0 = only before and after)."
    )
    run_dir: Path | None = Field(
        None,
        description="Where checkpoints, weights, metrics and plots go; `{name}` is substituted, and a last"
        " part `{timestamp}` makes a new directory per run with a `latest` link next to it. Unset ="
        " `runs/{name}/{timestamp}` under the current directory. Any other directory is refused once it"
        " holds a run, unless `--resume` or `--overwrite` is given.",
    )
    name: str = Field("run", description="Run name.")
    checkpoint_interval: int = Field(
        0, ge=0, description="Save a resumable checkpoint every N steps (0 = only at the end)."
    )
    seed: int = 0
    tensorboard: bool = Field(
        False, description="Also write TensorBoard scalars to run_dir/tb (needs `tensorboard`)."
    )
    wandb_project: str | None = Field(None, description="Also log to this W&B project (needs `wandb`).")

    @field_validator("agent")
    @classmethod
    def _target_shape(cls, v: AgentConfig) -> AgentConfig:
        if ":" not in v.target:
            raise ValueError(f"agent.target must be 'module:function', got {v.target!r}")
        return v

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v: int) -> int:
        # a field validator (not a model one) so this shows next to the recipe's other errors
        if v < 2:
            raise ValueError(f"must be >= 2: every advantage estimator compares rollouts of the same task, got {v}")
        return v

    @field_validator("run_dir")
    @classmethod
    def _timestamp_last(cls, v: Path | None) -> Path | None:
        if v is not None and TIMESTAMP in str(v.parent):
            raise ValueError(f"{TIMESTAMP} may only be the last part of run_dir, got {str(v)!r}")
        return v

    def resolve_paths(self, base: Path) -> TrainRecipe:
        """Make the recipe's relative paths (data, a local model directory, run_dir, a SQLite store)
        absolute against ``base``, the recipe's directory; an unset run_dir is ``runs/{name}/{timestamp}``
        under the current directory. ``{name}`` is substituted; ``{run_dir}`` in ``store`` too, unless
        run_dir ends in ``{timestamp}`` (then ``run_dirs.open_run_dir`` picks the directory)."""
        default = Path.cwd() / "runs" / "{name}" / TIMESTAMP
        run_dir = Path(str(self.run_dir or default).replace("{name}", self.name))
        run_dir = _absolute(run_dir, base)
        data = self.data.model_copy(
            update={
                "path": _absolute(self.data.path, base),
                "eval_path": None if self.data.eval_path is None else _absolute(self.data.eval_path, base),
            }
        )
        store = _sqlite_absolute(self.store, base)
        if run_dir.name != TIMESTAMP:
            store = store.replace("{run_dir}", str(run_dir))
        return self.model_copy(
            update={"run_dir": run_dir, "data": data, "store": store, "model": _model_path(self.model, base)}
        )


def _absolute(p: Path, base: Path) -> Path:
    p = p.expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def _sqlite_absolute(url: str, base: Path) -> str:
    """``sqlite:///rel.db`` → ``sqlite:////BASE/rel.db``; other URLs (and ``{run_dir}/...``) unchanged."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return url
    rest = url[len(prefix) :]
    if not rest or rest.startswith(("/", "{run_dir}", ":memory:", "file:")):
        return url
    return prefix + str(_absolute(Path(rest), base))


def _model_path(model: str, base: Path) -> str:
    """A local model directory relative to the recipe becomes absolute; names and hub ids stay. A model
    written as a path (``./m``, ``../m``, ``~/m``, ``/m``) is a path even where it does not exist (so the
    error names where it was looked for)."""
    from tracegym.models import KNOWN_MODELS

    if model in KNOWN_MODELS:
        return model
    p = Path(model).expanduser()
    looks_like_path = p.is_absolute() or model.startswith(("./", "../", "~"))
    if looks_like_path or (base / p).exists():
        return str(_absolute(p, base))
    return model


class RecipeError(ValueError):
    """A recipe that cannot be loaded; the message says which field and why."""


def unknown_field_message(loc: tuple[int | str, ...]) -> str:
    """``unknown field; did you mean 'lr'?`` for a misspelt recipe key (else the section's fields)."""
    import difflib

    model: type[BaseModel] = TrainRecipe
    for part in loc[:-1]:
        ann = model.model_fields[str(part)].annotation if str(part) in model.model_fields else None
        # an optional section (``judge: JudgeConfig | None``) is its model
        found = [a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not found:
            return "unknown field"
        model = found[0]
    names = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    if close:
        return f"unknown field; did you mean {close[0]!r}?"
    return "unknown field; the fields here are " + ", ".join(names)


def load_recipe(path: str | Path) -> TrainRecipe:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{p}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise RecipeError(f"{p}: a recipe is a mapping of fields, got {type(raw).__name__}")
    try:
        recipe = TrainRecipe.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = unknown_field_message(err["loc"]) if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"{loc}: {msg}")
        if len(lines) == 1:  # the usual typo: one line
            raise RecipeError(f"{p}: invalid recipe: {lines[0]}") from None
        raise RecipeError("\n  ".join([f"{p}: invalid recipe:", *lines])) from None
    return recipe.resolve_paths(p.parent.resolve())


def reference_markdown() -> str:
    """The recipe reference, generated from the fields above (README embeds this)."""
    out = ["| field | type | default | description |", "|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            ann = f.annotation
            inner = [a for a in getattr(ann, "__args__", ()) if a is not type(None)]
            if len(inner) == 1 and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
                out.append(f"| `{prefix}{name}` | optional | `None` | {f.description or ''} |")
                walk(inner[0], f"{prefix}{name}.")  # an optional section: its fields, once it is given
                continue
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = "required" if f.is_required() else repr(f.default)
            tname = getattr(ann, "__name__", str(ann)).replace("typing.", "").replace("|", "\\|")
            tname = tname.replace(f"{__name__}.", "").replace("__main__.", "")
            desc = (f.description or "").replace("|", "\\|")
            out.append(f"| `{prefix}{name}` | {tname} | `{default}` | {desc} |")

    walk(TrainRecipe, "")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(reference_markdown() + "\n")
