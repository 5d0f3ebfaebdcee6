"""Transports: what runs a schedule on one device. Algorithms see none of them."""
from ringcomm.transport.base import (Handle, Link, NotOwnCollective, Transport, TransportAborted,
                                     TransportMismatch, TransportPeerFailed, TransportPeerLost,
                                     TransportTimeout)

__all__ = ["Link", "Handle", "NotOwnCollective", "Transport", "TransportAborted",
           "TransportMismatch", "TransportPeerFailed", "TransportPeerLost", "TransportTimeout"]
