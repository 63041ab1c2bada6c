"""Weight hot-swap API: ``POST /api/weights/update`` runs one swap through the app's
``swap.SwapCoordinator`` (pause → update from disk → continue); ``GET /api/weights`` reports the
upstream's current version and the last swap. Only SGLang-protocol upstreams (SGLang, the embedded
engine) can swap; other kinds answer 400."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from tracegym.gateway.errors import bad_request
from tracegym.gateway.swap import SwapCoordinator

router = APIRouter(prefix="/api", tags=["weights"])


class WeightUpdateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    weight_version: str = Field(min_length=1, max_length=200)
    pause: bool = True
    """Pause (abort + continue in-flight requests) around the load; False lets the upstream drain them."""


def _coordinator(request: Request) -> SwapCoordinator:
    swap = getattr(request.app.state, "swap", None)
    if swap is None:
        kind = request.app.state.services.upstream.kind
        raise bad_request(f"weight swaps need an sglang-kind upstream (SGLang or the embedded engine); this "
                          f"gateway's upstream is {kind!r}")
    return swap


@router.post("/weights/update")
async def update_weights(body: WeightUpdateIn, request: Request) -> Response:
    outcome = await _coordinator(request).update(body.model_path, body.weight_version, pause=body.pause)
    return Response(orjson.dumps(outcome.to_json()), status_code=200 if outcome.success else 400,
                    media_type="application/json")


@router.get("/weights")
async def current_weights(request: Request) -> Response:
    return Response(orjson.dumps(await _coordinator(request).status()), media_type="application/json")
