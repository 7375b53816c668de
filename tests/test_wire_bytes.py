"""benchmarks/wire_bytes.py: the daemons' TCP counters, read from `ss`, summed over the sockets they own."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

import pytest  # noqa: E402

from benchmarks.wire_bytes import WireBytes, main, parse_ss, tcp_bytes  # noqa: E402

SS_OUTPUT = """\
0 0 127.0.0.1:41234 127.0.0.1:38765 users:(("p2pd",pid=1234,fd=12)) cubic wscale:7,7 rto:204 mss:32768 \
bytes_sent:1200 bytes_acked:1201 bytes_received:3400 segs_out:10 segs_in:9
0 0 127.0.0.1:38765 127.0.0.1:41234 users:(("p2pd",pid=999,fd=7)) cubic bytes_sent:3399 bytes_acked:3400 \
bytes_received:1200
0 0 127.0.0.1:5000 127.0.0.1:6000 users:(("p2pd",pid=1234,fd=13),("p2pd",pid=77,fd=3)) cubic bytes_acked:5 \
bytes_received:6
0 0 127.0.0.1:5001 127.0.0.1:6001 users:(("p2pd",pid=1234,fd=14)) cubic rto:204
0 0 127.0.0.1:22 127.0.0.1:50000 users:(("sshd",pid=12345,fd=3)) cubic bytes_acked:100000 bytes_received:7
"""


def test_only_the_sockets_of_the_given_daemons_count_and_acked_bytes_are_what_was_sent():
    assert parse_ss(SS_OUTPUT, {1234}) == WireBytes(1201 + 5, 3400 + 6)  # a socket with no counters adds nothing
    assert parse_ss(SS_OUTPUT, {999, 1234}) == WireBytes(1201 + 3400 + 5, 3400 + 1200 + 6)
    assert parse_ss(SS_OUTPUT, {4321}) == WireBytes(0, 0)  # pid=12345 is not pid=1234 or 123
    assert parse_ss(SS_OUTPUT, {123}) == WireBytes(0, 0)
    assert WireBytes(10, 20) - WireBytes(4, 5) == WireBytes(6, 15)


def test_no_daemon_reads_as_unknown_not_zero():
    assert tcp_bytes(set()) is None


@pytest.mark.slow
def test_the_script_prints_a_row_per_daemon_and_refuses_bad_pids_in_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["--pids", "999999"]) == 0  # no such process: no socket of its own, nothing counted
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["pid", "sent", "MB", "received", "MB"] and out[1].split() in (
        ["999999", "0.000", "0.000"], ["999999", "–", "–"])  # "–" where ss is not installed
    with pytest.raises(SystemExit) as exited:
        main(["--pids", "12,x"])
    assert exited.value.code == 2 and "--pids must be comma-separated numbers" in capsys.readouterr().err
