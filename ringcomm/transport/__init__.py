"""Transports: what runs a schedule on one device. Algorithms see none of them."""
from ringcomm.transport.base import Handle, Link, Transport, TransportAborted, TransportTimeout

__all__ = ["Link", "Handle", "Transport", "TransportAborted", "TransportTimeout"]
