"""The pipeline runtime: stages as processes, data over the relay, control over ZeroMQ.

    from stagelink.pipeline import Pipeline
    with Pipeline.from_yaml("examples/omni_pipeline.yaml") as p:
        print(p.submit("req-1", payload).result(timeout=60))

A stage is ``fn(payload, ctx)`` (see `StageContext`); the file format is in
`stagelink.pipeline.spec` and docs/pipeline.md.
"""
from .coordinator import Pipeline, PipelineStartError, StageDiedError, StageError  # noqa: F401
from .spec import PipelineConfigError, PipelineSpec, load_pipeline  # noqa: F401
from .stage import Aborted, PerTarget, StageContext, StreamError  # noqa: F401
