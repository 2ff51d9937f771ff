"""The cluster section's elastic parts: a job of ``{min: M, max: N}`` tasks (``ElasticJob``; a plain
number keeps a fixed count) and ``cluster.adaptive`` (``AdaptiveSpec``).

Section models only, which ``ClusterSpec`` (``sections``) is built from; what elastic replicas
mean and the rules across sections that refuse what they cannot do are in ``elastic``.
``parse_elastic`` validates one ``{min, max}`` job on its own and words its problems with
``messages``, walking from ``ElasticJob``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .messages import error_message

MAX_ELASTIC = 256  # as MAX_TASKS_PER_JOB


class ElasticJob(BaseModel):
    """A job whose tasks come and go: between ``min`` and ``max`` of them run at any time."""

    model_config = ConfigDict(extra="forbid", strict=True)

    min: int = Field(ge=1, le=MAX_ELASTIC, description="The fewest live replicas the run goes on with; it starts "
                     "when this many workers serve the job, and fails after cluster.wait_s below it.")
    max: int = Field(ge=1, le=MAX_ELASTIC, description="The most replicas at once: the job's task slots, each with "
                     "its own part of the data; workers beyond it are left idle.")

    @model_validator(mode="after")
    def _order(self) -> ElasticJob:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min}); write e.g. {{min: {self.max}, "
                             f"max: {self.min}}}")
        return self


class AdaptiveSpec(BaseModel):
    """Dask's adaptive scaling of the embedded cluster's replica workers."""

    model_config = ConfigDict(extra="forbid", strict=True)

    min: int | None = Field(None, ge=1, le=MAX_ELASTIC, description="The fewest replica workers kept (the ps "
                            "workers come on top); the embedded cluster starts with these. Default: the replicas' "
                            "job's min.")
    max: int | None = Field(None, ge=1, le=MAX_ELASTIC, description="The most replica workers started: Dask adds "
                            "workers up to it while replica slots have work, and retires idle ones. Default: the "
                            "replicas' job's max.")
    interval_s: float = Field(1.0, gt=0, le=60, description="How often Dask's Adaptive asks for a new target "
                              "(its interval).")


def parse_elastic(name: str, tasks: dict[str, Any], problems: list[tuple[tuple[str | int, ...], str]]) -> Any:
    """``{min, max}`` as an ElasticJob, or its problems (one per key, in the spec's own words; each
    located at ``cluster.jobs.<name>.<key>``, relative to the jobs)."""
    try:
        return ElasticJob.model_validate(tasks)
    except ValidationError as exc:
        for err in exc.errors():
            loc = (name, *err["loc"]) if err["type"] != "value_error" else (name,)
            problems.append((loc, error_message(err, tuple(err["loc"]), ElasticJob) if err["type"] != "value_error"
                             else str(err["ctx"]["error"])))
        return tasks
