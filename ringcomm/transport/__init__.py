"""Point-to-point transports. Algorithms see only :class:`Transport`."""
from .base import Handle, Transport, TransportTimeout

__all__ = ["Handle", "Transport", "TransportTimeout"]
