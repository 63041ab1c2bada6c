"""The engine object a server owns: model, tokenizer and scheduler, plus the bridge from the scheduler
thread's callbacks to asyncio (futures for whole responses, queues for streams)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from tracegym.trainer.engine.protocol import GenerateOptions, RequestSpec
from tracegym.trainer.engine.request import GenRequest, Snapshot
from tracegym.trainer.engine.sampling import make_generator
from tracegym.trainer.engine.scheduler import Scheduler
from tracegym.trainer.models import default_device, load_model, resolve_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    served_model_name: str
    device: str | None = None
    dtype: str | None = None
    max_batch_size: int = 32
    weight_version: str = "default"


def default_stop_ids(model: Any) -> frozenset[int]:
    """EOS ids from the generation config (else the model config); for SmolLM2 ``<|im_end|>``=2 and
    ``<|endoftext|>``=0."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def set_torch_threads() -> int:
    """Intra-op threads for the one model thread: ``$TRACEGYM_ENGINE_THREADS``, else half the cores (at
    most 8). The engine shares the machine with the gateway, the runners and the trainer, and an
    oversubscribed OpenMP pool is several times slower than a smaller one (measured 6x at 2 threads on 2
    busy cores)."""
    default = max(1, min((os.cpu_count() or 1) // 2, 8))
    n = max(1, int(os.environ.get("TRACEGYM_ENGINE_THREADS", default)))
    torch.set_num_threads(n)
    return n


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device or default_device())
        dtype = resolve_dtype(config.dtype, self.device.type)
        # On CPU, bf16 runs as autocast over fp32 weights; on CUDA the weights themselves are in ``dtype``.
        cpu_autocast = self.device.type == "cpu" and dtype != torch.float32
        self.model = load_model(
            config.model_path, device=str(self.device), dtype=torch.float32 if cpu_autocast else dtype
        )
        tok_file = Path(config.model_path) / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found: the engine needs the model's tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        self.tokenizer_path = str(config.model_path)
        self.model_path = str(config.model_path)
        self.vocab_size = int(self.model.config.vocab_size)
        self.stop_ids = default_stop_ids(self.model)
        self.scheduler = Scheduler(
            self.model,
            self.tokenizer,
            device=self.device,
            max_batch_size=config.max_batch_size,
            weight_version=config.weight_version,
            autocast_dtype=dtype if cpu_autocast else None,
        )
        self.weight_lock = asyncio.Lock()

    @property
    def max_positions(self) -> int:
        return self.scheduler.max_positions

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def _request(self, spec: RequestSpec, opts: GenerateOptions) -> GenRequest:
        stop_ids = frozenset(spec.params.stop_token_ids) | (
            frozenset() if spec.params.ignore_eos else self.stop_ids
        )
        return GenRequest(
            rid=spec.rid,
            input_ids=spec.input_ids,
            params=spec.params,
            generator=make_generator(spec.seed, self.device),
            stop_ids=stop_ids,
            return_logprob=opts.return_logprob,
            top_logprobs_num=opts.top_logprobs_num,
            return_text_in_logprobs=opts.return_text_in_logprobs,
            return_prompt_token_ids=opts.return_prompt_token_ids,
            stream=opts.stream,
        )

    def _snapshot(self, r: GenRequest, final: bool) -> Snapshot:
        """Taken on the model thread (O(1)); the JSON is built from it in the event loop, so detokenizing
        and building logprob lists never stall the decode loop."""
        return r.snapshot(self.scheduler.weight_version, final)

    async def generate(self, specs: list[RequestSpec], opts: GenerateOptions) -> list[dict[str, Any]]:
        """Run the requests to completion; one response object per request, in order."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in specs]
        reqs = [self._request(s, opts) for s in specs]
        for r, fut in zip(reqs, futures, strict=True):
            r.on_update = self._future_setter(loop, fut)
        self.scheduler.submit(reqs)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for r in reqs:
                self.scheduler.abort(r.rid, exact=True)
            raise

    def _future_setter(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
        def on_update(r: GenRequest, final: bool) -> None:
            if final:
                snap = self._snapshot(r, True)
                loop.call_soon_threadsafe(resolve, r, snap)

        def resolve(r: GenRequest, snap: Snapshot) -> None:
            if fut.done():
                return
            try:
                fut.set_result(r.render(self.tokenizer, snap))
            except Exception as e:
                fut.set_exception(e)

        return on_update

    async def stream(self, specs: list[RequestSpec], opts: GenerateOptions) -> AsyncIterator[dict[str, Any]]:
        """Cumulative chunks as the requests progress (with ``index`` when there are several). If the
        consumer stops early (client disconnect), the unfinished requests are aborted."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Snapshot]] = asyncio.Queue()
        reqs = [self._request(s, opts) for s in specs]
        for i, r in enumerate(reqs):
            r.on_update = self._queue_putter(loop, queue, i)
        self.scheduler.submit(reqs)
        memos: list[dict[str, list]] = [{} for _ in reqs]
        remaining = len(reqs)
        try:
            while remaining:
                index, snap = await queue.get()
                payload = reqs[index].render(self.tokenizer, snap, memos[index])
                if len(reqs) > 1:
                    payload["index"] = index
                remaining -= snap.final
                yield payload
        finally:
            if remaining:
                for r in reqs:
                    if not r.finished:
                        self.scheduler.abort(r.rid, exact=True)

    def _queue_putter(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
        def on_update(r: GenRequest, final: bool) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, self._snapshot(r, final)))

        return on_update
