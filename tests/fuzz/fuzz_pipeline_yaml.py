"""atheris (libFuzzer for Python): the pipeline file loader, stagelink.pipeline.load_pipeline, on
any YAML. It may only raise PipelineConfigError (a StagelinkError): any other exception (a
TypeError from a value of an unexpected type, a RecursionError, ...) is a bug the fuzzer reports.
    .venv/bin/python tests/fuzz/fuzz_pipeline_yaml.py CORPUS_DIR SEED_DIR -max_total_time=60
(./scripts/fuzz runs it with the C++ targets when atheris is installed.)"""
import sys

import atheris

with atheris.instrument_imports():
    import yaml
    from stagelink.pipeline import PipelineConfigError, load_pipeline


def one(data: bytes):
    try:
        raw = yaml.safe_load(data.decode("utf-8", "replace"))
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError):
        return  # not YAML this loader would be given (load_pipeline wraps yaml.YAMLError itself)
    try:
        load_pipeline(raw)
    except PipelineConfigError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
