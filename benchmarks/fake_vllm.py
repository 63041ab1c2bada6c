"""A zero-latency vLLM-shaped OpenAI server (aiohttp), for the peer benchmark (``benchmarks/peers.py``):
``POST /v1/chat/completions`` answers a fixed reply at once, with vLLM's token fields when asked
(``return_token_ids``: ``prompt_token_ids`` and ``choices[0].token_ids``; ``logprobs``: one entry per
output token), and ``GET /v1/models`` and ``/health``.

    python -m benchmarks.fake_vllm --port 8000 [--model NAME]
"""

from __future__ import annotations

import argparse
import time

import orjson
from aiohttp import web

REPLY = "Hello! 2 + 3 = 5."
PROMPT_IDS = list(range(100, 134))
"""What the fake says the prompt was (34 ids: the benchmark's chat prompt's length under tiny-random)."""
OUTPUT_IDS = list(range(200, 212))


def reply(body: dict, model: str) -> dict:
    """The chat completion for ``body`` (its ``return_token_ids`` and ``logprobs`` honoured)."""
    choice: dict = {"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop",
                    "logprobs": None}
    out: dict = {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
                 "model": body.get("model", model), "choices": [choice],
                 "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(OUTPUT_IDS),
                           "total_tokens": len(PROMPT_IDS) + len(OUTPUT_IDS)}}
    if body.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": f"t{i}", "logprob": -0.25, "bytes": None, "top_logprobs": []}
                                          for i in OUTPUT_IDS]}
    if body.get("return_token_ids"):
        choice["token_ids"] = OUTPUT_IDS
        out["prompt_token_ids"] = PROMPT_IDS
    return out


def make_app(model: str) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        return web.Response(body=orjson.dumps(reply(body, model)), content_type="application/json")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="fake")
    a = p.parse_args()
    import uvloop

    web.run_app(make_app(a.model), host="127.0.0.1", port=a.port, access_log=None, print=None,
                loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
