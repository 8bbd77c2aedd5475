#!/usr/bin/env bash
# reports/doctor/: the doctor on the project's detector (both heads) and four torchvision models, on this
# machine, with small inputs (a CPU takes about ten minutes). Each model gets DIR/{modules,why}.csv, env.json
# and DIR.txt, the printout. Run from the project folder: bash scripts/doctor-reports.sh
set -euo pipefail
cd "$(dirname "$0")/.."
run() {  # folder name, then the doctor's arguments
    local name=$1; shift
    .venv/bin/python -m rcnn.doctor "$@" --top 12 --out "reports/doctor/$name" > "reports/doctor/$name.txt"
    echo "reports/doctor/$name: done"
}
run detector_conv detector:conv --image-size 256 --batch-size 2
run detector_linear detector:linear --image-size 256 --batch-size 2
run vit_b_16 torchvision:vit_b_16 --image-size 128 --batch-size 2
run mobilenet_v3_large torchvision:mobilenet_v3_large --image-size 128 --batch-size 2
run convnext_tiny torchvision:convnext_tiny --image-size 128 --batch-size 2
run r3d_18 torchvision:r3d_18 --image-size 64 --frames 8 --batch-size 2
