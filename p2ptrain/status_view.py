"""What `p2ptrain status` shows, and its fast path. A run's status document (`status.status_document`: every live
peer's record) is printed as a table or as JSON, once or every few seconds, whichever source it comes from: a DHT
client of our own (status.py), or a status page's `/status.json` (`status --serve`, a bootstrap's `--status-port`).

Reading a page needs no DHT node, so this module imports neither hivemind nor torch: it answers in a fraction of a
second, where a DHT client spends seconds importing and starting before its first read. A page may be anyone's, so
its answer is bounded in size and checked in shape, and its strings are shown as plain printable text.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

import click

from p2ptrain.errors import UserError

# a page's /status.json, history included: at most 256 curves of 720 points (status_page.py), about 6 MB as JSON
MAX_PAGE_BYTES = 16 * 2**20
PAGE_TIMEOUT_S = 10.0
STATUS_JSON = "/status.json"


def reach_of(peer: Mapping[str, Any]) -> str:
    """How others reach a peer, as its record says (net/reachability.py): direct, relay (and which: the relay's
    peer id's last 6 characters), outbound (nobody can), ? (not tested yet); "+relay" if it serves as one."""
    via = _text(peer.get("relay_via"), 64)[-6:]
    reach = {"direct": "direct", "outbound": "outbound", "relay": f"relay:{via}"}.get(_text(peer.get("reach"), 16),
                                                                                     "?")
    return reach + ("+relay" if peer.get("relay") is True else "")


def format_status_table(document: Mapping[str, Any]) -> str:
    """One line per peer of a status document; `reach`: how others reach it (`reach_of`); `bans`: how many peers
    it bans now (its reputation record of offences); `tokens`: the tokens it claims to have trained, `verified`:
    those its partners verified by its outer gradients (status.verified_tokens; "-": nobody vouched); `seen`:
    seconds since its last heartbeat, as of the read."""
    header = (f"{'peer':<54} {'round':>5} {'phase':<7} {'loss':>7} {'val':>7} {'tok/s':>8} {'tokens':>7} "
              f"{'verified':>8} {'reach':<19} {'bans':>5} {'seen':>6}")
    lines = [header, "-" * len(header)]
    peers = [p for p in document.get("peers", []) if isinstance(p, Mapping)]
    for p in peers:
        lines.append(f"{_text(p.get('peer_id'), 54):<54} {_shown(p.get('round'), '{:.0f}'):>5} "
                     f"{_text(p.get('phase'), 7):<7} {_shown(p.get('train_loss'), '{:.3f}'):>7} "
                     f"{_shown(p.get('val_loss'), '{:.3f}'):>7} {_shown(p.get('tokens_per_s'), '{:.0f}'):>8} "
                     f"{_count(p.get('tokens')):>7} {_count(p.get('verified_tokens')):>8} "
                     f"{reach_of(p):<19} {_shown(p.get('banned'), '{:.0f}'):>5} "
                     f"{_shown(p.get('seen_s'), '{:.1f}s'):>6}")
    lines.append(f"{len(peers)} live peer(s)")
    return "\n".join(lines)


def _text(value: object, width: int) -> str:
    """A stranger's string as one line of printable text, cut to `width`; "" for anything else."""
    return "".join(c for c in value[:width] if c.isprintable()) if isinstance(value, str) else ""


def _count(value: object) -> str:
    """A count of tokens in at most 7 characters: 950, 12.35k, 4.568M, 1.2G, 3.4e+12; "-" for a non-number."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.4g}{unit}" if value < 999.95 * scale else f"{value:.1e}"
    return f"{value:.0f}"


def _shown(value: object, form: str) -> str:
    """A number in `form`, or "-" for a missing or non-finite one (or a non-number: a page is anyone's)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return form.format(value)
    return "-"


def show_status(read: Callable[[], dict[str, Any]], as_json: bool, every_s: float | None, count: int | None,
                stop: threading.Event) -> dict[str, Any]:
    """Print `read()`'s status document (a table, or one JSON document a line): once, or every `every_s` seconds
    until `count` refreshes or `stop`. Returns the last document."""
    refreshes = 0
    while True:
        started = time.monotonic()
        document = read()
        if as_json:
            click.echo(json.dumps(document))
        else:
            stamp = f" at {time.strftime('%H:%M:%S')}" if every_s else ""
            signed = " (signed)" if document.get("signed") is True else ""
            click.echo(f"run {_text(document.get('run_id'), 64)!r}{signed}{stamp}:")
            click.echo(format_status_table(document))
        refreshes += 1
        if every_s is None or (count is not None and refreshes >= count) or \
                stop.wait(max(0.0, every_s - (time.monotonic() - started))):
            return document


def page_address(url: str) -> str:
    """The /status.json address of a status page given as its printed URL (or as that address itself)."""
    if not url.startswith(("http://", "https://")):
        raise UserError(f"--page takes the status page's http:// address (as `status --serve` or the bootstrap "
                        f"printed it), got {url!r}")
    base = url.split("?", 1)[0].split("#", 1)[0]
    return base if base.endswith(STATUS_JSON) else base.rstrip("/") + STATUS_JSON


def read_page(url: str, timeout_s: float = PAGE_TIMEOUT_S) -> dict[str, Any]:
    """The status document a page serves (its loss history left out): a one-line UserError when the page cannot
    be read or does not answer a status document."""
    address = page_address(url)
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as answer:  # noqa: S310 (the scheme is checked)
            body = answer.read(MAX_PAGE_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise UserError(f"the status page {address} answered HTTP {e.code}: is it a p2ptrain status page?") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise UserError(f"cannot read the status page {address}: {reason}") from None
    if len(body) > MAX_PAGE_BYTES:
        raise UserError(f"the status page {address} answered more than {MAX_PAGE_BYTES >> 20} MiB: not a status page")
    try:
        document = json.loads(body)
    except ValueError:
        raise UserError(f"the status page {address} answered something that is not JSON: is it a p2ptrain status "
                        f"page?") from None
    if not isinstance(document, dict) or not isinstance(document.get("run_id"), str) or \
            not isinstance(document.get("peers"), list):
        raise UserError(f"the status page {address} answered JSON that is not a run's status")
    document.pop("history", None)
    document["peers"] = [p for p in document["peers"] if isinstance(p, dict)]
    return document
