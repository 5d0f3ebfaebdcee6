"""Transports: what runs a schedule on one device. Algorithms see none of them."""
from .base import Link, Handle, Transport, TransportAborted, TransportTimeout

__all__ = ["Link", "Handle", "Transport", "TransportAborted", "TransportTimeout"]
