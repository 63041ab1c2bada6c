"""The ``tracegym`` command. Each subcommand imports its implementation lazily, so ``tracegym run``
never pays for torch and ``tracegym serve`` never imports it at all."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# subcommand -> "module:function"; each function takes the parsed argparse.Namespace and returns an exit code.
_TARGETS = {
    "serve": "tracegym.gateway.serve:main",
    "engine": "tracegym.trainer.engine.server:main",
    "run": "tracegym.runner:main",
    "enqueue": "tracegym.runner:enqueue_main",
    "train": "tracegym.trainer.loop:main",
    "export": "tracegym.export:main",
    "db": "tracegym.gateway.store.migrate:main",
    "models": "tracegym.trainer.models:main",
}
# subcommand -> the extra (pyproject.toml) its implementation needs beyond the bare SDK
_EXTRAS = {
    "serve": "gateway",
    "db": "gateway",
    "engine": "trainer",
    "models": "trainer",
    "train": "gateway,trainer",  # the loop starts the gateway as well as the engine
}


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--upstream", help="URL of the inference server (SGLang, OpenAI-compatible)")
    p.add_argument("--upstream-kind", choices=["sglang", "openai", "litellm"], default="sglang")
    p.add_argument("--engine", choices=["embedded"], help="start the embedded engine as the upstream")
    p.add_argument("--engine-port", type=int, default=0, help="port of the embedded engine (0 = free port)")
    p.add_argument("--model", help="model name: its tokenizer/chat template and the served name")
    p.add_argument("--store", default="sqlite:///./tracegym.db", help="SQLAlchemy URL of the trace store")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--upstream-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--log-level", default="info")


def _add_engine(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="run the embedded inference engine (SGLang-compatible HTTP API)")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--log-level", default="info")


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run an agent function over queued rollouts")
    p.add_argument("target", metavar="MODULE:FUNCTION")
    p.add_argument("--gateway", default=None, help="gateway URL (default $TRACEGYM_GATEWAY)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--lease-seconds", type=float, default=120.0)
    p.add_argument("--max-rollouts", type=int, default=None, help="stop after this many (default: run on)")
    p.add_argument("--exit-when-idle", action="store_true", help="stop when the queue is empty")
    p.add_argument("--worker-id", default=None)

    q = sub.add_parser("enqueue", help="enqueue tasks from a JSONL file")
    q.add_argument("dataset", metavar="FILE.jsonl")
    q.add_argument("--gateway", default=None)
    q.add_argument("--group-size", type=int, default=1)
    q.add_argument("--max-attempts", type=int, default=3)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="the whole loop from a YAML recipe")
    p.add_argument("recipe", metavar="RECIPE.yaml")
    p.add_argument("--resume", action="store_true", help="continue from the recipe's checkpoint dir")
    p.add_argument("--steps", type=int, default=None, help="override the recipe's step count")


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export trajectories (JSONL) for SFT/DPO")
    p.add_argument("--gateway", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=["trajectories", "chat"], default="trajectories")
    p.add_argument("--status", default="completed")
    p.add_argument("--since", default=None)
    p.add_argument("--limit", type=int, default=None)


def _add_db(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("db", help="trace store maintenance")
    p.add_argument("action", choices=["upgrade", "current"])
    p.add_argument("--store", default="sqlite:///./tracegym.db")


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="prepare a named model in the local cache")
    p.add_argument("action", choices=["prepare", "path"])
    p.add_argument("name")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracegym", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_engine, _add_run, _add_train, _add_export, _add_db, _add_models):
        add(sub)
    return parser


def _load(command: str) -> Callable[[argparse.Namespace], int | None]:
    """The implementation of ``command``. A third-party package it needs that is missing (the bare SDK
    installed without the extra) exits with the ``pip install`` that adds it, not a traceback."""
    module, func = _TARGETS[command].split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        extra = _EXTRAS.get(command)
        if not missing or missing == "tracegym" or extra is None:
            raise
        raise SystemExit(
            f"tracegym {command}: the {missing!r} package is not installed; `tracegym {command}` needs "
            f"the {extra} extra: pip install 'tracegym[{extra}]'"
        ) from None
    return getattr(mod, func)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rc = _load(args.command)(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
