"""The parameter server: ``ParameterShard`` (one shard's variables as one flat buffer, served as a
Dask actor), its flat optimizers, and the replication rules (sync, async, bounded staleness) as
pure state machines. Never imports the chief; the data plane reaches it through its methods."""
