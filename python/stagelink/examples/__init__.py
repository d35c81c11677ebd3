"""Example pipelines that travel with the package: their stage modules (omni, toy, busy, ...) and
their pipeline files (``*_pipeline.yaml`` here). ``stagelink examples`` lists them and
``stagelink run NAME`` runs one without a checkout (``stagelink run omni``)."""
from __future__ import annotations

import os
from typing import Dict, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def available() -> Dict[str, str]:
    """{name: path} of every example pipeline file in the package (name: the file's without
    ``_pipeline.yaml``)."""
    out = {}
    for f in sorted(os.listdir(HERE)):
        if f.endswith("_pipeline.yaml"):
            out[f[: -len("_pipeline.yaml")]] = os.path.join(HERE, f)
    return out


def path_of(name: str) -> Optional[str]:
    """The pipeline file of example ``name`` (``omni``, or ``omni_pipeline.yaml``), or None."""
    base = os.path.basename(name)
    for suffix in ("_pipeline.yaml", ".yaml"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return available().get(base)


def describe(path: str) -> str:
    """The comment block a pipeline file starts with, as one paragraph (its own `stagelink run`
    lines left out)."""
    lines = []
    with open(path) as f:
        for ln in f:
            if not ln.startswith("#"):
                break
            text = ln[1:].strip()
            if text and not text.startswith("stagelink run"):
                lines.append(text)
    return " ".join(lines)
