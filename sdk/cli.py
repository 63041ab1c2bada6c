"""The ``tracegym`` command. Each subcommand imports its implementation lazily, so ``tracegym run``
never pays for torch and ``tracegym serve`` never imports it at all."""


from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from tracegym.errors import USAGE_EXIT_CODE, UserError
from tracegym.progress import quiet_progress_bars

DESCRIPTION = """tracegym turns an agent's LLM traffic into reinforcement learning: point the agent's base_url
at the gateway (tracegym serve), run it over queued tasks (tracegym run), and train on the recorded,
token-exact trajectories (tracegym train RECIPE.yaml, which can start everything itself)."""

# subcommand -> "module:function"; each function takes the parsed argparse.Namespace and returns an exit code.
_TARGETS = {
    "serve": "tracegym.gateway.serve:main",
    "engine": "tracegym.engine.server:main",
    "run": "tracegym.queue_commands:main",
    "enqueue": "tracegym.queue_commands:enqueue_main",
    "train": "tracegym.trainer.run.loop:main",
    "tinker-serve": "tracegym.trainer.service.main:main",
    "export": "tracegym.export:main",
    "import": "tracegym.imports:main",
    "db": "tracegym.gateway.traces.store.migrate:main",
    "inspect": "tracegym.gateway.serve:inspect_main",
    "models": "tracegym.modelfiles.prepare:main",
}
# subcommand -> the extra (pyproject.toml) its implementation needs beyond the bare SDK
_EXTRAS = {
    "serve": "gateway",
    "db": "gateway",
    "inspect": "gateway",
    "engine": "trainer",
    "models": "trainer",
    "train": "gateway,trainer",  # the loop starts the gateway as well as the engine
    "tinker-serve": "gateway,trainer,tinker",  # it starts a gateway too; the SDK's wire format
}


def _parser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # also after the subcommand; SUPPRESS keeps a `tracegym --debug CMD` from being reset to False
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the traceback of an error (also: TRACEGYM_DEBUG=1)")
    return p


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "serve", "run the gateway: agents' LLM calls in, recorded as spans, answered by the upstream")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--upstream", action="append", metavar="URL",
                   help="URL of the inference server (SGLang, OpenAI-compatible); repeat it for several engines "
                        "of one model (a rollout's calls stay on one engine, swaps reach all or none)")
    p.add_argument("--upstream-kind", choices=["sglang", "openai", "litellm"], default="sglang",
                   help="the upstream's protocol")
    p.add_argument("--engine", choices=["embedded"], help="start the embedded engine as the upstream")
    p.add_argument("--engine-port", type=int, default=0, help="port of the embedded engine (0 = free port)")
    p.add_argument("--engines", type=int, default=1, help="embedded engines to start (with --engine embedded)")
    p.add_argument("--model", help="model name: its tokenizer/chat template and the served name")
    p.add_argument("--chat-format", default=None, metavar="FAMILY",
                   help="the model family to render prompts and parse replies with, instead of recognising it from "
                        "the tokenizer (default: $TRACEGYM_CHAT_FORMAT, else recognised; docs/model-families.md, "
                        "an unknown name lists the families)")
    p.add_argument("--store", default=None,
                   help="SQLAlchemy URL of the trace store, or none (default: $TRACEGYM_STORE_URL, else "
                        "sqlite:///./tracegym.db); given without --upstream or --engine: only browse it in the "
                        "trace inspector, read-only; a password here shows in the process list: put the URL in "
                        "$TRACEGYM_STORE_URL or the password in --store-password-file")
    p.add_argument("--store-password-file", default=None, metavar="FILE",
                   help="a file holding the store's password, put into the store URL")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body accepted (413 above it), also after inflating OTLP bodies")
    p.add_argument("--upstream-timeout", type=float, default=600.0,
                   help="seconds the upstream may stay silent before a call fails with 504")
    p.add_argument("--durability", choices=["commit", "async"], default="commit",
                   help="commit: answer a call only once its span is committed to the store (default); "
                        "async: answer at once, write spans in the background (a crash loses the queued ones)")
    p.add_argument("--commit-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="with --durability commit: a call whose span is not committed within SECONDS (a stalled "
                        "or locked store) is answered 503 span_not_stored")
    p.add_argument("--max-tokens-cap", type=int, default=None, metavar="N",
                   help="refuse (400) calls asking for more than N new tokens; calls that ask for none get N")
    p.add_argument("--log-level", default="info", help="uvicorn's log level")
    _add_serve_security(p)


def _add_serve_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin-key", default=None,
                   help="admin key every route but /healthz needs (default $TRACEGYM_ADMIN_KEY; the environment "
                        "keeps it out of the process list)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an admin key")
    p.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                   help="a Host header name to answer besides localhost/127.0.0.1/[::1] (repeatable)")
    p.add_argument("--weights-dir", default=None,
                   help="the only directory /api/weights/update loads weights from (default: none, refused)")
    p.add_argument("--max-concurrent-calls", type=int, default=None, metavar="N",
                   help="inference calls served at once; one more is a 429 (default 1024, "
                        "$TRACEGYM_MAX_CONCURRENT_CALLS; docs/security.md lists every limit)")


def _add_tinker_serve(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "tinker-serve", "run the training service: the Tinker API (the tinker SDK's base_url) over "
                "the trainer, every sample a span in the store (docs/tinker.md)")
    p.add_argument("--model", required=True, action="append", help="a base model it trains and samples "
                   "(tracegym models); repeat it to serve several, each on its own gateway and engine (the first "
                   "is the default)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8100, help="port to listen on")
    p.add_argument("--state-dir", default="tinker-service", help="checkpoints, published weights, logs, the "
                   "store (when --store is not given)")
    p.add_argument("--store", default=None, help="the store of the gateway it starts (default: "
                   "$TRACEGYM_STORE_URL, else SQLite in --state-dir)")
    p.add_argument("--gateway", default=None, metavar="URL", help="sample through this running gateway instead "
                   "of starting one (its key: $TRACEGYM_GATEWAY_KEY)")
    p.add_argument("--gateway-weights-dir", default=None, metavar="DIR", help="that gateway's --weights-dir "
                   "(published weights are written under DIR/tinker)")
    p.add_argument("--keep", type=int, default=4, help="published weight versions kept on disk, per base model "
                   "(older samplers are refused)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="token budget of one forward/backward "
                   "micro-batch (default: 4096 on a GPU, 1024 on a CPU)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="training compute dtype: "
                   "bf16 autocast where this CPU or GPU runs it fast (else fp32); weights and AdamW stay fp32")
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads of the training workers")
    p.add_argument("--ray", action="store_true", help="run each training run's workers as Ray actors, on a Ray "
                   "it starts (or joins: --ray-address, $RAY_ADDRESS) as tracegym train does (docs/tinker.md)")
    p.add_argument("--ray-address", default=None, metavar="ADDR", help="with --ray: join this running cluster "
                   "(HEAD:6379, ray://HEAD:10001 or auto) instead of starting a Ray; it is left running")
    p.add_argument("--num-workers", type=int, default=1, metavar="N", help="with --ray: ranks per training run "
                   "(FSDP2 data parallel, gloo on CPU, NCCL on GPU)")
    p.add_argument("--cpus-per-worker", type=float, default=None, help="with --ray: CPUs each rank reserves "
                   "(default 1)")
    p.add_argument("--gpus-per-worker", type=float, default=None, help="with --ray: GPUs each rank reserves "
                   "(default 0: CPU ranks)")
    p.add_argument("--admin-key", default=None, help="the key every route but the health check needs "
                   "(default $TRACEGYM_ADMIN_KEY)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an admin key")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "inspect", "browse a finished run in the trace inspector, read-only (no upstream needed)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/NAME/TIME; runs/NAME: its latest run)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8001, help="port to listen on")
    p.add_argument("--model", default=None, help="the tokenizer that shows tokens as text (None: the run's "
                   "last weights)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    _add_serve_security(p)


def _add_engine(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "engine", "run the embedded inference engine (SGLang-compatible HTTP API)")
    p.add_argument("--model", required=True, help="model name (tracegym models) or a local directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=30000, help="port to listen on")
    p.add_argument("--device", default=None, help="cpu or cuda (None: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (None: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-batch-size", type=int, default=32, help="requests decoded together at most")
    p.add_argument("--weight-version", default="default", help="version reported for the loaded weights")
    p.add_argument("--log-level", default="info", help="uvicorn's log level")


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "run", "run an agent function over queued rollouts")
    p.add_argument("target", metavar="MODULE:FUNCTION", help="the agent: a module or file.py, and a function")
    p.add_argument("--gateway", default=None, help="gateway URL (None: $TRACEGYM_GATEWAY)")
    p.add_argument("--concurrency", type=int, default=4, help="rollouts run at once")
    p.add_argument("--lease-seconds", type=float, default=120.0, help="lease per claimed rollout, kept alive "
                   "by heartbeats")
    p.add_argument("--max-rollouts", type=int, default=None, help="stop after this many (None: no limit)")
    p.add_argument("--follow", action="store_true", help="keep waiting for new rollouts once the queue is "
                   "empty (a long-lived worker); by default the run ends when the queue is drained")
    p.add_argument("--exit-when-idle", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument("--worker-id", default=None, help="this worker's name in leases (None: host and pid)")

    q = _parser(sub, "enqueue", "enqueue tasks from a JSONL file")
    q.add_argument("dataset", metavar="FILE.jsonl", help="one task per line (its 'input' field, or the line)")
    q.add_argument("--gateway", default=None, help="gateway URL (None: $TRACEGYM_GATEWAY)")
    q.add_argument("--group-size", type=int, default=1, help="rollouts per task (a GRPO group)")
    q.add_argument("--max-attempts", type=int, default=3, help="tries per rollout before it fails")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "train", "the whole loop from a YAML recipe")
    p.add_argument("recipe", metavar="RECIPE.yaml", help="the recipe (docs/recipe.md)")
    p.add_argument("--resume", action="store_true",
                   help="continue the last run (run_dir's `latest`, or run_dir itself) from its checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="a run_dir without {timestamp} that holds a run: delete that run's files and start again")
    p.add_argument("--steps", type=int, default=None, help="override the recipe's step count")


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "export", "export trajectories, chat transcripts, preference pairs or a parquet dataset")
    p.add_argument("--gateway", default=None, help="gateway URL (None: $TRACEGYM_GATEWAY)")
    p.add_argument("--out", required=True, help="the file to write (JSONL; parquet for --format hf); missing folders are made")
    p.add_argument("--format", choices=["trajectories", "chat", "sft", "dpo", "hf"], default="trajectories",
                   help="token-level trajectories; chat transcripts with their rewards (sft is the same); "
                        "dpo: a group's best vs worst rollout; hf: a parquet dataset (needs tracegym[datasets])")
    p.add_argument("--status", default="completed", help="rollout status to export")
    p.add_argument("--since", default=None, help="only rollouts created since (ISO-8601 or epoch seconds)")
    p.add_argument("--ids", default=None, help="only these rollouts (comma-separated ids)")
    p.add_argument("--limit", type=int, default=None, help="at most this many rollouts (None: all)")


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "import", "import demonstrations, preference pairs or an exported dataset into the store")
    p.add_argument("file", metavar="FILE", help="JSONL (chat, sft, dpo, trajectories) or parquet (hf)")
    p.add_argument("--name", required=True, help="the dataset's name: its groups are NAME-import-<line>, "
                   "which a recipe's sft.runs / dpo.runs select")
    p.add_argument("--format", choices=["chat", "sft", "dpo", "trajectories", "hf"], default="chat",
                   help="chat/sft: OpenAI chat JSONL; dpo: prompt/chosen/rejected JSONL; trajectories and hf: "
                        "tracegym export's token-level forms")
    p.add_argument("--gateway", default=None, help="gateway URL (None: $TRACEGYM_GATEWAY)")


def _add_db(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "db", "trace store maintenance: upgrade its schema, or show its revision")
    p.add_argument("action", choices=["upgrade", "current"], help="what to do")
    p.add_argument("--store", default="sqlite:///./tracegym.db", help="SQLAlchemy URL of the trace store")


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "models", "list the known and prepared models, prepare one in the local cache, or print "
                "where it is")
    p.add_argument("action", choices=["list", "prepare", "path"], help="what to do")
    p.add_argument("name", nargs="?", help="a model name (smollm2-135m, tiny-random, ...), a local directory "
                   "or a hub id (prepare, path)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracegym", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also: "
                        "TRACEGYM_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_inspect, _add_engine, _add_run, _add_train, _add_tinker_serve, _add_export, _add_import, _add_db, _add_models):
        add(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tracegym")
    except PackageNotFoundError:
        return "unknown (not installed)"


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
        raise UserError(
            f"the {missing!r} package is not installed; `tracegym {command}` needs the {extra} extra",
            f"install it: pip install 'tracegym[{extra}]'",
        ) from None
    return getattr(mod, func)


def _model_arg(args: argparse.Namespace) -> str | None:
    """The model name a command is about to load, if it loads one (``serve`` only for its embedded engine:
    with ``--upstream`` its ``--model`` may be any served name)."""
    if args.command == "engine" or (args.command == "serve" and args.engine == "embedded"):
        return args.model
    if args.command == "models" and args.action == "prepare":
        return args.name
    return None


def _check_model_first(args: argparse.Namespace) -> None:
    """A model name that cannot name a model fails here, with a "did you mean", before the command's
    implementation (and torch) is imported; the implementations check again for their other callers."""
    name = _model_arg(args)
    if name:
        from tracegym.models import check_model_name

        check_model_name(name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. A ``UserError`` (or a ``SystemExit`` with a message) is printed as its one or
    two lines on stderr and exits with code 2; ``--debug`` prints the traceback above it."""
    args = build_parser().parse_args(argv)
    quiet_progress_bars(sys.stderr)  # before any command imports transformers; children inherit it
    debug = args.debug or os.environ.get("TRACEGYM_DEBUG", "").lower() in ("1", "true", "yes", "on")
    try:
        _check_model_first(args)
        rc = _load(args.command)(args)
    except UserError as e:
        return _user_error(e, f"tracegym {args.command}: {e}", debug)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        return _user_error(e, e.code, debug)
    return int(rc or 0)


def _user_error(e: BaseException, message: str, debug: bool) -> int:
    if debug:
        traceback.print_exception(e)
    print(message, file=sys.stderr)
    return USAGE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
