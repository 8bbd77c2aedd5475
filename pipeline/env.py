"""Env stage: the environment -> --out (JSON) with two parts.

``fingerprint``: stable facts (versions, device, threads, precision flags). The sweep depends on this part
only (dvc.yaml lists it as a params key), so an unchanged machine re-measures nothing and a new machine
or library version runs the sweep again. ``ceilings``: the measured matmul FLOP/s per dtype and copy
bandwidth, noisy by nature, for the roofline columns.
"""
from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch
import torchvision

from pipeline.common import check_writable, run_stage, stage_parser, write_json
from pipeline.outputs import check_output, json_object, project_root
from pipeline.params import Params, keyed
from rcnn.knobs import DTYPES, cpu_has_native_bf16, resolve_device, set_tf32, why_not
from rcnn.roofline import measure_copy_gbps, measure_matmul_tflops
from rcnn.schema import AMP_DTYPES


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


def gpu_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


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
                "gpu_memory_gb": round(props.total_memory / 2**30, 1), "gpu_bf16": torch.cuda.is_bf16_supported(),
                "gpu_driver": gpu_driver()}
    return env


def ceilings(device: torch.device) -> dict:
    """Measured peaks: matmul TFLOP/s for each dtype the sweep can use on ``device``, copy GB/s."""
    cuda = device.type == "cuda"
    matmul = {name: round(measure_matmul_tflops(device, DTYPES[name], n=8192 if cuda else 2048), 3)
              for amp, name in AMP_DTYPES.items() if why_not("amp", amp, device) is None}
    return {"matmul_tflops": matmul, "copy_gbps": round(measure_copy_gbps(device, 2048 if cuda else 256), 1)}


ENV_FILE = json_object("an env.json", "fingerprint", "ceilings", "device")  # "device": the older flat format


def stage(args: argparse.Namespace, params: Params) -> None:
    check_output(args.out, ENV_FILE, root=project_root(Path(args.params).parent), what="--out")
    check_writable(args.out)
    with keyed("sweep."):
        device = resolve_device(params.sweep.device)
    if device.type == "cuda":
        set_tf32(params.sweep.allow_tf32)  # the fp32 ceiling under the flags the sweep runs with
    env = {"fingerprint": fingerprint(device), "ceilings": ceilings(device)}
    write_json(args.out, env)
    fp = env["fingerprint"]
    print(f"{fp['device']}: {fp.get('gpu', fp['cpu_model'])}, torch {fp['torch']}; ceilings {env['ceilings']}")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
