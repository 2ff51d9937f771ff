"""Where tasks run: the embedded cluster, connecting to a running scheduler, and the
``dtrain worker`` command that starts a named Dask worker for one task."""
