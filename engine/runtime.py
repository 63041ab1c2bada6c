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

from tracegym.engine.adapters import EngineLora, read_adapter
from tracegym.engine.dist_weights import Bucket, DistWeights
from tracegym.engine.protocol import GenerateOptions, RequestSpec
from tracegym.engine.request import GenRequest, Snapshot
from tracegym.engine.sampling import make_generator
from tracegym.engine.scheduler import Scheduler
from tracegym.engine.weights import read_checkpoint
from tracegym.modelfiles.cpu_memory import keep_freed_memory
from tracegym.modelfiles.cpu_threads import in_own_thread
from tracegym.modelfiles.load import cpu_compute_dtype, default_device, load_model, resolve_dtype

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
    oversubscribed OpenMP pool spins on cores the others need."""
    default = max(1, min((os.cpu_count() or 1) // 2, 8))
    n = max(1, int(os.environ.get("TRACEGYM_ENGINE_THREADS", default)))
    torch.set_num_threads(n)
    return n


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device or default_device())
        dtype = resolve_dtype(config.dtype, self.device.type)
        if self.device.type == "cpu":
            dtype = cpu_compute_dtype(dtype)
            keep_freed_memory()  # each round's batch reuses the last one's pages (modelfiles.cpu_memory)
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
        self.dist = DistWeights(self.model, self.device)
        self.lora = EngineLora(self.model, dtype)  # adapters in the compute dtype (autocast's on CPU)
        self.scheduler.row_hook = lambda reqs: self.lora.set_rows([r.adapter for r in reqs])

    @property
    def max_positions(self) -> int:
        return self.scheduler.max_positions

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    async def load_weights(self, path: str, version: str | None, abort_all: bool) -> int:
        """SGLang's ``/update_weights_from_disk``: read and check the checkpoint off the event loop (in a
        thread of its own: ``modelfiles.cpu_threads``), then have the model thread swap it in (see
        ``Scheduler.update_weights``); one update at a time. Returns the number of requests aborted for it;
        raises (old weights kept) if it cannot load."""
        async with self.weight_lock:
            state = await in_own_thread(read_checkpoint, path, self.model)
            aborted = await asyncio.wrap_future(self.scheduler.update_weights(state, version, abort_all))
            self.model_path = path
        return aborted

    async def update_from_distributed(self, bucket: Bucket) -> int:
        """SGLang's ``/update_weights_from_distributed``: receive and check one bucket; inside
        begin…end stage it (0 returned), else swap it in now like a disk load. Raises (old weights kept)."""
        tensors = await self.dist.receive(bucket)
        if self.dist.session is not None:
            self.dist.stage(tensors, bucket)
            return 0
        async with self.weight_lock:
            return await asyncio.wrap_future(
                self.scheduler.update_weights(tensors, bucket.weight_version, bucket.abort_all_requests))

    async def end_weight_update(self, version: str | None) -> int:
        """SGLang 0.5.23's ``/end_weight_update``: every staged tensor replaces its parameter in one swap,
        stamped with the version (the last bucket's, or ``version``). Raises if a bucket failed."""
        session = self.dist.end(version)
        async with self.weight_lock:
            if not session.staged:
                if session.version is not None:
                    await self.set_weight_version(session.version)
                return 0
            return await asyncio.wrap_future(
                self.scheduler.update_weights(session.staged, session.version, session.abort_all))

    def check_adapters(self, specs: list[RequestSpec]) -> None:
        """A ``lora_path`` naming no loaded adapter is a ValueError (HTTP 400)."""
        for s in specs:
            if s.lora is not None and s.lora not in self.lora.adapters:
                raise ValueError(f"LoRA adapter {s.lora!r} is not loaded (loaded: {self.lora.names()})")

    async def load_lora(self, name: str, path: str) -> None:
        """SGLang's ``/load_lora_adapter``: read and check off the event loop, register on the model
        thread; raises ``AdapterLoadError`` (nothing changed) if this model cannot serve it."""
        adapter = await in_own_thread(read_adapter, name, path, self.model, self.lora.dtype)
        await asyncio.wrap_future(self.scheduler.call(lambda: self.lora.add(adapter)))

    async def unload_lora(self, name: str) -> None:
        await asyncio.wrap_future(self.scheduler.call(lambda: self.lora.remove(name)))

    async def set_weight_version(self, version: str) -> None:
        """SGLang's ``/update_weight_version``: the label later responses carry."""
        await asyncio.wrap_future(self.scheduler.call(lambda: setattr(self.scheduler, "weight_version", version)))

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
            logprob_start_len=spec.logprob_start_len,
            return_text_in_logprobs=opts.return_text_in_logprobs,
            return_prompt_token_ids=opts.return_prompt_token_ids,
            stream=opts.stream,
            adapter=None if spec.lora is None else self.lora.adapters[spec.lora],
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
