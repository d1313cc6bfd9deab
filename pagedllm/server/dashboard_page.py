"""The KV cache page as one self-contained HTML document: the server's live dashboard and the
memory bench's static report are the same page (static/dashboard.{html,css,js}) with different
data inlined. Nothing is loaded from elsewhere, so it works offline and as a file; its
Content-Security-Policy allows only its own inline script and style and connections back to the
server that sent it.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
from functools import cache
from importlib.resources import files

from pagedllm.core.kv.snapshot import STATE_DESCRIPTIONS, STATE_NAMES

_STATIC = files("pagedllm.server") / "static"
_SLOT = re.compile(r"\{(csp|title|css|data|js)\}")


@cache
def _asset(name: str) -> str:
    return (_STATIC / name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _json_for_script(data: dict) -> str:
    """JSON that cannot end its <script> element early, whatever strings it holds."""
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")


def render_page(title: str, data: dict) -> str:
    """The page with `data` (the mode and what it needs) inlined. `data["mode"]` is "live"
    (then data["events"] is the server's events path) or "report" (data["panels"])."""
    css, js = _asset("dashboard.css"), _asset("dashboard.js")
    data = {"states": list(STATE_NAMES), "state_descriptions": list(STATE_DESCRIPTIONS), **data}
    csp = (f"default-src 'none'; script-src {_sha256(js)}; style-src {_sha256(css)}; "
           "connect-src 'self'; base-uri 'none'; form-action 'none'")
    values = {"csp": csp, "title": html.escape(title), "css": css,
              "data": _json_for_script(data), "js": js}
    return _SLOT.sub(lambda m: values[m.group(1)], _asset("dashboard.html"))
