"""Regenerate the recipe reference table in docs/recipe.md from trainer/recipe.py.

    python scripts/gen_readme_reference.py           # rewrite the table
    python scripts/gen_readme_reference.py --check   # exit 1 if it differs from the code
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tracegym.trainer.recipe import reference_markdown

START, END = "<!-- recipe-reference:start -->", "<!-- recipe-reference:end -->"
PAGE = Path(__file__).resolve().parents[1] / "docs" / "recipe.md"


def render(page: str) -> str:
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise SystemExit(f"{PAGE}: no {START} ... {END} block to fill")
    return pattern.sub(lambda _: f"{START}\n{reference_markdown()}\n{END}", page)


if __name__ == "__main__":
    new = render(PAGE.read_text())
    if "--check" in sys.argv:
        sys.exit(0 if new == PAGE.read_text() else 1)
    PAGE.write_text(new)
