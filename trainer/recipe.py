"""The training recipe: one pydantic model, loaded from YAML and validated with clear messages.

The recipe reference (docs/recipe.md) is generated from these fields (``scripts/gen_readme_reference.py``),
so the docstrings here are the documentation.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from tracegym.trainer.settings import (
    AgentConfig,
    AlgorithmConfig,
    DataConfig,
    DistillConfig,
    DpoConfig,
    LoraConfig,
    MlflowConfig,
    OptimConfig,
    PhaseConfig,
    RayConfig,
    RewardConfig,
    SftConfig,
    UpstreamConfig,
    _Section,
)

TIMESTAMP = "{timestamp}"
"""As the last part of ``run_dir``: a new directory per run, named by its start time (``run_dirs``)."""


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
    objective: str = Field(
        "grpo", description="What the run trains: grpo (the `algorithm` section) | sft | dpo | distill."
    )
    phases: list[PhaseConfig] | None = Field(
        None,
        description="Chain objectives, e.g. `[{objective: sft, steps: 20}, {objective: grpo, steps: 40}]`:"
        " one model, optimizer and LR schedule through all of them; `steps` is their sum. Unset = `objective`"
        " for `steps` steps.",
    )
    sft: SftConfig = SftConfig()
    dpo: DpoConfig = DpoConfig()
    distill: DistillConfig | None = Field(None, description="The teacher of `objective: distill`.")
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
        0, ge=0, description="Save a resumable checkpoint every N steps (0 = none before the end)."
    )
    keep: Literal["none", "weights", "checkpoint"] = Field(
        "weights",
        description="What the run directory keeps of the model once the run has ended: `weights` (the last"
        " weight version, in `upstream.engine_dtype`), `checkpoint` (also a resumable checkpoint: fp32 model,"
        " AdamW moments, RNG and loop state, so `--resume --steps N` can extend the finished run) or `none`"
        " (metrics, store, logs and the tokenizer only). Checkpoints written before the end"
        " (`checkpoint_interval`) are complete whatever this says, so a run stopped early resumes exactly;"
        " unless `checkpoint`, the last one is deleted when the run ends.",
    )
    seed: int = 0
    tensorboard: bool = Field(
        False, description="Also write TensorBoard scalars to run_dir/tb (needs `tensorboard`)."
    )
    wandb_project: str | None = Field(None, description="Also log to this W&B project (needs `wandb`).")
    mlflow: MlflowConfig | None = Field(
        None, description="Also log to MLflow (`mlflow: {}` = a store file in the run directory)."
    )

    @field_validator("agent")
    @classmethod
    def _target_shape(cls, v: AgentConfig) -> AgentConfig:
        if ":" not in v.target:
            raise ValueError(f"agent.target must be 'module:function', got {v.target!r}")
        return v

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: str) -> str:
        from tracegym.trainer.settings import _known_objective

        return _known_objective(v)

    @model_validator(mode="after")
    def _phases(self) -> TrainRecipe:
        if self.phases is not None:
            if not self.phases:
                raise ValueError("phases: an empty list; name at least one phase, or drop `phases`")
            total = sum(p.steps for p in self.phases)
            if "steps" in self.model_fields_set and self.steps != total:
                raise ValueError(f"steps ({self.steps}) differs from the sum of the phases' steps ({total});"
                                 " drop `steps` with `phases`")
            self.steps = total
        used = self.objectives()
        if "distill" in used and self.distill is None:
            raise ValueError("objective distill needs a `distill` section naming the teacher")
        if used - {"grpo"} and self.mode != "sync":
            raise ValueError(f"objective(s) {sorted(used - {'grpo'})} train in mode sync only")
        if "dpo" in used and self.lora is not None and self.lora.per_agent:
            raise ValueError("objective dpo trains one adapter (or the model): drop lora.adapters")
        return self

    @model_validator(mode="after")
    def _weight_sync(self) -> TrainRecipe:
        if self.upstream.weight_sync != "distributed":
            return self
        if self.lora is not None:
            raise ValueError("upstream.weight_sync: distributed broadcasts the full model, and a `lora` run"
                             " pushes only its adapters (from disk): drop one of them")
        if self.upstream.kind != "sglang":
            raise ValueError(f"upstream.weight_sync: distributed needs an SGLang-protocol upstream (SGLang or"
                             f" the embedded engine), and upstream.kind is {self.upstream.kind!r}")
        return self

    def objectives(self) -> set[str]:
        """Every objective the run trains."""
        return {p.objective for p in self.phases} if self.phases else {self.objective}

    def objective_at(self, step: int) -> str:
        """The objective of training step ``step`` (0-based)."""
        return self.phases[self.phase_index(step)].objective if self.phases else self.objective

    def phase_ends(self) -> list[int]:
        """The steps after which a phase other than the last ends (the held-out split is evaluated there)."""
        ends = [sum(p.steps for p in (self.phases or [])[: i + 1]) for i in range(len(self.phases or []))]
        return ends[:-1]

    def phase_index(self, step: int) -> int:
        """The index in ``phases`` of the phase that holds training step ``step`` (0-based; 0 without
        phases, the last phase past the end)."""
        end = 0
        for i, p in enumerate(self.phases or []):
            end += p.steps
            if step < end:
                return i
        return max(len(self.phases or []) - 1, 0)

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
        """Make the recipe's relative paths (data, a local model or teacher directory, run_dir, a SQLite
        store, the offline objectives' dataset files)
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
        sources = {k: getattr(self, k).model_copy(update={"files": [_absolute(f, base) for f in getattr(self, k).files]})
                   for k in ("sft", "dpo")}
        if self.distill is not None:  # a teacher directory is found as the model's is
            sources["distill"] = self.distill.model_copy(update={"teacher": _model_path(self.distill.teacher, base)})
        return self.model_copy(
            update={"run_dir": run_dir, "data": data, "store": store, "model": _model_path(self.model, base),
                    **sources}
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


def validate_recipe(raw: dict[str, Any], *, where: str = "recipe") -> TrainRecipe:
    """``raw`` as a ``TrainRecipe``, or a ``RecipeError`` naming each bad field and why."""
    try:
        return TrainRecipe.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = unknown_field_message(err["loc"]) if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"{loc}: {msg}")
        if len(lines) == 1:  # the usual typo: one line
            raise RecipeError(f"{where}: invalid recipe: {lines[0]}") from None
        raise RecipeError("\n  ".join([f"{where}: invalid recipe:", *lines])) from None


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
    recipe = validate_recipe(raw, where=str(p))
    return recipe.resolve_paths(p.parent.resolve())


def reference_markdown() -> str:
    """The recipe reference, generated from the fields above (docs/recipe.md embeds this; ``scripts/gen_readme_reference.py``)."""
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
