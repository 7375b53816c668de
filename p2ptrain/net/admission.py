"""Who may take part in a run: anyone (`network.admission: open`), or peers holding a ticket (`signed`).

A ticket is the organiser's signature of (run id, peer id): `p2ptrain keygen` makes the organiser's RSA key pair,
`p2ptrain admit PEER_ID` signs one volunteer's peer id for one run. A peer of a signed run puts its ticket in its
DHT record (net/discovery.py); every node checks it with the organiser's public key, in its DHT validators and when
it reads the records, so a record without a valid ticket is neither stored nor seen. A peer id is the hash of the
peer's identity key and a record must be signed by that key, so a ticket cannot be lent to another identity.

`Admission` is the check the rest of the peer asks: `allows(peer_id)` is always true in an open run and, in a signed
run, true for the peers whose records with a valid ticket this node has read (and for itself).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import json
import os
import threading
from pathlib import Path

import multihash
from cryptography import exceptions as crypto_exceptions
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.p2p import PeerID

from p2ptrain.errors import UserError, one_line
from p2ptrain.net.dht import NetworkConfig

ORGANISER_KEY_BITS = 3072
MAX_TICKET_CHARS = 1024  # base64 of a signature by a key of up to 6,144 bits (3,072 bits: 512 characters)
TICKET_FORMAT = "p2ptrain-ticket-v1"
MANIFEST_SIGNATURE_FORMAT = "p2ptrain-manifest-signature-v1"
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
_HASH = hashes.SHA256()


def ticket_message(run_id: str, peer_id: str) -> bytes:
    """What a ticket signs: the run id is part of it, so a ticket admits its peer to one run only."""
    return b"\0".join((TICKET_FORMAT.encode(), run_id.encode(), peer_id.encode()))


def sign_ticket(private_key: rsa.RSAPrivateKey, run_id: str, peer_id: str) -> str:
    """The ticket (base64 signature) that admits `peer_id` to `run_id`."""
    return base64.b64encode(private_key.sign(ticket_message(run_id, peer_id), _PADDING, _HASH)).decode()


@functools.lru_cache(maxsize=4096)  # validators see the same record every heartbeat: verify each ticket once
def verify_ticket(organiser_key: bytes, run_id: str, peer_id: str, ticket: str) -> bool:
    """Whether `ticket` is the organiser's signature for this peer and run (`organiser_key`: OpenSSH bytes)."""
    if not ticket or len(ticket) > MAX_TICKET_CHARS:
        return False
    try:
        signature = base64.b64decode(ticket, validate=True)
        _public_key(organiser_key).verify(signature, ticket_message(run_id, peer_id), _PADDING, _HASH)
    except (binascii.Error, ValueError, crypto_exceptions.InvalidSignature):
        return False
    return True


def sign_manifest(private_key: rsa.RSAPrivateKey, manifest: bytes) -> str:
    """The organiser's signature (base64) of a run manifest's canonical bytes (p2ptrain/manifest.py)."""
    return base64.b64encode(private_key.sign(_manifest_message(manifest), _PADDING, _HASH)).decode()


def verify_manifest(organiser_key: bytes, manifest: bytes, signature: str) -> bool:
    """Whether `signature` is the organiser's of these manifest bytes (never of a ticket: the messages differ)."""
    if not signature or len(signature) > MAX_TICKET_CHARS:
        return False
    try:
        _public_key(organiser_key).verify(base64.b64decode(signature, validate=True), _manifest_message(manifest),
                                          _PADDING, _HASH)
    except (binascii.Error, ValueError, crypto_exceptions.InvalidSignature):
        return False
    return True


def _manifest_message(manifest: bytes) -> bytes:
    return b"\0".join((MANIFEST_SIGNATURE_FORMAT.encode(), manifest))


@functools.lru_cache(maxsize=16)
def _public_key(organiser_key: bytes) -> rsa.RSAPublicKey:
    key = serialization.load_ssh_public_key(organiser_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA key")
    return key


# ---- key and ticket files ---------------------------------------------------------------------------------------
def generate_organiser_key(path: str | Path) -> tuple[Path, Path]:
    """Write a new RSA key pair: the private key to `path` (PEM, mode 0600), the public key to `path`.pub."""
    private_path = Path(path).expanduser()
    public_path = private_path.with_name(private_path.name + ".pub")
    for existing in (private_path, public_path):
        if existing.exists():
            raise UserError(f"{str(existing)!r} already exists: choose another --out (a run keeps its organiser key)")
    key = rsa.generate_private_key(public_exponent=65537, key_size=ORGANISER_KEY_BITS)
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_ssh = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    try:
        private_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private_pem)
        public_path.write_bytes(public_ssh + b" p2ptrain-organiser\n")
    except OSError as e:
        raise UserError(f"cannot write the organiser key {str(private_path)!r}: {e.strerror or e}") from None
    return private_path, public_path


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise UserError(f"cannot read the {what} {str(path)!r}: {e.strerror or e}") from None


def load_signing_key(path: str | Path) -> rsa.RSAPrivateKey:
    """The organiser's private key, from `p2ptrain keygen`."""
    try:
        key = serialization.load_pem_private_key(_read(path, "organiser key"), password=None)
    except (ValueError, TypeError) as e:
        raise UserError(f"{str(path)!r} is not an organiser private key from `p2ptrain keygen`: {one_line(e)}") \
            from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise UserError(f"{str(path)!r} is not an RSA key: make one with `p2ptrain keygen`")
    return key


def load_organiser_key(path: str | Path) -> bytes:
    """The organiser's public key (the `.pub` file from `p2ptrain keygen`), as OpenSSH bytes without comment."""
    data = _read(path, "organiser public key").strip()
    if b"PRIVATE KEY" in data:
        raise UserError(f"{str(path)!r} is the organiser's private key: give peers the .pub file, keep this one")
    try:
        key = serialization.load_ssh_public_key(b" ".join(data.split()[:2]))
        if not isinstance(key, rsa.RSAPublicKey):
            raise ValueError("not an RSA key")
    except (ValueError, TypeError, IndexError) as e:
        raise UserError(f"{str(path)!r} is not an organiser public key (.pub from `p2ptrain keygen`): "
                        f"{one_line(e)}") from None
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A ticket file: which peer of which run it admits, and the organiser's signature."""

    run_id: str
    peer_id: str
    signature: str


def check_peer_id(peer_id: str) -> str:
    """`peer_id` if it is a libp2p peer id (base58 multihash, as a peer prints it), else a one-line error."""
    try:
        multihash.decode(PeerID.from_base58(peer_id).to_bytes())
    except (ValueError, TypeError):
        raise UserError(f"{peer_id!r} is not a peer id (expected e.g. QmPeerId..., as the peer printed it)") \
            from None
    if len(peer_id) > 128:
        raise UserError(f"peer id {peer_id[:20]}... is longer than 128 characters")
    return peer_id


def write_ticket(path: str | Path, ticket: Ticket) -> None:
    try:
        Path(path).expanduser().write_text(json.dumps({"format": TICKET_FORMAT, **dataclasses.asdict(ticket)}) + "\n")
    except OSError as e:
        raise UserError(f"cannot write the ticket {str(path)!r}: {e.strerror or e}") from None


def read_ticket(path: str | Path) -> Ticket:
    try:
        fields = json.loads(_read(path, "admission ticket"))
        if fields.pop("format") != TICKET_FORMAT:
            raise ValueError("unknown format")
        ticket = Ticket(**fields)
        if not all(isinstance(v, str) for v in dataclasses.astuple(ticket)):
            raise ValueError("fields must be strings")
    except (ValueError, TypeError, KeyError, AttributeError):  # json's errors are ValueErrors
        raise UserError(f"{str(path)!r} is not an admission ticket from `p2ptrain admit`") from None
    return ticket


def admit_peer(key_path: str | Path, run_id: str, peer_id: str, out_path: str | Path) -> Ticket:
    """Sign `peer_id` into `run_id` with the organiser key at `key_path` and write the ticket to `out_path`."""
    ticket = Ticket(run_id, check_peer_id(peer_id), sign_ticket(load_signing_key(key_path), run_id, peer_id))
    write_ticket(out_path, ticket)
    return ticket


# ---- the checks -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AdmissionPolicy:
    """The rule records are checked against; plain data, so DHT validators can carry it to hivemind's process."""

    run_id: str
    organiser_key: bytes = b""  # OpenSSH public key; empty: an open run

    @property
    def signed(self) -> bool:
        return bool(self.organiser_key)

    def ticket_problem(self, peer_id: str, ticket: str) -> str | None:
        """Why a record of `peer_id` carrying `ticket` is refused, or None."""
        if not self.signed:
            return None
        if not ticket:
            return "no admission ticket"
        if not verify_ticket(self.organiser_key, self.run_id, peer_id, ticket):
            return "its ticket is not the organiser's signature of its peer id in this run"
        return None


class Admission:
    """This node's view of who may take part: `allows(peer_id)` for servers, `ticket` for its own record."""

    def __init__(self, policy: AdmissionPolicy, ticket: str = "", own_peer_id: str | None = None):
        self.policy, self.ticket = policy, ticket  # ticket: this peer's own, "" for nodes that train nothing
        self._admitted: set[str] = {own_peer_id} if own_peer_id else set()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, run_id: str) -> Admission:
        return cls(AdmissionPolicy(run_id))

    @classmethod
    def from_config(cls, network: NetworkConfig, run_id: str, peer_id: str | None = None) -> Admission:
        """The run's admission. `peer_id`: a training peer's own id, whose ticket is loaded and checked now (a
        one-line UserError if it is missing, corrupt, for another peer or run, or not the organiser's); None for
        nodes that train nothing (bootstrap, status), which only check others."""
        if network.admission == "open":
            return cls.open(run_id)
        policy = AdmissionPolicy(run_id, load_organiser_key(network.organiser_key))
        if peer_id is None:
            return cls(policy)
        return cls(policy, load_own_ticket(policy, network.admission_ticket, peer_id), own_peer_id=peer_id)

    @property
    def signed(self) -> bool:
        return self.policy.signed

    def allows(self, peer_id: str) -> bool:
        """Whether to serve `peer_id`: always in an open run; in a signed run, once a record of it with a valid
        ticket has been read, or a request of it carried one (`admits_`)."""
        if not self.policy.signed:
            return True
        with self._lock:
            return peer_id in self._admitted

    def admit_(self, peer_id: str) -> None:
        """Record that a valid ticket of `peer_id` was seen (discovery calls this for each record it accepts)."""
        with self._lock:
            self._admitted.add(peer_id)

    def admits_(self, peer_id: str, ticket: object = "") -> bool:
        """Whether to serve `peer_id`, admitting it when the `ticket` its request carries is valid. A peer's record
        reaches us a read or more after the peer asks (at scale, a read covers a few shards of the swarm): a
        volunteer whose record we had not read yet was refused every exchange and state, and trained alone."""
        if self.allows(peer_id):
            return True
        if not isinstance(ticket, str) or self.policy.ticket_problem(peer_id, ticket) is not None:
            return False
        self.admit_(peer_id)
        return True


def load_own_ticket(policy: AdmissionPolicy, path: str, peer_id: str) -> str:
    """This peer's ticket, checked before it joins: a one-line error says what is wrong and what to do."""
    ask = f"send your peer id {peer_id} to the organiser, who runs `p2ptrain admit {peer_id}`"
    if not path:
        raise UserError(f"this run admits peers with a ticket: {ask}, then pass --admission-ticket FILE")
    ticket = read_ticket(path)
    if ticket.peer_id != peer_id:
        raise UserError(f"ticket {path!r} is for peer {ticket.peer_id!r}, not this peer ({peer_id}; the id comes "
                        f"from --identity): {ask}")
    if ticket.run_id != policy.run_id:
        raise UserError(f"ticket {path!r} is for run {ticket.run_id!r}, not {policy.run_id!r}: {ask}")
    if policy.ticket_problem(peer_id, ticket.signature) is not None:
        raise UserError(f"ticket {path!r} was not signed by the organiser key of this run (--organiser-key): {ask}")
    return ticket.signature
