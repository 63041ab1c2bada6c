"""``GET /api/upstreams``: the gateway's inference engines (``--upstream`` repeated makes a fleet, see
``proxy/upstream/fleet.py``): each engine's URL, health, calls in flight and served, failovers, model
and weight version (asked live), and the fleet's one weight version."""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from starlette.responses import Response

from tracegym.gateway.deps import ServicesDep
from tracegym.gateway.proxy.upstream.fleet import UpstreamFleet

router = APIRouter(prefix="/api", tags=["upstreams"])


@router.get("/upstreams")
async def upstreams(svc: ServicesDep) -> Response:
    up = svc.upstream
    if isinstance(up, UpstreamFleet):
        body = await up.status()
    else:  # a provider through litellm: no engines of its own
        body = {"kind": up.kind, "model": svc.served_model, "weight_version": None, "engines": [],
                "health": await up.health()}
    return Response(orjson.dumps(body), media_type="application/json")
