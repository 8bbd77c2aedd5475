#!/usr/bin/env bash
# reports/doctor/: the doctor on the project's detector (both heads) and four torchvision models, on this
# machine, with small inputs (a CPU takes about ten minutes). Each model gets DIR/{modules,why}.csv, env.json,
# report.html and trace.json, and DIR.txt, the printout; reports/doctor/pictures/ two more with a screenshot of
# report.html (headless Chromium). Run from the project folder: bash scripts/doctor-reports.sh
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
# reports/doctor/pictures/: report.html, trace.json and a screenshot of the page (headless Chromium)
pictures() {  # folder name, then the doctor's arguments
    local name=$1; shift
    .venv/bin/python -m rcnn.doctor "$@" --top 12 --out "reports/doctor/pictures/$name" \
        > "reports/doctor/pictures/$name.txt"
    chromium --headless --no-sandbox --disable-gpu --virtual-time-budget=5000 --window-size=1400,1100 \
        --screenshot="reports/doctor/pictures/$name.png" "file://$PWD/reports/doctor/pictures/$name/report.html"
    echo "reports/doctor/pictures/$name: done"
}
pictures detector_conv detector:conv --image-size 256 --batch-size 2
pictures mobilenet_v3_large torchvision:mobilenet_v3_large --image-size 128 --batch-size 2
