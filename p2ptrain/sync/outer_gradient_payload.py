"""What a peer sends for its outer gradient in Mix2 and the all-reduces: s = decode(codec(β·e + Δ)), error
feedback's prepare step, encoded once (every partner gets the same bytes and decodes them to s bit for bit)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from p2ptrain.maths.codecs import Codec, ErrorFeedback, compress_all, get_codec
from p2ptrain.net.exchange import Payload
from p2ptrain.sync.config import SPARSE_GRAD_CODECS, SyncConfig
from p2ptrain.tensor_layout import norm


def outer_gradient_codec(config: SyncConfig) -> Codec:
    """The codec `sync.grad_codec` names, with its options (`topk_density`, `topk_chunk_size`, `sparse_bits`)."""
    sparse = config.grad_codec in SPARSE_GRAD_CODECS
    options: dict[str, Any] = {"density": config.topk_density, "chunk_size": config.topk_chunk_size} if sparse else {}
    if config.grad_codec == "sparse":
        options["bits"] = config.sparse_bits
    return get_codec(config.grad_codec, **options)


def prepare_payload(feedback: ErrorFeedback, delta: Sequence[torch.Tensor],
                    outgoing: Callable[[list[torch.Tensor]], list[torch.Tensor]]
                    ) -> tuple[Payload, list[torch.Tensor], float]:
    """(the payload we send, our s, ‖s‖); raises ValueError for a non-finite Δ. `outgoing` forms what we send for s
    (the transport's one point where it is formed)."""
    payload, sent = feedback.prepare(delta)
    shown = outgoing(sent)
    if shown is not sent:  # an override formed something else: send that
        payload = compress_all(feedback.codec, shown)
    return payload, sent, norm(sent)
