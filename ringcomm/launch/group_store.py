"""A group's own namespace in a store that earlier processes may have written to
(:func:`fresh_store`), a bounded read of one key (:func:`store_wait`), and of many
(:func:`get_all`)."""
from __future__ import annotations

import time
import uuid
from datetime import timedelta


def store_wait(store, key: str, timeout: timedelta) -> bytes:
    """The value of ``key`` once it is set, waiting at most ``timeout``."""
    store.wait([key], timeout)
    return store.get(key)


def get_all(store, keys: list[str]) -> list[bytes]:
    """The values of ``keys``, all set already: one request where the store has
    ``multi_get`` (torch's TCPStore), else one each."""
    try:
        return store.multi_get(keys)
    except (AttributeError, NotImplementedError, RuntimeError):  # a store without it
        return [store.get(k) for k in keys]


def unset(store, keys: list[str]) -> list[str]:
    """Those of ``keys`` not set (after a wait for them all ran out: one look each)."""
    return [k for k in keys if not store.check([k])]


def fresh_store(store, rank: int, size: int, timeout: timedelta):
    """``store`` under a prefix that only this group's current processes use.

    A store can outlive the processes that wrote to it: torchrun's agent hands the
    same store to every restart of its workers, so a restarted rank would read,
    say, the MPI port of a rank 0 that is gone. Rank 0 therefore picks a new random
    token and publishes it under ``ringcomm/lead``; every other rank answers under
    the token it reads with a nonce of its own, and takes the token once rank 0
    has welcomed that nonce. A token left by earlier processes never welcomes a
    new nonce (its rank 0 is gone), so a rank that read one reads ``ringcomm/lead``
    again, after a second, then at growing intervals, until rank 0's new token
    appears. Every wait is the store's own (woken when the key is set), so a fresh
    store costs each rank a few round trips.

    Raises:
        DistBackendError: ranks were missing after ``timeout`` (names them).
    """
    import torch.distributed as dist

    limit = timeout.total_seconds()
    if rank == 0:
        token = uuid.uuid4().hex
        hellos = [f"ringcomm/{token}/hello/{r}" for r in range(1, size)]
        store.set("ringcomm/lead", token)
        deadline = time.monotonic() + limit
        for r, key in enumerate(hellos, 1):  # each rank welcomed as soon as it came
            try:
                store.wait([key], timedelta(seconds=max(1e-3, deadline - time.monotonic())))
            except dist.DistStoreError:
                missing = [q for q, k in enumerate(hellos, 1) if q >= r and not store.check([k])]
                raise dist.DistBackendError(
                    f"ringcomm: setting up a group of {size}: ranks {missing} did not "
                    f"arrive within {limit:g} s") from None
            store.set(f"ringcomm/{token}/welcome/{store.get(key).decode()}", b"1")
        return dist.PrefixStore(f"ringcomm/{token}/", store)
    # the wait for the welcome is cut in slices (1 s, growing) only to read the lead
    # again when it was one left by earlier processes
    nonce, lead, look = uuid.uuid4().hex, None, 1.0
    deadline = time.monotonic() + limit
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise dist.DistStoreError("out of time")
            store.wait(["ringcomm/lead"], timedelta(seconds=left))
            current = store.get("ringcomm/lead").decode()
            if current != lead:  # rank 0's token, or one left by earlier processes
                lead = current
                store.set(f"ringcomm/{lead}/hello/{rank}", nonce)
            store.wait([f"ringcomm/{lead}/welcome/{nonce}"],
                       timedelta(seconds=max(1e-3, min(look, left))))
            return dist.PrefixStore(f"ringcomm/{lead}/", store)
        except dist.DistStoreError:
            if time.monotonic() >= deadline:
                raise dist.DistBackendError(
                    f"ringcomm: setting up a group of {size}: rank 0 did not answer "
                    f"rank {rank} within {limit:g} s") from None
            look = min(2 * look, 5.0)
