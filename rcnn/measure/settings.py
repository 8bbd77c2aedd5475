"""The names of the settings a measurement runs under, without torch: devices and autocast dtypes, with the
rules their values follow (rcnn.rules.Rule), checked alike in params.yaml and on command lines."""

from __future__ import annotations

from rcnn.rules import Rule

# rcnn.measure.device.resolve_device's names; auto picks CUDA when there is a GPU
DEVICES = (
    "auto",
    "cpu",
    "cuda",
)
DEVICE = Rule(choices=DEVICES)
# Autocast setting -> the dtype its matmuls run in
AMP_DTYPES = {
    "off": "fp32",
    "fp16": "fp16",
    "bf16": "bf16",
}
AMP = Rule(choices=AMP_DTYPES)
# A batch size search's memory limit (rcnn.measure.batch), MiB
MEMORY_LIMIT_MB = Rule(minimum=1)
AUTO = "auto"  # a batch size to find (the largest that fits, and a few below it), not given


def peak_dtype(amp: str, tf32: object) -> str:
    """The dtype whose measured matmul peak (rcnn.measure.machine.ceilings) a setting's FLOP/s compare
    against: fp32 with TF32 on is ``tf32``. ``tf32`` as a table holds it too ('True', 'n/a')."""
    return "tf32" if str(tf32) == "True" and amp == "off" else AMP_DTYPES[amp]


def machine_name(fingerprint: dict) -> str:
    """The GPU, else the CPU model, that a fingerprint (rcnn.measure.machine) names: what a header says a run
    ran on."""
    return fingerprint.get("gpu", fingerprint.get("cpu_model", fingerprint.get("device", "?")))
