"""The chief (MonitoredTrainingSession's role): the session loop, the ps shard group, recovery
from lost tasks, hooks, checkpoints, metrics, the in-graph step driver and reports. Runs in the
process that called ``dtrain.run``; the only plane that turns a Plan into Dask calls."""
