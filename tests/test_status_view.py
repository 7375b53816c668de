"""`status`'s table and its page path (`status --page URL`): a page is anyone's, so what it answers is shown as text
and anything that is not a run's status document is one line of error."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from p2ptrain.errors import UserError
from p2ptrain.status_view import MAX_PAGE_BYTES, format_status_table, page_address, read_page

GOOD = {"run_id": "myrun", "signed": False, "time": 1.0, "live_peers": 1,
        "peers": [{"peer_id": "12D3KooA", "round": 3, "phase": "inner", "train_loss": 2.5, "val_loss": None,
                   "tokens_per_s": 1234.4, "reach": "direct", "relay": True, "banned": 0, "seen_s": 0.25}, "junk"],
        "history": {"swarm": [[1.0, 2.5]], "peers": {}}}


def test_a_hostile_page_is_shown_as_plain_text_with_dashes_for_non_numbers() -> None:
    peers = [{"peer_id": "evil\x1b[2J\nnext", "round": "three", "phase": ["x"], "train_loss": True,
              "val_loss": float("inf"), "tokens_per_s": -1, "reach": "relay", "relay_via": 7, "seen_s": "soon"},
             {"peer_id": "12D3KooB" * 20, "round": 2, "phase": "sync", "train_loss": 3.0}]
    lines = format_status_table({"run_id": "r", "peers": [*peers, 5]}).splitlines()
    assert len(lines) == 5 and lines[-1] == "2 live peer(s)"  # header, rule, two peers (5 is no peer), count
    row = lines[2]
    assert "\x1b" not in row and row.startswith("evil[2Jnext ") and "relay:" in row
    assert row.split()[1:4] == ["-", "-", "-"]  # round, loss and val are no finite numbers; the phase, no text
    assert len(lines[3].split()[0]) == 54 and " 3.000 " in lines[3]  # a long id is cut to its column


def test_a_page_is_named_by_its_printed_url_or_its_json_address() -> None:
    assert page_address("http://127.0.0.1:8080/") == "http://127.0.0.1:8080/status.json"
    assert page_address("http://host:1/status.json?x=1") == "http://host:1/status.json"
    with pytest.raises(UserError, match="http:// address"):
        page_address("127.0.0.1:8080")


class Page(http.server.ThreadingHTTPServer):
    """A web server on loopback whose /status.json answers `body` (and `status`)."""

    def __init__(self) -> None:
        self.body, self.code = b"", 200
        page = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(page.code)
                self.send_header("Content-Length", str(len(page.body)))
                self.end_headers()
                self.wfile.write(page.body)

            def log_message(self, *_args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/"


@pytest.fixture
def page() -> Iterator[Page]:
    server = Page()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.network
def test_a_page_answer_that_is_no_status_document_is_one_line_of_error(page: Page) -> None:
    page.body = json.dumps(GOOD).encode()
    document = read_page(page.url)
    assert "history" not in document and [p["peer_id"] for p in document["peers"]] == ["12D3KooA"]
    for body, code, words in ((b"<html>", 200, "not JSON"), (b"[1, 2]", 200, "not a run's status"),
                              (b'{"run_id": 5, "peers": []}', 200, "not a run's status"),
                              (b"x" * (MAX_PAGE_BYTES + 1), 200, "more than 16 MiB"), (b"", 404, "HTTP 404")):
        page.body, page.code = body, code
        with pytest.raises(UserError, match=words) as refused:
            read_page(page.url)
        assert "\n" not in str(refused.value)
    page.body, page.code = json.dumps(GOOD).encode(), 200
    shown = subprocess.run([sys.executable, "-m", "p2ptrain", "status", "--page", page.url],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith("run 'myrun':") and "direct+relay" in shown.stdout and "1 live peer(s)" in \
        shown.stdout, shown.stdout
    assert "torch" not in subprocess.run(  # the page path's whole point: no hivemind, no torch to import first
        [sys.executable, "-c", "import sys, p2ptrain.cli, p2ptrain.status_view; print(sorted(sys.modules))"],
        capture_output=True, text=True, timeout=60).stdout


@pytest.mark.network
def test_an_unreachable_page_is_one_line_of_error_and_exit_2() -> None:
    with socket.socket() as unused:  # a loopback port that nothing listens on once this closes
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}/"
    result = subprocess.run([sys.executable, "-m", "p2ptrain", "status", "--page", url, "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: cannot read the status page {url}status.json: [Errno 111] Connection refused"], result.stderr
