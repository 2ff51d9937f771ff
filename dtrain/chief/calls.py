"""Calls to the ps shards' Dask actors: a result with a timeout, one method started on every shard
at once, and the timeout a transfer of a given size gets."""

from __future__ import annotations

import concurrent.futures
from typing import Any


def call(future: Any, timeout: float = 30.0) -> Any:
    """The result of an actor call, waiting at most ``timeout`` seconds."""
    return future.result(timeout=timeout)


def calls(handles: list[Any], method: str, *args: Any) -> list[Any]:
    """Start ``method(*args)`` on every handle at once, for the caller to collect one by one: a
    lost shard's call is a failed future (a Dask actor whose worker is gone refuses the method at
    once, RuntimeError "Worker holding Actor was lost"), like one that fails on its way."""
    out: list[Any] = []
    for h in handles:
        try:
            out.append(getattr(h, method)(*args))
        except Exception as exc:
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(exc)
            out.append(failed)
    return out


def transfer_timeout(numel: int, state_factor: int = 4) -> float:
    """A timeout for moving a shard's state (params and up to three optimizer tensors of float32)
    through Dask: 60 s, plus 1 s per 20 MB (a slow 160 Mbit/s network)."""
    return 60.0 + numel * 4 * state_factor / 20e6


def describe_failure(future: Any, label: str) -> str | None:
    """Why the task of ``future`` (named ``label`` in the message) did not finish, or None: its
    error, or its cancellation (the scheduler cancels a task whose worker was lost)."""
    if future.status == "error":
        exc = future.exception(timeout=5)
        return f"{label} failed: {type(exc).__name__}: {exc}"
    if future.status == "cancelled":
        return f"{label} was cancelled (its worker was lost?)"
    return None
