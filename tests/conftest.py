"""Shared fixtures: the real params shrunk to a tiny detector, outputs under tmp_path."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from rcnn.detector.model import DetectorConfig

pytest.register_assert_rewrite("tests.pipeline.helpers")  # its asserts report values, as a test module's do

ROOT = Path(__file__).resolve().parents[1]

TINY_PARAMS = {
    "data": {"num_images": 4, "image_size": 64, "num_classes": 2, "seed": 0},
    "model": {
        "backbone": "mobilenet_v3_fpn",
        "image_size": 64,
        "rois_per_image": 8,
        "representation_size": 32,
    },
    "sweep": {
        "device": "cpu",
        "profile_steps": 1,
        # The head timed alone costs a second or more per head whatever its size: the two-trial sweep of
        # tests/pipeline/test_stages.py turns it on and checks it, the other sweeps leave it out.
        "cross_check": False,
        "pair_seconds": 1,  # the twin of the two heads: the least rounds, then a second at most
        "space": {
            "head": ["linear", "conv"],
            "onednn": [True],
            "amp": ["off"],
            "channels_last": [False],
            "batch_size": [2],
            "linearize": [False],
        },
    },
    "timing": {"warmup": 1, "max_warmup": 2, "iterations": 2, "max_iterations": 3, "max_seconds": 5},
}
TINY_CONFIG = DetectorConfig(
    backbone="mobilenet_v3_fpn", image_size=64, rois_per_image=8, representation_size=32, num_classes=2
)


def merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def copy_project(dest: Path) -> Path:
    """The project's files as a new user's clone holds them (tracked or new, not ignored; no .git) in
    ``dest``, with the tiny params merged into its params.yaml."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    tiny = merged(yaml.safe_load((dest / "params.yaml").read_text()), TINY_PARAMS)
    (dest / "params.yaml").write_text(yaml.safe_dump(tiny))
    return dest


def write_tiny_params(folder: Path, override: dict | None = None) -> Path:
    """The repo's params.yaml shrunk to TINY_PARAMS, stores under ``folder``, plus ``override``: its path."""
    raw = merged(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY_PARAMS)
    raw = merged(
        raw,
        {
            "sweep": {"storage": str(folder / "optuna.journal")},
            "tracking": {"mlflow_uri": f"sqlite:///{folder / 'mlflow.db'}", "experiment": "test"},
        },
    )
    raw = merged(raw, override or {})
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked gpu run where torch sees a CUDA GPU (``pytest -m gpu`` on such a machine); elsewhere
    skip."""
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture
def tiny_params(tmp_path: Path):
    """Write a tiny params.yaml (stores under tmp_path) with optional overrides; returns its path."""
    return lambda override=None: write_tiny_params(tmp_path, override)


# Head bwd, bwd
FAKE_HEADS = {
    "linear": (10.0, 100.0),
    "conv": (40.0, 130.0),
    "conv_as_linear": (11.0, 101.0),
}


def fake_trials(scale: float = 1.0, batch_2_cost: float = 2.0) -> tuple[pd.DataFrame, dict]:
    """A fixed trials table with per-step samples: two settings (batch 1, and batch 2 whose times are
    ``batch_2_cost`` times batch 1's), three heads with known medians (conv/linear head backward 4x), and one
    failed trial. All times times ``scale``. Below 2, batch 2 is slower per step but faster per image."""
    from rcnn.trial.schema import TRIAL_COLUMNS

    rng = np.random.default_rng(0)
    rows, samples = [], {}
    for bs, factor in ((1, 1.0), (2, batch_2_cost)):
        for head, (head_bwd, bwd) in FAKE_HEADS.items():
            n, f = len(rows), factor * scale
            samples[n] = {
                "head_backward": list(head_bwd * f * rng.uniform(0.99, 1.01, 15)),
                "backward": list(bwd * f * rng.uniform(0.99, 1.01, 15)),
                "step": list(2 * bwd * f * rng.uniform(0.99, 1.01, 15)),
            }
            medians = {f"{p}_ms": float(np.median(v)) for p, v in samples[n].items()}
            rows.append(
                {
                    "trial": n,
                    "status": "complete",
                    "device": "cpu",
                    "head": head,
                    "cudnn_benchmark": "n/a",
                    "onednn": True,
                    "amp": "off",
                    "channels_last": False,
                    "batch_size": bs,
                    "linearize": False,
                    "tf32": "n/a",
                    "compile": "off",
                    **medians,
                    "swapped": "",
                    "forward_ms": 0.5 * bwd * f,
                    "optimizer_ms": 5.0 * f,
                    "head_forward_ms": head_bwd * f / 2,
                    "peak_mem_mb": 1000.0 + 100 * bs + (50 if head == "conv" else 0),
                    "head_forward_tflops": 0.2,
                    "head_backward_tflops": 0.4 / (head_bwd / 10),
                    "head_forward_peak_fraction": 0.5,
                    "head_backward_peak_fraction": 1.0 / (head_bwd / 10),
                    "head_backward_gflop": 4.0,
                    "isolated_head_backward_ms": head_bwd * f,
                    "iterations": 15,
                }
            )
    rows.append(
        {
            "trial": len(rows),
            "status": "failed",
            "device": "cpu",
            "head": "conv",
            "cudnn_benchmark": "n/a",
            "onednn": True,
            "amp": "off",
            "channels_last": True,
            "batch_size": 1,
            "linearize": False,
            "tf32": "n/a",
            "compile": "off",
            "error": "RuntimeError: boom",
        }
    )
    return pd.DataFrame(rows).reindex(columns=TRIAL_COLUMNS), samples
