"""Regenerate the recipe reference table in README.md from trainer/config.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tracegym.trainer.config import reference_markdown

START, END = "<!-- recipe-reference:start -->", "<!-- recipe-reference:end -->"


def render(readme: str) -> str:
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    return pattern.sub(lambda _: f"{START}\n{reference_markdown()}\n{END}", readme)


if __name__ == "__main__":
    path = Path(__file__).resolve().parents[1] / "README.md"
    new = render(path.read_text())
    if "--check" in sys.argv:
        sys.exit(0 if new == path.read_text() else 1)
    path.write_text(new)
