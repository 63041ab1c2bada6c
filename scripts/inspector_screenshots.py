"""Screenshots of the trace inspector for its docs page (docs/inspector.md): the runs page of a run and the token view of one of
its rollouts, taken with Debian's chromium through Playwright from a gateway serving the run's store.

    python scripts/inspector_screenshots.py http://127.0.0.1:8001 --run quickstart [--rollout ID] [--out docs/img]

Without ``--rollout`` it takes the newest completed rollout whose reward is 1."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright


def _rollout(url: str) -> str:
    rows = httpx.get(f"{url}/api/inspect/rollouts", params={"status": "completed", "reward_min": 1, "limit": 1},
                     timeout=30).json()["rollouts"]
    if not rows:
        raise SystemExit("no completed rollout with reward 1 in this store: pass --rollout")
    return rows[0]["rollout_id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--run", required=True)
    ap.add_argument("--rollout", default=None)
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    args = ap.parse_args()
    rollout = args.rollout or _rollout(args.url)
    args.out.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900}, device_scale_factor=1)
        page.goto(f"{args.url}/ui/runs/{args.run}")
        page.wait_for_selector("body[data-ready='1']")
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(args.out / "inspector_runs.png"))
        page.goto(f"{args.url}/ui/rollouts/{rollout}")
        page.wait_for_selector("body[data-ready='1']")
        page.locator(".sequence").first.scroll_into_view_if_needed()
        sampled = page.locator(".tokens .tok.s")
        sampled.nth(sampled.count() - 8).hover()  # a token of the last call: the card hides no earlier text
        page.screenshot(path=str(args.out / "inspector_tokens.png"))
        browser.close()
    print(f"wrote {args.out / 'inspector_runs.png'} and {args.out / 'inspector_tokens.png'} (rollout {rollout})")


if __name__ == "__main__":
    main()
