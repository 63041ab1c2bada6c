"""The trace inspector: a read-only web UI at ``/ui`` and the JSON routes it reads (``inspector_routes``).

The front end is static files in this package (``static/``: one HTML shell, plain JavaScript, CSS, and
uPlot for the charts, vendored from its npm package with its licence): no build step, nothing fetched from
elsewhere at run time. Every ``/ui/...`` path answers the same shell, whose script reads the path and
draws the page from the JSON routes. Requests carry ``Authorization: Bearer <key>`` when the user has
entered an admin key in the page's login form (kept in the browser's sessionStorage).
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

from tracegym.gateway.api.ui.inspector_routes import InspectorState
from tracegym.gateway.api.ui.inspector_routes import router as api_router

STATIC = resources.files(__package__) / "static"


def _page_router(shell: str) -> APIRouter:
    pages = APIRouter(tags=["inspector"], include_in_schema=False)

    # The shell is a few KB, read once; "no-cache" so a new version of the script is picked up at once
    # (the static files below are revalidated by their ETag).
    headers = {"Cache-Control": "no-cache"}

    async def page(request: Request) -> HTMLResponse:
        request.app.state.inspector.flags.warm_up(request.app.state.store)
        return HTMLResponse(shell, headers=headers)

    pages.add_api_route("/ui", page, methods=["GET"])
    pages.add_api_route("/ui/{page:path}", page, methods=["GET"])
    return pages


def install(app: FastAPI) -> None:
    """Add the inspector to a gateway that has a store: its state, JSON routes, static files and pages."""
    app.state.inspector = InspectorState()
    app.include_router(api_router)
    # Mounted before the page routes, so /ui/static/... is a file and every other /ui/... the shell.
    app.mount("/ui/static", StaticFiles(directory=str(STATIC)), name="ui-static")
    app.include_router(_page_router((STATIC / "index.html").read_text(encoding="utf-8")))
