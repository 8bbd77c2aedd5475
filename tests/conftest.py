"""Shared fixtures: the real params shrunk to a tiny detector, outputs under tmp_path."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rcnn.model import DetectorConfig

ROOT = Path(__file__).resolve().parents[1]

TINY_PARAMS = {
    "data": {"num_images": 4, "image_size": 64, "num_classes": 2, "seed": 0},
    "model": {"backbone": "mobilenet_v3_fpn", "image_size": 64, "rois_per_image": 8, "representation_size": 32},
    "sweep": {"device": "cpu", "profile_steps": 1,
              "space": {"head": ["linear", "conv"], "onednn": [True], "amp": ["off"], "channels_last": [False],
                        "batch_size": [2]}},
    "timing": {"warmup": 1, "max_warmup": 2, "iterations": 2, "max_iterations": 3, "max_seconds": 5},
}
TINY_CONFIG = DetectorConfig(backbone="mobilenet_v3_fpn", image_size=64, rois_per_image=8,
                             representation_size=32, num_classes=2)


def merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.fixture
def tiny_params(tmp_path: Path):
    """Write a tiny params.yaml (stores under tmp_path) with optional overrides; returns its path."""
    def write(override: dict | None = None) -> Path:
        raw = merged(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY_PARAMS)
        raw = merged(raw, {"sweep": {"storage": str(tmp_path / "optuna.journal")},
                           "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "test"}})
        raw = merged(raw, override or {})
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path
    return write
