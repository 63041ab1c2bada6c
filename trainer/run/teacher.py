"""The distillation teacher: prepared like the student (a model name or a model directory), or the newest
weights a finished run kept (its run directory); refused unless it shares the student's tokenizer
(token-level distillation compares the two models' logprobs of the same token ids)."""

from __future__ import annotations

from pathlib import Path

from tracegym.trainer.recipe import RecipeError


def vocabulary(model_dir: Path) -> dict[str, int]:
    """The token → id map of a model directory's ``tokenizer.json``, added tokens included."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise RecipeError(f"{model_dir} has no tokenizer.json: its vocabulary cannot be compared")
    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def check_teacher(student_dir: Path, teacher_dir: Path, teacher: str) -> None:
    """``RecipeError`` unless the teacher's vocabulary is the student's, token for token."""
    s, t = vocabulary(student_dir), vocabulary(teacher_dir)
    if s == t:
        return
    differ = sorted(k for k in s.keys() ^ t.keys())[:3] or sorted(k for k in s if s[k] != t.get(k))[:3]
    raise RecipeError(
        f"distill.teacher {teacher!r} has another tokenizer than the student ({len(t)} vs {len(s)} tokens;"
        f" e.g. {differ}): token-level distillation needs one vocabulary; pick a teacher of the student's"
        " family"
    )


def kept_weights(run_dir: Path) -> Path | None:
    """The newest weight version a run directory kept (``weights/v<N>``, ``keep: weights``); None when
    ``run_dir`` is not a run directory (it has no ``metrics.jsonl``)."""
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    kept = [p for p in (run_dir / "weights").glob("v*") if p.name[1:].isdigit()]
    versions = [p for p in kept if (p / "config.json").is_file()]
    if kept and not versions:
        raise RecipeError(f"distill.teacher {str(run_dir)!r} kept weight versions that are not whole models (a LoRA"
                          " run keeps adapters): the teacher must be a whole model; name a model directory")
    if not versions:
        raise RecipeError(f"distill.teacher {str(run_dir)!r} is a run directory that kept no weights: train the"
                          " teacher with `keep: weights` (or `keep: checkpoint`), or name a model directory")
    return max(versions, key=lambda p: int(p.name[1:]))


def prepare_teacher(teacher: str, student_dir: Path) -> Path:
    """The teacher's model directory (``prepare_model``; for a run directory, the newest weights it kept),
    checked against the student's tokenizer."""
    from tracegym.modelfiles.prepare import prepare_model

    local = Path(teacher).expanduser()
    teacher_dir = (local.is_dir() and kept_weights(local)) or prepare_model(teacher)
    check_teacher(student_dir, teacher_dir, teacher)
    return teacher_dir
