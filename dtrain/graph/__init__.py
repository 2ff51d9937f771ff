"""Graph pipelines (TF's plain placement examples): variables and ops evaluated as one Dask task
per node, pinned by worker address. ``ops`` is the math (torch), ``runner`` the Dask side."""
