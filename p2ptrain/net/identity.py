"""A peer's identity: one RSA key that is both its libp2p peer id and the key that signs its DHT records.

hivemind's libp2p identities are RSA keys and a peer id is the multihash of the public key, so a record signed
with the identity key proves that its signer *is* the peer id it names: anyone can check it from the record's
subkey alone (`peer_id_of_signer`), with no round trip. Without this a signer could publish records in another
peer's name (and get that peer blamed for its claims).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

OWNER_RE = re.compile(rb"\[owner:(.+?)\]")  # how hivemind's RSASignatureValidator marks a subkey's signer
# subkeys whose signer is remembered: every DHT read validates each record it gets (from several nodes), and the SSH
# key load and hash were a tenth of a DHT process's CPU in an 8-peer swarm; identities are cheap, so a bound
SIGNERS_REMEMBERED = 2048


def fresh_identity_path() -> str:
    """A path in a new private directory where the DHT can generate a throwaway identity (the file must not
    exist yet: hivemind then generates it without asking the swarm whether it is taken)."""
    return os.path.join(tempfile.mkdtemp(prefix="p2ptrain-identity-"), "identity.key")


def load_identity_key(path: str) -> RSAPrivateKey:
    """The identity file's key as hivemind's RSAPrivateKey (to sign DHT records with)."""
    with open(path, "rb") as f:
        key_data = crypto_pb2.PrivateKey.FromString(f.read()).data
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": key_data})
    return key


def peer_id_of_public_key(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id of an RSA public key (the same computation as `PeerID.from_identity`)."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


@functools.lru_cache(maxsize=SIGNERS_REMEMBERED)
def peer_id_of_signer(subkey: bytes) -> str | None:
    """The peer id whose identity key signed a record with this DHT subkey; None if the subkey names no RSA key."""
    match = OWNER_RE.search(subkey)
    if match is None:
        return None
    try:
        public_key = serialization.load_ssh_public_key(match.group(1))
    except (ValueError, TypeError):
        return None
    if not isinstance(public_key, rsa.RSAPublicKey):
        return None
    return peer_id_of_public_key(public_key)
