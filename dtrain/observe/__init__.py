"""Telemetry: where a run's time goes, per replica and per ps shard, and where the figures are shown."""
