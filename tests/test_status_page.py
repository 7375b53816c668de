"""The run's web page (`p2ptrain status --serve`), in a real browser: headless Chromium (Debian's) loads it against a
live loopback swarm; the rendered DOM must list every peer and draw their loss curves, and the screenshot must show
them. Records are strangers' words: a hostile peer id must come out as text, never as markup."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from early_jobs import BROWSER
from swarm_utils import PeerThread, start_peer, tiny_config, wait_until

from p2ptrain.config import PeerConfig
from p2ptrain.net.discovery import PeerRecord
from p2ptrain.status_page import PAGE_JS, PageServer, StatusHistory, StatusPage


@pytest.fixture
def chromium() -> str:
    """Debian's Chromium: installed by an early job (root) if this machine has none."""
    if os.geteuid() != 0 and shutil.which("chromium") is None:
        pytest.skip("needs root to install Chromium (apt-get), or chromium on the PATH")
    done = BROWSER.outcome("install")
    path = shutil.which("chromium")
    assert done.returncode == 0 and path, f"installing Chromium failed: {done.stderr[-2000:]}"
    return path


def browse(chromium: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Chromium, headless, given 6 s of the page's own time to fetch and draw (its script refreshes every 2 s)."""
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--virtual-time-budget=6000", *args, url], capture_output=True, text=True, timeout=120)


@pytest.fixture
def swarm() -> Iterator[tuple[PeerConfig, list[PeerThread]]]:
    config = tiny_config(f"page-{uuid.uuid4().hex[:6]}", sync={"mode": "gasloc"})
    threads = [PeerThread(start_peer(config)).start()]
    threads += [PeerThread(start_peer(config, threads[0].peer.maddrs)).start() for _ in range(2)]
    try:
        yield config, threads
    finally:
        for thread in threads:
            thread.peer.stop()
        for thread in threads:
            thread.join(timeout_s=120)
            thread.peer.shutdown()


@pytest.mark.network
def test_the_page_shows_every_live_peer_and_their_loss_curves_in_a_browser(
        chromium: str, swarm: tuple[PeerConfig, list[PeerThread]], tmp_path: Path) -> None:
    config, threads = swarm
    page = StatusPage(config, threads[0].peer.maddrs, every_s=0.5)
    try:
        ids = {thread.peer.peer_id for thread in threads}
        wait_until(lambda: ids <= set(page.document()["history"]["peers"]) and
                   len(page.document()["history"]["swarm"]) >= 4, 120, "every peer's validation loss, 4 readings")
        with urllib.request.urlopen(page.url + "status.json", timeout=10) as answer:
            assert {p["peer_id"] for p in json.load(answer)["peers"]} == ids
        listed = subprocess.run([sys.executable, "-m", "p2ptrain", "status", "--page", page.url, "--json"],
                                capture_output=True, text=True, timeout=60)  # the CLI's path that starts no DHT node
        assert listed.returncode == 0, listed.stderr[-2000:]
        assert {p["peer_id"] for p in json.loads(listed.stdout)["peers"]} == ids
        dom = browse(chromium, page.url, "--dump-dom")
        shot = browse(chromium, page.url, "--window-size=1100,900", f"--screenshot={tmp_path / 'page.png'}")
    finally:
        page.stop()
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert f"Run {config.run.run_id}" in html and "3 live peer(s)" in html, html[:3000]
    for peer_id in ids:  # a row and a curve each
        assert f'<tr class="peer" data-peer="{peer_id}">' in html, html[:3000]
        assert f'data-peer="{peer_id}"' in html.split('<svg id="chart"', 1)[1]
    assert html.count('class="peer-curve"') == 3 and 'id="swarm-curve"' in html
    assert shot.returncode == 0 and (tmp_path / "page.png").exists(), shot.stderr[-2000:]
    pixels = matplotlib.image.imread(tmp_path / "page.png")[..., :3]
    colours = {tuple(c) for c in np.round(pixels.reshape(-1, 3) * 15).astype(int).tolist()}
    dark = (pixels.sum(axis=-1) < 0.3).sum()  # the text and the swarm's thick black curve
    assert pixels.shape[:2] == (900, 1100) and len(colours) >= 12 and dark > 2000, (len(colours), dark)


def test_a_hostile_record_is_shown_as_text_and_the_history_stays_bounded() -> None:
    history = StatusHistory(max_peers=3, max_points=5)
    hostile = "<img src=x onerror=alert(1)>"

    def records(count: int, second: int) -> list[PeerRecord]:
        return [PeerRecord(peer_id=f"{hostile}{i}", round=1, inner_step=0, phase="inner", round_eta=0.0,
                           val_loss=float(i + second)) for i in range(count)]

    for second in range(10):  # 3 peers a while: each curve keeps its last 5 points
        history.add(records(3, second), float(second))
    document = history.document()
    assert [len(curve) for curve in document["peers"].values()] == [5, 5, 5]
    assert document["swarm"] == [(float(s), float(s + 1)) for s in range(5, 10)]
    for second in range(10, 20):  # 50 identities a reading: still 3 curves of at most 5 points
        history.add(records(50, second), float(second))
    assert len(history.peers) == 3 and all(len(curve) <= 5 for curve in history.peers.values())
    assert "innerHTML" not in PAGE_JS and "textContent" in PAGE_JS  # records are written as text only


@pytest.mark.network
def test_the_page_server_bounds_connections_per_client_and_closes_idle_ones() -> None:
    class Quick(http.server.BaseHTTPRequestHandler):
        timeout = 1.0  # IDLE_S, shortened

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *_args: object) -> None:
            pass

    server = PageServer(("127.0.0.1", 0), Quick, max_connections=8, per_client=2)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    address = ("127.0.0.1", server.server_address[1])
    try:
        idle = [socket.create_connection(address, timeout=30) for _ in range(2)]  # they send nothing
        wait_until(lambda: server.open["127.0.0.1"] == 2, 30, "both idle connections taken in")
        with socket.create_connection(address, timeout=30) as third:  # closed unanswered, its request unread
            try:
                third.sendall(b"GET / HTTP/1.0\r\n\r\n")
                answered = third.recv(16)
            except ConnectionResetError:
                answered = b""
            assert answered == b"", f"a third connection from one client was served: {answered!r}"
        for connection in idle:  # closed by the server once idle for the handler's timeout
            assert connection.recv(1) == b""
            connection.close()
        wait_until(lambda: not server.open, 30, "the idle connections' slots freed")
        with urllib.request.urlopen(f"http://127.0.0.1:{address[1]}/", timeout=30) as answer:
            assert answer.read() == b"ok"
    finally:
        server.shutdown()
        server.server_close()
