"""Signed runs: the organiser's ticket admits one peer id to one run; records without a valid one are not seen.

Covers the files (`keygen`, `admit`, one-line errors for bad ones), the start-up check of a peer's own ticket,
the `Admission.allows` check that servers ask, and a real swarm on loopback where only the ticketed peer is seen.
"""

from __future__ import annotations

import asyncio
import stat
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time
from test_cli_errors import UNREACHABLE_PEER, Outcome, assert_one_line_user_error
from test_limits import NS, Handler, serve, swarm, tensors
from test_records import stored_subkeys

from p2ptrain.cli import main
from p2ptrain.errors import UserError
from p2ptrain.net import exchange
from p2ptrain.net.admission import (
    Admission,
    AdmissionPolicy,
    Ticket,
    admit_peer,
    generate_organiser_key,
    load_organiser_key,
    load_signing_key,
    read_ticket,
    sign_ticket,
    write_ticket,
)
from p2ptrain.net.bootstrap import BootstrapNode
from p2ptrain.net.dht import NetworkConfig, SwarmDHT, start_dht, visible_maddrs
from p2ptrain.net.discovery import Announcer, PeerRecord, fetch_peers, parse_records
from p2ptrain.net.reputation import Reputation
from p2ptrain.net.state_sharing import (
    SnapshotExpectation,
    SnapshotRefused,
    StateServer,
    StateSnapshot,
    download_state,
    request_sketch,
)
from p2ptrain.net.wire import WireError

RUN, TTL_S = "signed-test", 8.0
PEER_A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER_B = "12D3KooWD7zMSytpc5uPkJPRcM54GhnyBLrL5YDa6L4AAJqde25w"
PEER_C = "QmTiRThMuMkByxxdRgNga71yNSUACBT2PrdTyH92oEe8V7"
LAYOUT = [("param:w", (5, 4), "torch.float32")]
EXPECTED = SnapshotExpectation(run_id=NS, fingerprint="fp", min_round=7, max_round=8)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Two organisers' key pairs: this run's and another's."""
    root = tmp_path_factory.mktemp("keys")
    key, pub = generate_organiser_key(root / "organiser.key")
    other_key, other_pub = generate_organiser_key(root / "other.key")
    return SimpleNamespace(root=root, key=key, pub=pub, other_key=other_key, other_pub=other_pub)


def signed_network(keys: SimpleNamespace, ticket: Path | str = "", **changes: Any) -> NetworkConfig:
    return NetworkConfig.loopback(admission="signed", organiser_key=str(keys.pub), admission_ticket=str(ticket),
                                  **changes)


# ---- files and the start-up check -------------------------------------------------------------------------------
def test_keygen_writes_a_private_key_only_its_owner_reads_and_a_public_key(keys: SimpleNamespace) -> None:
    assert stat.S_IMODE(keys.key.stat().st_mode) == 0o600
    assert keys.pub.read_text().startswith("ssh-rsa ")
    assert load_organiser_key(keys.pub) == load_organiser_key(keys.pub)
    with pytest.raises(UserError, match="already exists"):
        generate_organiser_key(keys.key)


def test_a_ticket_admits_its_peer_to_its_run_only(keys: SimpleNamespace, tmp_path: Path) -> None:
    admit_peer(keys.key, RUN, PEER_A, tmp_path / "a.ticket")
    admission = Admission.from_config(signed_network(keys, tmp_path / "a.ticket"), RUN, PEER_A)
    assert admission.signed and admission.ticket == read_ticket(tmp_path / "a.ticket").signature
    policy = admission.policy
    assert policy.ticket_problem(PEER_A, admission.ticket) is None
    assert policy.ticket_problem(PEER_B, admission.ticket) is not None  # another peer id
    assert AdmissionPolicy("another-run", policy.organiser_key).ticket_problem(PEER_A, admission.ticket) is not None
    assert policy.ticket_problem(PEER_A, "") == "no admission ticket"
    assert policy.ticket_problem(PEER_A, "not base64!") is not None
    assert AdmissionPolicy(RUN).ticket_problem(PEER_A, "") is None  # an open run asks for nothing


def test_a_peer_refuses_to_start_with_a_ticket_that_would_not_admit_it(keys: SimpleNamespace, tmp_path: Path) -> None:
    admit_peer(keys.key, RUN, PEER_A, tmp_path / "a.ticket")
    admit_peer(keys.key, "another-run", PEER_B, tmp_path / "other-run.ticket")
    write_ticket(tmp_path / "forged.ticket", Ticket(RUN, PEER_B, sign_ticket(load_signing_key(keys.other_key), RUN,
                                                                              PEER_B)))
    (tmp_path / "corrupt.ticket").write_text("{not json")
    cases = {
        "": "send your peer id",  # no ticket
        str(tmp_path / "absent.ticket"): "cannot read the admission ticket",
        str(tmp_path / "corrupt.ticket"): "is not an admission ticket",
        str(tmp_path / "a.ticket"): f"is for peer '{PEER_A}', not this peer",
        str(tmp_path / "other-run.ticket"): "is for run 'another-run'",
        str(tmp_path / "forged.ticket"): "was not signed by the organiser key",
    }
    for ticket, expected in cases.items():
        with pytest.raises(UserError) as caught:
            Admission.from_config(signed_network(keys, ticket), RUN, PEER_B)
        assert expected in str(caught.value) and "\n" not in str(caught.value), (ticket, str(caught.value))
    reader = Admission.from_config(signed_network(keys), RUN)  # bootstrap and status need no ticket
    assert reader.signed and reader.ticket == ""


def test_bad_organiser_key_files_are_one_line_errors(keys: SimpleNamespace, tmp_path: Path) -> None:
    (tmp_path / "garbage.pub").write_text("ssh-rsa not-base64\n")
    cases = {
        tmp_path / "absent.pub": "cannot read the organiser public key",
        tmp_path / "garbage.pub": "is not an organiser public key",
        keys.key: "is the organiser's private key",
    }
    for path, expected in cases.items():
        with pytest.raises(UserError, match=expected):
            Admission.from_config(NetworkConfig.loopback(admission="signed", organiser_key=str(path)), RUN)
    with pytest.raises(UserError, match="not an organiser private key"):
        load_signing_key(keys.pub)


def test_allows_is_true_in_an_open_run_and_in_a_signed_one_only_for_peers_read_with_a_valid_ticket(
        keys: SimpleNamespace) -> None:
    assert Admission.open(RUN).allows("anyone")
    reader = Admission.from_config(signed_network(keys), RUN)
    signing_key = load_signing_key(keys.key)
    now = get_dht_time()

    def entry(peer_id: str, ticket: str) -> SimpleNamespace:
        value = PeerRecord(peer_id=peer_id, round=0, inner_step=0, phase="inner", round_eta=0.0, updated=now,
                           ticket=ticket).dict()
        return SimpleNamespace(value=value, expiration_time=now + TTL_S)

    raw = SimpleNamespace(value={b"a": entry(PEER_A, sign_ticket(signing_key, RUN, PEER_A)),
                                 b"b": entry(PEER_B, sign_ticket(signing_key, RUN, PEER_A))})  # B shows A's ticket
    assert not reader.allows(PEER_A)
    assert [r.peer_id for r in parse_records(raw, TTL_S, now, reader)] == [PEER_A]
    assert reader.allows(PEER_A) and not reader.allows(PEER_B)

    assert reader.admits_(PEER_B, sign_ticket(signing_key, RUN, PEER_B)) and reader.allows(PEER_B)  # by a request's
    assert not reader.admits_(PEER_C, sign_ticket(signing_key, RUN, PEER_A)) and not reader.allows(PEER_C)
    assert not reader.admits_(PEER_C, None) and not reader.admits_(PEER_C, ["not", "a", "ticket"])


@pytest.mark.network
def test_a_peer_whose_record_was_not_read_yet_is_admitted_by_the_ticket_its_requests_carry(
        keys: SimpleNamespace) -> None:
    """A signed run's peer serves those whose ticketed records it read; a record reaches it a read or more after
    its peer asks (at scale a read covers a few shards), and a volunteer whose record its partner had not read was
    refused every exchange and its state, and trained alone (CI). Gossip offers, state downloads and sketch
    requests carry the asker's ticket: a valid one admits it, another peer's or none does not."""
    signing_key = load_signing_key(keys.key)

    async def scenario() -> None:
        async with swarm(3) as (responder, volunteer, intruder):
            admission = Admission(AdmissionPolicy(RUN, load_organiser_key(keys.pub)))
            handler = Handler()
            handler.reputation = Reputation(admits=admission.admits_)
            await serve(responder, handler)
            server = StateServer(lambda: snapshot, refuses=handler.reputation.refuses)
            await server.add_p2p_handlers(responder, namespace=NS)
            volunteer_id, intruder_id = volunteer.peer_id.to_base58(), intruder.peer_id.to_base58()
            ticket = sign_ticket(signing_key, RUN, volunteer_id)

            async def offer_from(p2p: P2P, ticket: str) -> str:
                try:
                    outcome = await exchange.push_pull(p2p, responder.peer_id, NS, {}, tensors(16),
                                                       lambda h, p: lambda: None, 2**22, deadline_s=20, ticket=ticket)
                except exchange.ExchangeRefused as e:
                    return str(e)
                return str(outcome.partner_header["status"])

            assert await offer_from(intruder, ticket) == "banned or not admitted"  # the volunteer's ticket
            with pytest.raises(WireError, match="refused a sketch"):
                await request_sketch(intruder, responder.peer_id, NS, 1, 10.0, ticket=ticket)
            with pytest.raises(SnapshotRefused, match="not served here"):
                await download_state(intruder, responder.peer_id, NS, LAYOUT, 2**20, 5.0, EXPECTED, ticket=ticket)
            assert await offer_from(volunteer, "") == "banned or not admitted"  # no record read, no ticket
            with pytest.raises(SnapshotRefused, match="not served here"):
                await download_state(volunteer, responder.peer_id, NS, LAYOUT, 2**20, 5.0, EXPECTED)
            assert handler.opened == [] and not admission.allows(volunteer_id)
            assert (await request_sketch(volunteer, responder.peer_id, NS, 1, 10.0, ticket=ticket)).round == 7
            assert admission.allows(volunteer_id) and not admission.allows(intruder_id)
            assert await offer_from(volunteer, "") == "ok"  # admitted now, as if its record had been read
            assert handler.opened == [volunteer_id] == handler.applied

    torch.manual_seed(3)
    snapshot = StateSnapshot.capture({"round": 7, "run_id": NS, "fingerprint": "fp"},
                                     [("param:w", torch.randn(5, 4))])
    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


# ---- the CLI ----------------------------------------------------------------------------------------------------
def run_main(args: list[str], monkeypatch: pytest.MonkeyPatch) -> Outcome:
    """`p2ptrain ARGS` through the real entry point (its one-line errors and exit codes), in this process."""
    monkeypatch.setattr(sys, "argv", ["p2ptrain", *args])
    with CliRunner().isolation() as streams:
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        return Outcome(code, streams[0].getvalue().decode(), streams[1].getvalue().decode())


def test_cli_keygen_and_admit_make_files_that_admit_the_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = run_main(["keygen", "--out", str(tmp_path / "org.key")], monkeypatch)
    assert made.returncode == 0, made.stderr
    assert str(tmp_path / "org.key.pub") in made.stdout
    admitted = run_main(["admit", PEER_A, "--key", str(tmp_path / "org.key"), "--out", str(tmp_path / "t"),
                         "--run-id", RUN], monkeypatch)
    assert admitted.returncode == 0, admitted.stderr
    network = NetworkConfig.loopback(admission="signed", organiser_key=str(tmp_path / "org.key.pub"),
                                     admission_ticket=str(tmp_path / "t"))
    assert Admission.from_config(network, RUN, PEER_A).ticket  # the start-up check passes


def test_cli_bad_files_and_flags_are_one_line_errors_with_exit_2(
        keys: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "junk.key").write_text("junk")
    status = ["status", "--initial-peers", UNREACHABLE_PEER, "--loopback", "--admission", "signed"]
    cases = {
        "keygen over an existing key": (["keygen", "--out", str(keys.key)], "already exists"),
        "admit with a missing key": (["admit", PEER_A, "--key", str(tmp_path / "absent.key"), "--out",
                                      str(tmp_path / "t")], "cannot read the organiser key"),
        "admit with a corrupt key": (["admit", PEER_A, "--key", str(tmp_path / "junk.key"), "--out",
                                      str(tmp_path / "t")], "is not an organiser private key"),
        "admit a malformed peer id": (["admit", "0OIl", "--key", str(keys.key), "--out", str(tmp_path / "t")],
                                      "is not a peer id"),
        "signed without a key": (status, "network.organiser_key"),
        "signed with a corrupt key": ([*status, "--organiser-key", str(tmp_path / "junk.key")],
                                      "is not an organiser public key"),
    }
    for name, (args, expected) in cases.items():
        outcome = run_main(args, monkeypatch)
        try:
            assert_one_line_user_error(outcome, expected)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    assert not (tmp_path / "t").exists()


# ---- a signed swarm on loopback ---------------------------------------------------------------------------------
@pytest.mark.network
@pytest.mark.slow
def test_only_the_peer_with_a_valid_ticket_is_seen_by_a_signed_run(keys: SimpleNamespace, tmp_path: Path) -> None:
    """Four peers announce: no ticket, another peer's ticket, a ticket from another organiser, a valid ticket.
    The first three run no checks of their own (an attacker's node); the signed run's bootstrap stores and shows
    only the last, and a reader that checks tickets sees only the last."""
    bootstrap = BootstrapNode(signed_network(keys), RUN)  # no ticket of its own
    reader = bootstrap.dht
    nodes: list[SwarmDHT] = []
    try:
        reader_admission = Admission.from_config(signed_network(keys), RUN)
        peers = [start_dht(NetworkConfig.loopback(), visible_maddrs(reader)) for _ in range(4)]
        nodes.extend(peers)
        no_ticket, borrowed, foreign, valid = peers
        admit_peer(keys.key, RUN, str(valid.peer_id), tmp_path / "valid.ticket")
        valid_admission = Admission.from_config(signed_network(keys, tmp_path / "valid.ticket"), RUN,
                                                str(valid.peer_id))
        tickets = {no_ticket: "", borrowed: valid_admission.ticket,
                   foreign: sign_ticket(load_signing_key(keys.other_key), RUN, str(foreign.peer_id))}
        announcers = {}
        for node in peers:
            record = PeerRecord(peer_id=str(node.peer_id), round=1, inner_step=0, phase="inner", round_eta=0.0,
                                ticket=tickets.get(node, ""))
            announcers[node] = Announcer(node, RUN, record, heartbeat_s=1.0, ttl_s=TTL_S,
                                         admission=valid_admission if node is valid else None)
        for node, announcer in announcers.items():
            stored = announcer.publish()  # hivemind answers with one replica's verdict: the reader refuses 3 of 4
            assert stored or node is not valid
        everyone = sorted(str(node.peer_id) for node in peers)
        assert [r.peer_id for r in fetch_peers(no_ticket, RUN, TTL_S)] == everyone  # all four were published
        seen = fetch_peers(reader, RUN, TTL_S, admission=reader_admission)
        assert [r.peer_id for r in seen] == [str(valid.peer_id)]
        assert seen[0].ticket == valid_admission.ticket
        assert [reader_admission.allows(p) for p in everyone] == [p == str(valid.peer_id) for p in everyone]
        assert stored_subkeys(reader, RUN) == [announcers[valid].subkey]
    finally:
        for node in nodes:
            node.shutdown()
        bootstrap.shutdown()
