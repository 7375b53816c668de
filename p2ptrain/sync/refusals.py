"""The words a responder of sync/'s exchanges refuses an offer with, and which of them an initiator asks again after.

They travel on the wire (net/exchange.py's refusal) and initiators compare them with what they expect, so each is
spelled once, here, for every exchange: parameter gossip, Mix2 gossip, the all-reduces."""

from __future__ import annotations


class Refusal:
    """Why an offer was refused (the word the initiator reads)."""

    OTHER_RUN = "another run or model"  # the offer's run id or model fingerprint is not ours
    UNSUPPORTED = "unsupported exchange"  # another kind of exchange, or a codec we do not decode
    MALFORMED = "malformed offer"  # a field the exchange needs is missing or of the wrong type
    BAD_WEIGHT = "bad mixing weight"  # a weight the exchange cannot use
    WRONG_ROUND = "not in this round"  # we have not reached the offer's round yet: asked again
    ROUND_OVER = "round over"  # our exchange of that round has closed (or we are past that round)
    ALREADY_PARTNERS = "already partners"  # mixed, mixing, or the partner's own offer to us is the one that counts
    TOO_MANY_OFFERS = "too many offers"  # beyond the offers a partner may open with us
    BUSY = "busy"  # no slot free for it now
    NO_VALUE = "no value to offer"  # our own value cannot be sent
    LEAVING = "leaving the run"  # we are shutting down: not asked again this round
    NOT_IN_GROUP = "not in this peer's group"  # another group of the round, or a peer our records do not show yet


# refusals after which an offer is made again (`round_retry.retry_delay_s`, up to the round's patience): the partner
# has not reached our round, or its offer to us crossed ours and may itself have been refused as not in our round yet
ASK_AGAIN = (Refusal.WRONG_ROUND, Refusal.ALREADY_PARTNERS)
