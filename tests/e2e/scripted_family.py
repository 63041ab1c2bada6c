"""A tiny family model (``llama3-tiny``, ``gemma3-tiny``, ``deepseek3-tiny``, ``gptoss-tiny``: the family's
real tokenizer and template) whose weights make it write one tool call, ``f()``, in the family's own
syntax, so end-to-end tests watch the embedded engine *sample* it. The weights are a bigram chain, as in
``scripted_qwen3.py``: the reply starts from the generation prompt's last token, each chain token is a
distinct id, and the LM head scores each token's successor far above the rest."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

from tests.e2e.scripted_qwen3 import LOGIT_SCALE

SCRIPTS = {
    # model name: (the generation prompt's last token, the reply, its stop token). Gemma 3's hermes tags
    # and DeepSeek V3's fenced arguments repeat pieces that no choice of distinct tokens avoids.
    "llama3-tiny": ("ĊĊ", '{"name": "f", "parameters": {}}', "<|eot_id|>"),
    "gptoss-tiny": ("assistant", " to=functions.f<|channel|>commentary json<|message|>{}", "<|call|>"),
}


def _pieces(tok: object, text: str) -> dict[int, list[tuple[str, int]]]:
    """For each position of ``text``: the vocabulary pieces that match there (longest first)."""
    found: dict[int, list[tuple[str, int]]] = {}
    for i in tok.get_vocab().values():  # type: ignore[attr-defined]
        s = tok.decode([i], skip_special_tokens=False)  # type: ignore[attr-defined]
        if not s or "\ufffd" in s or s not in text:
            continue
        start = text.find(s)
        while start >= 0:
            found.setdefault(start, []).append((s, i))
            start = text.find(s, start + 1)
    for options in found.values():
        options.sort(key=lambda p: (-len(p[0]), p[1]))
    return found


def segment(tok: object, text: str, banned: set[int]) -> list[int]:
    """Ids whose pieces concatenate to ``text``, no id twice or in ``banned``: a depth-first search over
    the pieces that occur in ``text`` (far fewer than the vocabulary), longest first."""
    at = _pieces(tok, text)
    out: list[int] = []
    used = set(banned)

    def dfs(pos: int, budget: list[int]) -> bool:
        if pos == len(text):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            return False
        for s, i in at.get(pos, []):
            if i in used:
                continue
            used.add(i)
            out.append(i)
            if dfs(pos + len(s), budget):
                return True
            used.discard(i)
            out.pop()
        return False

    if not dfs(0, [200_000]):
        raise ValueError(f"no segmentation of {text!r} into distinct tokens")
    return out


def build_scripted_family(name: str, src: Path, dest: Path) -> list[int]:
    """Write ``name``'s scripted model to ``dest`` (tokenizer files from ``src``, the prepared tiny model);
    returns the reply's output ids (its stop token included)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from tracegym.modelfiles.family_tiny import TINY_FAMILIES, tiny_config

    start_text, reply, stop = SCRIPTS[name]
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    start, eos = tok.token_to_id(start_text), tok.token_to_id(stop)
    assert start is not None and eos is not None, (start_text, stop)
    ids = segment(tok, reply, {start, eos})
    chain = [start, *ids, eos]
    config = tiny_config(TINY_FAMILIES[name])
    config.tie_word_embeddings = False
    config.hidden_size, config.head_dim = 64, 16
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for k, (token, successor) in enumerate(itertools.pairwise(chain)):
            direction = torch.zeros(config.hidden_size)
            direction[k] = 1.0
            emb[token] = direction
            head[successor] += LOGIT_SCALE * direction
    model.generation_config.eos_token_id = list(TINY_FAMILIES[name].eos_ids)
    model.to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).is_file():
            shutil.copyfile(src / f, dest / f)
    return [*ids, eos]
