"""The data plane's errors: a sharded source that cannot be used, a shard or a record that turns out
bad while training reads it. Apart from ``shards.py`` so that the readers it calls (``criteo.py``,
``records.py``) raise them without importing it back."""

from __future__ import annotations


class ShardError(ValueError):
    """A sharded source that cannot be used (nothing matches, files that disagree, a bad header)."""


class BadShardError(OSError):
    """A shard that turned out unreadable or corrupt while training read it (names the file)."""


class BadRecordError(BadShardError, ValueError):
    """A record that does not fit the layout (names the file, the line or row, and the column)."""
