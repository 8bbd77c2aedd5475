#!/usr/bin/env bash
# Wheels for a GPU machine whose Python 3.12 image has torch, pandas, matplotlib, scipy, tabulate and
# pyyaml but not optuna or mlflow, and no registry: downloads them into .whl (git-ignored) to carry.
# mlflow-skinny (with SQLAlchemy and Alembic for the sqlite store) is enough for logging.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
  optuna==5.0.0 mlflow-skinny==3.17.2 mlflow-tracing==3.17.2 sqlalchemy alembic
# Already on the image: carrying a second version would shadow the one torch was built against.
for name in annotated_doc anyio certifi charset_normalizer click cloudpickle h11 idna markupsafe numpy \
            packaging protobuf pyyaml requests tqdm typing_extensions urllib3 zipp; do
  rm -f .whl/"$name"-*.whl
done
du -sh .whl
