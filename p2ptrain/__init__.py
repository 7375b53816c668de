"""p2ptrain: peer-to-peer volunteer training of language models (DiLoCo, gossip, compression)."""

__version__ = "0.1.0"
