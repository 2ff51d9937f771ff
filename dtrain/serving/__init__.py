"""Serving a model exported by ``dtrain export`` (:class:`ExportedModel`)."""

from .loader import ExportedModel

__all__ = ["ExportedModel"]
