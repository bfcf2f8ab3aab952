"""``--html PATH``: a command's report as one self-contained HTML page.

The page carries the object the command prints with ``--json`` (schema_version, command and
all) in a ``<script type="application/json" id="memplan-data">`` block, and its script
(``html_page.js``, inlined) draws every table and chart from that object: a number on the page
is the JSON's by construction. What is drawn, by command:

- ``estimate`` (and the estimate inside ``diagnose``): each pipeline stage's peak as a stacked
  bar against the GPU's capacity, split as ``memplan.report.plot_estimate.stage_parts`` splits
  it; every term per stage (parameters, gradients, optimizer states, activations, optimizer
  temporaries, loss, buffers, overheads); the phase timeline (forward, backward and optimizer
  peaks per stage, step 1 and the steady state); the explanations; the assumptions with their
  sources.
- ``plan``: the candidates' peaks against capacity and the budget, what the search ruled out.
- ``diagnose``: the failing phase, the findings, the fixes' peaks against capacity.
- ``profile``: predicted beside measured per step and phase, the measured peaks by category.

Nothing is fetched: no URL, no font, no stylesheet or script file; a Content-Security-Policy
forbids the page any request (a browser refuses one and the page lists it under its title).
The command's text report is kept in the page as well, readable without the script.
The file is written whole or not at all (``memplan.outputs.write_atomic``) and its path is
checked before the command does any work (``check_path``). Standard library only.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.outputs import check_out_file, write_atomic

SUFFIXES = (".html", ".htm")
_SCRIPT = Path(__file__).with_name("html_page.js")
# no request of any kind: only the page's own inline style and script run
_CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
        "img-src data:; base-uri 'none'; form-action 'none'")
_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d232a;
background:#fafafa}
header{background:#1f3a5f;color:#fff;padding:14px 28px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;opacity:.8;font-size:12px}
main,#fallback{max-width:1180px;margin:0 auto;padding:0 28px}
section{background:#fff;border:1px solid #e3e6ea;border-radius:6px;margin:18px 0;padding:12px 18px}
h2{font-size:17px;margin:4px 0 8px}h2.part{max-width:1180px;margin:26px auto 0;font-size:19px}
h3{font-size:14px;margin:14px 0 6px}.intro{color:#4a5560;margin:4px 0 10px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #e3e6ea;border-radius:5px;padding:6px 10px;min-width:150px;
background:#fcfcfd}
.card .label{font-size:11px;color:#66707a;text-transform:uppercase;letter-spacing:.03em}
.card .val{font-size:15px}.card.good{border-color:#55a868}.card.bad{border-color:#c44e52}
.card.good .val{color:#2d7a3e}.card.bad .val{color:#a8262b}
table{border-collapse:collapse;margin:8px 0;font-size:12.5px}
th,td{border-bottom:1px solid #eceef1;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f5f7;font-weight:600}td .bytes{white-space:nowrap}
svg.chart{max-width:100%;height:auto;display:block;margin:6px 0}
svg text{font-size:11px;fill:#1d232a}svg .axis{fill:#4a5560}svg .barlabel{font-weight:600}
svg .over{fill:#a8262b}svg .capacity{stroke:#000;stroke-dasharray:6 4;stroke-width:1.4}
svg .budget{stroke:#a8262b;stroke-dasharray:2 3;stroke-width:1.2}
svg .grid{stroke:#eceef1}svg .axisline{stroke:#9aa3ad}svg .band{fill:#f3f5f7}
.legend{display:flex;flex-wrap:wrap;gap:12px;font-size:12px;margin:4px 0 8px}
.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}
dl.kv{display:grid;grid-template-columns:max-content auto;gap:2px 14px;margin:4px 0}
dl.kv dt{color:#66707a}dl.kv dd{margin:0}ul{margin:4px 0;padding-left:20px}
li.cause{color:#a8262b}.change{color:#2d5f8a}.warnings li{color:#8a5a00}
#errors{background:#fde8e8;color:#a8262b;border:1px solid #c44e52;white-space:pre-wrap;
padding:8px 28px;margin:0}
#fallback{margin-bottom:30px}#fallback pre{font-size:12px;overflow-x:auto;background:#fff;
border:1px solid #e3e6ea;padding:10px}
"""


def check_path(path: Path, what: str = "--html") -> Path:
    """``path`` as the page to write, checked before any work: a .html (or .htm) name, not a
    folder, in a folder that exists or can be made and that this user can write, a name the
    file system takes."""
    return check_out_file(path, what, SUFFIXES, ".html")


def _json_block(data: dict[str, Any]) -> str:
    """``data`` as JSON that cannot end its script element: ``<``, ``>`` and ``&`` escaped
    as ``\\u003c``... (the same object to any JSON reader)."""
    text = json.dumps(data, indent=1, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _title(data: dict[str, Any]) -> str:
    command = data.get("command", "")
    est = data.get("estimate", data)
    model = est.get("model") if isinstance(est, dict) else None
    where = (f" on {est['num_gpus']} x {est['gpu']}" if isinstance(est, dict)
             and "num_gpus" in est and "gpu" in est else "")
    return f"memplan {command}" + (f": {model}{where}" if model else "")


def page(data: dict[str, Any], text: str = "") -> str:
    """The HTML page of a command's JSON object ``data`` (with ``schema_version`` and
    ``command``), ``text`` (the command's text report) kept in it as a fallback."""
    from memplan import __version__

    title = html.escape(_title(data))
    fallback = html.escape(text.rstrip("\n") or json.dumps(data, indent=1))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_CSP}\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{title}</title>\n<style>{_STYLE}</style>\n</head>\n"
        f"<body data-command=\"{html.escape(str(data.get('command', '')))}\">\n"
        f"<header><h1>{title}</h1><p>memplan {html.escape(__version__)}, JSON schema_version "
        f"{html.escape(str(data.get('schema_version')))}: every number below is drawn from the "
        "JSON carried in this page (the command's --json output)</p></header>\n"
        "<pre id=\"errors\" hidden></pre>\n<main id=\"report\"></main>\n"
        "<svg id=\"svg-namespace\" width=\"0\" height=\"0\" aria-hidden=\"true\"></svg>\n"
        "<details id=\"fallback\" open><summary>The text report</summary>"
        f"<pre>{fallback}</pre></details>\n"
        f"<script type=\"application/json\" id=\"memplan-data\">\n{_json_block(data)}\n"
        "</script>\n"
        f"<script>\n{_SCRIPT.read_text(encoding='utf-8')}</script>\n</body>\n</html>\n")


def write_html(path: Path, data: dict[str, Any], text: str = "") -> Path:
    """Write the page of ``data`` (``page``) to ``path``, whole or not at all."""
    return write_atomic(check_path(path), page(data, text))


def embedded_json(document: str) -> dict[str, Any]:
    """The JSON object a page written by ``page`` carries."""
    start = document.index('<script type="application/json" id="memplan-data">')
    body = document[document.index(">", start) + 1:document.index("</script>", start)]
    return json.loads(body)


__all__ = ["SUFFIXES", "check_path", "embedded_json", "page", "write_html"]
