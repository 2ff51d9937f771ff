"""The data plane: flat parameter and gradient buffers between replicas and ps shards over one
persistent authenticated socket per pair, or shared-memory slots when both share a machine.
No Dask here: Dask (the control plane) hands out the endpoints and the per-run secret."""
