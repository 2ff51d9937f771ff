"""The metric sinks: TensorBoard groups the telemetry per replica and per shard."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dtrain.chief.metrics import TensorBoardSink


def test_tensorboard_groups_telemetry_per_replica_and_per_shard(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.log({"loss": 0.5, "replicas": 2, "eval": {"accuracy": 0.9},
              "replica_stats": {"0": {"task": "/job:worker/task:0", "steps_per_s": 410.0, "data_frac": 0.1},
                                "1": {"steps_per_s": 12.5}},
              "shard_stats": {"1": {"busy_frac": 0.93, "variables": ["0.weight"], "staleness": {"mean": 1.0}}}}, 100)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "replicas", "eval/accuracy", "replica_0/steps_per_s", "replica_0/data_frac",
            "replica_1/steps_per_s", "shard_1/busy_frac"} == tags
    assert acc.Scalars("replica_1/steps_per_s")[0].value == 12.5 and acc.Scalars("shard_1/busy_frac")[0].step == 100
