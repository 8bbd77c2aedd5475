"""Env stage: the environment fingerprint (versions, device, threads, precision flags) -> --out (JSON).

Only stable facts go in, so an unchanged machine writes an identical file and DVC re-measures nothing;
a new machine or library version changes it and the sweep runs again.
"""
from __future__ import annotations

import argparse
import platform
import re
import sys
from pathlib import Path

import torch
import torchvision

from pipeline.common import run_stage, stage_parser, write_json
from pipeline.params import Params
from rcnn.knobs import cpu_has_native_bf16, resolve_device


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


def onednn_version() -> str:
    match = re.search(r"oneDNN v([\d.]+)", torch.__config__.show())
    return match.group(1) if match else "n/a"


def fingerprint(device: torch.device) -> dict:
    env = {
        "device": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cpu_model": cpu_model(),
        "cpu_threads": torch.get_num_threads(),
        "onednn": onednn_version(),
        "mkldnn_enabled": torch.backends.mkldnn.enabled,
        "cpu_native_bf16": cpu_has_native_bf16(),
        "cuda": torch.version.cuda or "n/a",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "n/a",
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
                "gpu_memory_gb": round(props.total_memory / 2**30, 1), "gpu_bf16": torch.cuda.is_bf16_supported()}
    return env


def stage(args: argparse.Namespace, params: Params) -> None:
    env = fingerprint(resolve_device(params.sweep.device))
    write_json(args.out, env)
    print(f"{env['device']}: {env.get('gpu', env['cpu_model'])}, torch {env['torch']}")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
