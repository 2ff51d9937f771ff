"""``PipelineView``: a pipeline as the rules across its sections read it.

The rules that span sections (``elastic``, ``stages``, ``tokens``) run inside ``PipelineSpec``'s
validation (``pipeline``), which assembles the sections and so imports them; they take this
protocol instead of ``PipelineSpec`` itself, so they need only the section models it names
(``sections``, ``layers``, ``data``), never the pipeline that calls them. ``PipelineSpec`` is one
(the type checker checks it wherever one is passed), and so is any other object with these
sections and answers.
"""

from __future__ import annotations

from typing import Protocol

from .data import DataSpec
from .layers import ModelSpec
from .sections import ClusterSpec, PlacementSpec, TrainingSpec


class PipelineView(Protocol):
    """The sections and derived answers of a pipeline that the cross-section rules read."""

    @property
    def cluster(self) -> ClusterSpec: ...

    @property
    def placement(self) -> PlacementSpec: ...

    @property
    def model(self) -> ModelSpec | None: ...

    @property
    def data(self) -> DataSpec: ...

    @property
    def training(self) -> TrainingSpec: ...

    @property
    def is_graph(self) -> bool:
        """No model: a graph pipeline (variables, graph, fetch)."""
        ...

    def required_model(self) -> ModelSpec:
        """``model``, which a training pipeline has."""
        ...

    def has_sparse_tables(self) -> bool:
        """Whether the model holds a sparse embedding table."""
        ...

    def num_replicas(self) -> int:
        """Replicas: one per worker task, or per group of stage tasks for a pipeline."""
        ...
