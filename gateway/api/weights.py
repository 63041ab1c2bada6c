"""Weight hot-swap API over the app's ``swap.SwapCoordinator`` (the one owner of every swap sequence):

- ``POST /api/weights/update``: pause → update from disk → continue.
- ``POST /api/weights/distributed/init``: the engine joins the trainer's weight-update group.
- ``POST /api/weights/distributed/update``: pause → flush → begin → per bucket, the trainer broadcasts
  while the engine receives → end → continue. The answer is an NDJSON stream: ``{"event": "bucket",
  "index": i}`` when the engine is being asked for bucket ``i`` (the trainer broadcasts it then), and a
  last ``{"event": "done", "success", "message", "weight_version", "swap_seconds"}``.
- ``POST /api/weights/lora``: pause → load each LoRA adapter under a versioned name → stamp the version
  → route calls to the new names → unload the old → continue (``swap.SwapCoordinator.update_lora``).
- ``GET /api/weights``: the upstream's current version, the last swap and the LoRA routing table.

Weights load only from directories under the weights root (``GatewaySettings.weights_dir``,
``--weights-dir``), symlinks and ``..`` resolved first: any other path is the same 403, whether it exists or
not, so the answer tells nothing about the file system outside the root; with no root set, loading from disk is refused.

One swap at a time: a second one while one runs is a 409. Only SGLang-protocol upstreams (SGLang, the
embedded engine) can swap; other kinds answer 400."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.responses import Response, StreamingResponse

from tracegym.gateway.api.params import integer
from tracegym.gateway.openai_errors import (
    ERROR_REF,
    NDJSONResponse,
    OpenAIError,
    bad_request,
    error_responses,
)
from tracegym.gateway.proxy.upstream.swap import Bucket, DistributedUpdate, GroupSpec, SwapCoordinator
from tracegym.gateway.traces.store.schema import INT32_MAX, INT64_MAX

router = APIRouter(prefix="/api", tags=["weights"])

Version = Annotated[str, Field(min_length=1, max_length=200)]
GroupName = Annotated[str, Field(min_length=1, max_length=200)]
FilePath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]
"""A path as the operating system takes one: no NUL (which no path can hold), at most 4096 bytes' worth."""


class WeightUpdateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: FilePath
    weight_version: Version
    pause: bool = True
    """Pause (abort + continue in-flight requests) around the load; False lets the upstream drain them."""


class GroupInitIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(min_length=1)
    master_port: integer(1, 65535)  # type: ignore[valid-type]
    world_size: integer(2, INT32_MAX)  # type: ignore[valid-type]
    """torch.distributed's ranks and world sizes are 32-bit integers."""
    rank_offset: integer(1, INT32_MAX) = 1  # type: ignore[valid-type]
    group_name: GroupName = "weight_update_group"
    backend: str = Field(default="nccl", pattern=r"^(nccl|gloo)$")


class BucketIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[integer(0, INT64_MAX)]]  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _aligned(self) -> BucketIn:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have one entry per tensor")
        if not all(d.isidentifier() for d in self.dtypes):
            raise ValueError("dtypes are torch dtype names such as 'bfloat16'")
        return self


class DistributedUpdateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: Version
    buckets: list[BucketIn] = Field(min_length=1)
    """In broadcast order; the trainer broadcasts each bucket's tensors in ``names`` order."""
    group_name: GroupName = "weight_update_group"


_OUTCOME = {"type": "object", "required": ["success", "message"], "properties": {
    "success": {"type": "boolean"}, "message": {"type": "string"}}}
_REFUSED = {400: {"description": "Not an sglang-kind upstream, or the upstream refused (success: false)",
                  "content": {"application/json": {"schema": {"anyOf": [ERROR_REF, _OUTCOME]}}}}}
"""A swap the upstream refused answers its outcome (``success: false``) with status 400."""


class LoraUpdateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: Version
    adapters: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], FilePath] = \
        Field(min_length=1)
    """Adapter name (``default``, or an agent's name) → its PEFT directory."""
    per_agent: bool = False
    """Route each agent's calls to the adapter named after it (else every call to ``default``)."""


def _coordinator(request: Request) -> SwapCoordinator:
    swap = getattr(request.app.state, "swap", None)
    if swap is None:
        kind = request.app.state.services.upstream.kind
        raise bad_request(f"weight swaps need an sglang-kind upstream (SGLang or the embedded engine); this "
                          f"gateway's upstream is {kind!r}")
    return swap


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def jailed(root: str | None, model_path: str) -> str:
    """``model_path`` resolved (symlinks, ``..``), if it is strictly under ``root`` (resolved too); else the
    one 403 that names neither path. A missing directory under the root is the upstream's to refuse."""
    if not root:
        raise OpenAIError(403, "this gateway loads no weights from disk: start it with --weights-dir DIR "
                          "(TRACEGYM_WEIGHTS_DIR) and write the weights under DIR", code="weights_dir_unset")
    base = os.path.realpath(root)
    path = os.path.realpath(os.path.join(base, model_path))  # a relative path is taken under the root
    if os.path.commonpath([base, path]) != base or path == base:
        raise OpenAIError(403, "model_path is not a weights directory under this gateway's weights root "
                          "(--weights-dir)", code="outside_weights_dir")
    return path


@router.post("/weights/update", responses=error_responses(403, 409, 502, 504) | _REFUSED)
async def update_weights(body: WeightUpdateIn, request: Request) -> Response:
    swap = _coordinator(request)
    path = jailed(request.app.state.services.settings.weights_dir, body.model_path)
    outcome = await swap.update(path, body.weight_version, pause=body.pause)
    return _json(outcome.to_json(), 200 if outcome.success else 400)


@router.post("/weights/lora", responses=error_responses(403, 409, 502, 504) | _REFUSED)
async def update_lora(body: LoraUpdateIn, request: Request) -> Response:
    """Each adapter directory must be under the weights root, as for ``/weights/update``."""
    root = request.app.state.services.settings.weights_dir
    adapters = {name: jailed(root, path) for name, path in body.adapters.items()}
    outcome = await _coordinator(request).update_lora(adapters, body.weight_version, per_agent=body.per_agent)
    return _json(outcome.to_json(), 200 if outcome.success else 400)


@router.post("/weights/distributed/init", responses=error_responses(409, 502, 504) | _REFUSED)
async def init_weight_group(body: GroupInitIn, request: Request) -> Response:
    ok, message = await _coordinator(request).init_group(GroupSpec(**body.model_dump()))
    return _json({"success": ok, "message": message}, 200 if ok else 400)


@router.post("/weights/distributed/update", response_class=NDJSONResponse,
             responses=error_responses(400, 409))
async def update_weights_distributed(body: DistributedUpdateIn, request: Request) -> Response:
    update = DistributedUpdate(
        weight_version=body.weight_version, group_name=body.group_name,
        buckets=[Bucket(b.names, b.dtypes, b.shapes) for b in body.buckets])
    swap = _coordinator(request).start_distributed(update)  # 409 here, before the stream starts

    async def lines() -> AsyncIterator[bytes]:
        async for ev in swap.events():
            yield orjson.dumps(ev) + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.get("/weights", responses=error_responses(400, 502, 504))
async def current_weights(request: Request) -> Response:
    return _json(await _coordinator(request).status())
