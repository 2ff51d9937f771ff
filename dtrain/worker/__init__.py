"""The worker side: a replica's training loop (torch only, ``replica``), gradient buckets sent
during backward, and the functions Dask runs on worker tasks (``tasks``, in-graph steps).
Never imports the chief."""
