"""What the user writes: the pipeline file as strict pydantic models (``pipeline``, ``sections``, ``session``, ``graph``;
the rules across sections take the sections they read, ``view``, never the ``pipeline`` that runs them),
YAML loading with ``FILE:LINE: path: message`` errors (``loading``), TensorFlow's device strings
(``device``) and the error types (``errors``). Nothing here imports Dask, and loading a pipeline
never imports the user's code (``model.module`` and custom hooks are imported by ``plan``/``run``).
"""
