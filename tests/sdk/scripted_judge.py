"""A scripted judge: a tiny HTTP server speaking OpenAI Chat Completions that answers from a script, for
tests of the group judge (``tracegym.judge``) against a real process.

    python -m tests.sdk.scripted_judge --port N --script script.json --log requests.jsonl

The script is a JSON list of answers, used in order (the last one repeats): ``{"content": "..."}`` is a
chat completion with that text, ``{"status": 500}`` an HTTP error. Each request body is appended to the
log as one JSON line. ``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class _Script:
    def __init__(self, answers: list[dict[str, Any]], log: Path) -> None:
        self.answers, self.log, self.lock, self.n = answers, log, threading.Lock(), 0

    def next(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            with self.log.open("a") as f:
                f.write(json.dumps(body) + "\n")
            answer = self.answers[min(self.n, len(self.answers) - 1)]
            self.n += 1
            return answer


def _handler(script: _Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
            if not self.path.endswith("/chat/completions"):
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            answer = script.next(body)
            if "status" in answer:
                self._send(answer["status"], {"error": {"message": "scripted failure", "type": "server_error"}})
                return
            message = {"role": "assistant", "content": answer["content"]}
            self._send(200, {"id": "chatcmpl-judge", "object": "chat.completion", "model": body.get("model"),
                             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

    return Handler


def read_log(log: Path) -> list[dict[str, Any]]:
    """The request bodies the judge received, in order."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


@contextmanager
def scripted_judge(tmp: Path, answers: list[dict[str, Any]]) -> Iterator[tuple[str, Path]]:
    """Run the judge on a free port with ``answers``; yields its OpenAI base URL (``.../v1``) and its
    request log."""
    from tests.procs import free_port, start_process

    tmp.mkdir(parents=True, exist_ok=True)
    script, log, port = tmp / "judge_script.json", tmp / "judge_requests.jsonl", free_port()
    script.write_text(json.dumps(answers))
    log.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "tests.sdk.scripted_judge", "--port", str(port), "--script", str(script),
            "--log", str(log)]
    with start_process(argv, port=port, log_path=tmp / "judge.log", timeout=60, cwd=ROOT) as proc:
        yield f"{proc.base_url}/v1", log


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--script", type=Path, required=True)
    p.add_argument("--log", type=Path, required=True)
    a = p.parse_args()
    script = _Script(json.loads(a.script.read_text()), a.log)
    ThreadingHTTPServer(("127.0.0.1", a.port), _handler(script)).serve_forever()


if __name__ == "__main__":
    main()
