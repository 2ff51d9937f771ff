"""The code of ``benchmarks/bench.py`` (the entry point; its docstring says what is measured and
how), by role:

- ``configs``: paths, model sizes, goals, the configurations, optimizer helpers;
- ``children``: what runs in the child processes (plain loop, DDP, dtrain run, worker probes);
- ``runner``: the parent's side: children in their own process groups, one configuration per call;
- ``report``: summaries over the repetitions and the main table;
- ``scaling``: the scaling sweep, its table and plot;
- ``machine``: machine info, the loopback counter and CPU sampler, the raw loopback round trip.

Dask's spawned workers and torch.multiprocessing's children import these modules, so their top
level imports only the standard library (and each other).
"""
