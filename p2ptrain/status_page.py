"""`p2ptrain status --serve PORT`: the run's live peers on a web page that updates itself, for whoever watches a run.

A client DHT node reads the run's records every few seconds (as `status --watch` does) and keeps a bounded history
of every peer's validation loss and the swarm's median; a small HTTP server on this machine serves the page, its
script and `/status.json`. Everything is served from here (no CDN: the page works offline). Records are strangers'
words, so the page writes them as text (never as HTML), the history holds at most MAX_PEERS peers of MAX_POINTS
points each, and the server answers GET requests for three paths only.
"""

from __future__ import annotations

import collections
import dataclasses
import http.server
import json
import logging
import statistics
import threading
from collections.abc import Sequence
from typing import Any

from hivemind.utils import get_dht_time

from p2ptrain.config import PeerConfig
from p2ptrain.errors import UserError
from p2ptrain.net.dht import is_loopback
from p2ptrain.net.discovery import PeerRecord
from p2ptrain.status import RunReader

logger = logging.getLogger(__name__)

MAX_PEERS = 256  # peers whose curves are kept (identities are cheap: the one seen least recently goes first)
MAX_POINTS = 720  # points a curve keeps: an hour at the default 5 s
# the HTTP server's bounds (PageServer): connections at once, from one address, and the seconds one may sit idle
MAX_CONNECTIONS = 64
CONNECTIONS_PER_CLIENT = 8
IDLE_S = 10.0


class StatusHistory:
    """Validation losses over time, per peer and the swarm's median, bounded in peers and points."""

    def __init__(self, max_peers: int = MAX_PEERS, max_points: int = MAX_POINTS):
        self.max_peers, self.max_points = max_peers, max_points
        self.peers: collections.OrderedDict[str, collections.deque[tuple[float, float]]] = collections.OrderedDict()
        self.swarm: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_points)

    def add(self, records: Sequence[PeerRecord], now: float) -> None:
        losses = []
        for record in records:
            if record.val_loss is None:
                continue
            losses.append(record.val_loss)
            curve = self.peers.pop(record.peer_id, None) or collections.deque(maxlen=self.max_points)
            curve.append((now, record.val_loss))
            self.peers[record.peer_id] = curve  # the most recently seen last
            while len(self.peers) > self.max_peers:
                self.peers.popitem(last=False)
        if losses:
            self.swarm.append((now, statistics.median(losses)))

    def document(self) -> dict[str, Any]:
        return {"swarm": list(self.swarm), "peers": {peer: list(curve) for peer, curve in self.peers.items()}}


class StatusPage:
    """Reads the run every `every_s` seconds in a thread and serves the page at `url` until `stop()`."""

    def __init__(self, config: PeerConfig, initial_peers: Sequence[str], host: str = "127.0.0.1", port: int = 0,
                 every_s: float = 5.0):
        self.every_s = every_s
        self.history = StatusHistory()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        try:
            self.server = PageServer((host, port), _handler(self))
        except OSError as e:
            raise UserError(f"cannot serve the status page on {host}:{port}: {e.strerror or e}") from None
        self.url = f"http://{host}:{self.server.server_address[1]}/"
        try:
            self.reader = RunReader(config, initial_peers)
        except BaseException:
            self.server.server_close()
            raise
        self.latest: dict[str, Any] = self.reader.document([], get_dht_time())
        self.threads = [threading.Thread(target=self._read_run, name="status-reader", daemon=True),
                        threading.Thread(target=self.server.serve_forever, name="status-server", daemon=True)]
        for thread in self.threads:
            thread.start()

    @classmethod
    def beside(cls, config: PeerConfig, maddrs: Sequence[str], host: str, port: int) -> StatusPage:
        """The page of a node on this machine (the bootstrap's `--status-port`), read by a client node of its own:
        a throwaway identity and a free port (not the node's), no probing, the node's admission rules."""
        listen = "/ip4/127.0.0.1/tcp/0" if all(is_loopback(m) for m in maddrs) else "/ip4/0.0.0.0/tcp/0"
        network = dataclasses.replace(config.network, host_maddrs=(listen,), announce_maddrs=(), identity_path="",
                                      client_mode=True, nat_port_map=False, auto_nat=False, relay=False,
                                      check_reachability=False, admission_ticket="")
        return cls(dataclasses.replace(config, network=network), maddrs, host, port)

    def _read_run(self) -> None:
        while not self.stopped.is_set():
            try:
                records, now = self.reader.read()
            except Exception as e:  # a DHT hiccup: the page keeps the last read and says when it was
                logger.warning(f"status page: reading the run failed ({e!r}); trying again")
            else:
                with self.lock:
                    self.history.add(records, now)
                    self.latest = self.reader.document(records, now)
            self.stopped.wait(self.every_s)

    def document(self) -> dict[str, Any]:
        """What `/status.json` answers: the latest read and the loss history."""
        with self.lock:
            return {**self.latest, "history": self.history.document()}

    def stop(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()
        for thread in self.threads:
            thread.join(timeout=30)
        self.reader.close()


class PageServer(http.server.ThreadingHTTPServer):
    """The page's HTTP server, bounded for strangers: at most `max_connections` at once and `per_client` from one
    address (beyond, a connection is closed at once), each closed by its handler after IDLE_S without a request.
    Unbounded, a client that opened connections and sent nothing held a thread each, for ever."""

    def __init__(self, address: tuple[str, int], handler: type[http.server.BaseHTTPRequestHandler],
                 max_connections: int = MAX_CONNECTIONS, per_client: int = CONNECTIONS_PER_CLIENT):
        super().__init__(address, handler)
        self.max_connections, self.per_client = max_connections, per_client
        self.open: collections.Counter[str] = collections.Counter()  # connections being served, by client address
        self.open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0])
        with self.open_lock:
            admitted = self.open.total() < self.max_connections and self.open[client] < self.per_client
            if admitted:
                self.open[client] += 1
        if admitted:
            super().process_request(request, client_address)
        else:
            self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.open_lock:
                self.open[str(client_address[0])] -= 1
                self.open += collections.Counter()  # drops the clients left with none


def _handler(page: StatusPage) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = IDLE_S  # a connection that sends no request within this is closed (PageServer's bound)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/status.json":
                self._send(json.dumps(page.document()).encode(), "application/json")
            elif path == "/":
                self._send(PAGE_HTML.encode(), "text/html; charset=utf-8")
            elif path == "/page.js":
                self._send(PAGE_JS.encode(), "text/javascript; charset=utf-8")
            else:
                self.send_error(404)

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            # only what this server sends runs or loads: a record's text can never become script
            self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            logger.debug("status page: " + format, *args)

    return Handler


PAGE_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>p2ptrain run</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; font-family: monospace; }
#chart { border: 1px solid #ccc; }
.muted { color: #777; }
</style></head>
<body>
<h1 id="title">p2ptrain run</h1>
<p id="summary" class="muted">reading the run…</p>
<table id="peers"><thead><tr><th>peer</th><th>round</th><th>phase</th><th>train loss</th><th>val loss</th>
<th>tokens/s</th><th>tokens</th><th>verified</th><th>link Mbit/s</th><th>MB sent</th><th>MB received</th><th>reach</th>
<th>bans</th><th>seen</th></tr></thead><tbody></tbody></table>
<p class="muted">bytes: each peer's latest round, measured on its streams; tokens: what it claims to have trained,
verified: what its partners verified of that by its outer gradients (- where none did)</p>
<h2>Validation loss over time</h2>
<p class="muted">each peer a thin line, the swarm's median thick</p>
<svg id="chart" width="900" height="360" xmlns="http://www.w3.org/2000/svg"></svg>
<script src="/page.js"></script>
</body></html>
"""

PAGE_JS = r"""
"use strict";
const SVG = "http://www.w3.org/2000/svg";
function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function fixed(x, digits) { return typeof x === "number" ? x.toFixed(digits) : "-"; }
function reach(p) {
  const r = {direct: "direct", outbound: "outbound", relay: "relay:" + String(p.relay_via).slice(-6)}[p.reach] || "?";
  return r + (p.relay ? "+relay" : "");
}
function table(doc) {
  const body = document.querySelector("#peers tbody");
  body.replaceChildren();
  for (const p of doc.peers) {
    const row = document.createElement("tr");
    row.className = "peer";
    row.dataset.peer = p.peer_id;
    const cells = [p.peer_id, p.round, p.phase, fixed(p.train_loss, 3), fixed(p.val_loss, 3),
                   fixed(p.tokens_per_s, 0), fixed(p.tokens, 0), fixed(p.verified_tokens, 0),
                   p.bandwidth_bps ? fixed(p.bandwidth_bps / 1e6, 1) : "?",
                   fixed(p.bytes_sent / 1e6, 3), fixed(p.bytes_received / 1e6, 3), reach(p), p.banned,
                   fixed(p.seen_s, 1) + " s"];
    for (const value of cells) {
      const cell = document.createElement("td");
      cell.textContent = String(value);
      row.appendChild(cell);
    }
    body.appendChild(row);
  }
}
function chart(history) {
  const svg = document.getElementById("chart");
  svg.replaceChildren();
  const W = 900, H = 360, L = 60, R = 20, T = 20, B = 40;
  const curves = Object.entries(history.peers);
  const points = curves.flatMap(([, c]) => c).concat(history.swarm);
  if (points.length === 0) { svg.appendChild(el("text", {x: L, y: H / 2}, "no validation loss yet")); return; }
  const t0 = Math.min(...points.map(p => p[0])), t1 = Math.max(...points.map(p => p[0]), t0 + 1);
  const y0 = Math.min(...points.map(p => p[1])), y1 = Math.max(...points.map(p => p[1]), y0 + 1e-3);
  const x = t => L + (t - t0) / (t1 - t0) * (W - L - R), y = v => T + (y1 - v) / (y1 - y0) * (H - T - B);
  svg.appendChild(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#444"}));
  svg.appendChild(el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#444"}));
  for (let i = 0; i <= 4; i++) {
    const v = y0 + (y1 - y0) * i / 4, s = (t1 - t0) * i / 4;
    svg.appendChild(el("text", {x: L - 6, y: y(v) + 4, "text-anchor": "end", "font-size": 11}, v.toFixed(3)));
    svg.appendChild(el("text", {x: x(t0 + s), y: H - B + 16, "text-anchor": "middle", "font-size": 11},
                       s.toFixed(t1 - t0 < 40 ? 1 : 0) + " s"));
  }
  svg.appendChild(el("text", {x: (W + L) / 2, y: H - 4, "text-anchor": "middle", "font-size": 12},
                     "seconds since the first reading"));
  curves.forEach(([peer, curve], i) => {
    const color = "hsl(" + Math.round(360 * i / Math.max(1, curves.length)) + ",70%,45%)";
    const line = el("polyline", {points: curve.map(p => x(p[0]) + "," + y(p[1])).join(" "), fill: "none",
                                 stroke: color, "stroke-width": 1.5, class: "peer-curve"});
    line.appendChild(el("title", {}, peer));
    line.dataset.peer = peer;
    svg.appendChild(line);
    if (i < 12) {  // a legend for the first dozen; every line names its peer on hover
      svg.appendChild(el("rect", {x: W - R - 130, y: T + 4 + 14 * i, width: 10, height: 10, fill: color}));
      svg.appendChild(el("text", {x: W - R - 115, y: T + 13 + 14 * i, "font-size": 11}, "…" + peer.slice(-10)));
    }
  });
  svg.appendChild(el("polyline", {points: history.swarm.map(p => x(p[0]) + "," + y(p[1])).join(" "), fill: "none",
                                  stroke: "#000", "stroke-width": 3, id: "swarm-curve"}));
}
async function refresh() {
  try {
    const doc = await (await fetch("/status.json", {cache: "no-store"})).json();
    document.getElementById("title").textContent = "Run " + doc.run_id + (doc.signed ? " (signed)" : "");
    document.getElementById("summary").textContent = doc.live_peers + " live peer(s), read at " +
      new Date(doc.time * 1000).toLocaleTimeString();
    table(doc);
    chart(doc.history);
  } catch (error) {
    document.getElementById("summary").textContent = "cannot read the status: " + error;
  }
}
refresh();
setInterval(refresh, 2000);
"""
