"""The web page in a real headless Chromium: type a prompt, watch the answer arrive.

Uses Debian's `chromium` through playwright's `executable_path` (playwright's own browser
downloads are not used). The model is the scripted double, so the page's answer, its
reasoning box and the step colours of the diffusion view can be checked exactly. The
screenshot lands in the test's tmp dir; set CLOVER_UI_SCREENSHOT=path to keep a copy.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from clover.serving.options import ServeOptions
from tests.test_server_support import (
    THINKING_CHATML,
    scripted_loader,
    serve_in_thread,
    write_checkpoint,
)

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
REASONING = "The user wants a sum. 2 + 2 is 4."
ANSWER = (
    "2 + 2 = 4. Diffusion fills each block of the answer in a few steps, not one token at a time."
)


def _confidence(i: int) -> float:
    # every fourth token is certain at once; the rest commit one per step, most sure first
    return 0.99 if i % 4 == 0 else 0.3 + 0.15 * ((i * 5) % 4)


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
)
def test_chat_page_in_headless_chromium(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    checkpoint = write_checkpoint(tmp_path / "ckpt", 512, THINKING_CHATML)
    answers = {True: f"{REASONING}</think>\n\n{ANSWER}", False: ANSWER}
    loader = scripted_loader(checkpoint, answers, _confidence)
    with (
        serve_in_thread(ServeOptions(model=str(checkpoint)), loader) as url,
        sync_api.sync_playwright() as p,
    ):
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 820})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_selector("#status.ready")
            assert page.inner_text("#model").startswith("tiny")
            page.click("#settings summary")
            page.select_option("#decoder", "low_confidence")
            page.fill("#block_size", "8")
            page.fill("#threshold", "0.9")
            page.check("#thinking")
            page.fill("#prompt", "What is 2 + 2?")
            page.press("#prompt", "Enter")
            page.wait_for_selector(".msg.assistant .stats:has-text('TPF')", timeout=20_000)

            assert page.inner_text(".msg.user") == "What is 2 + 2?"
            assert page.inner_text(".msg.assistant .answer") == ANSWER
            assert page.inner_text(".msg.assistant .reasoning .text") == REASONING
            stats = page.inner_text(".msg.assistant .stats")
            assert "NFE" in stats and "tokens/s" in stats and "low_confidence, block 8" in stats
            assert page.locator(".block").count() >= 5
            assert page.locator(".block .cell.mask").count() == 0  # every position filled in
            assert page.locator(".block .cell.s0").count() > 0
            assert page.locator(".block .cell.s3").count() > 0  # blocks took several steps
            assert not errors

            shot = tmp_path / "web-ui.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("CLOVER_UI_SCREENSHOT"):
                shutil.copy(shot, os.environ["CLOVER_UI_SCREENSHOT"])
        finally:
            browser.close()
