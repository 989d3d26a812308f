"""The chat page's assembly (``coordinator.api.page``): the CSP lists exactly the hashes of the inlined
style and script, and nothing else may run or load."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest

from coordinator.api.page import ChatPage, chat_page


def _sha(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_the_csp_allows_exactly_the_inlined_style_and_script() -> None:
    page = chat_page()
    [style] = re.findall(r"<style>(.*?)</style>", page.html, re.S)
    [script] = re.findall(r"<script>(.*?)</script>", page.html, re.S)
    rules = dict(r.split(" ", 1) for r in page.csp.split("; "))
    assert rules["script-src"] == _sha(script) and rules["style-src"] == _sha(style)
    assert rules["default-src"] == "'none'" and rules["connect-src"] == "'self'" and rules["frame-ancestors"] == "'none'"
    assert "unsafe" not in page.csp
    markup = re.sub(r"<script>.*?</script>", "", page.html, flags=re.S)
    assert re.search(r"\s(style|on[a-z]+)=", markup) is None  # no inline style or handler attribute (CSP blocks them)
    assert "{{" not in page.html and "http:" not in page.html and "https:" not in page.html


def test_an_inlined_part_cannot_close_its_own_element() -> None:
    with pytest.raises(ValueError, match="must not close"):
        ChatPage("<style>{{STYLE}}</style><script>{{SCRIPT}}</script>", "a{}", "x = '</script><b>'")
