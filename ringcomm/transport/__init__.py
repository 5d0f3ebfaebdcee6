"""Transports: what runs a schedule on one device. Algorithms see none of them."""
from .base import Channel, Handle, Transport, TransportAborted, TransportTimeout

__all__ = ["Channel", "Handle", "Transport", "TransportAborted", "TransportTimeout"]
