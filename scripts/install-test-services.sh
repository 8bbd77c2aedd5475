#!/usr/bin/env bash
# What the tests start beside Python: PostgreSQL from Debian's packages for the scale-out tests (MLflow's
# server comes with the Python requirements), and Chromium for the doctor's report.html rendered headless
# (tests/browser.py). Needs root for apt-get; a no-op where both are installed.
set -euo pipefail
missing=()
if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    missing+=(postgresql)
fi
if ! command -v chromium >/dev/null; then
    missing+=(chromium fonts-dejavu-core)  # a font, so that screenshots show text
fi
if [ "${#missing[@]}" = 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "${missing[*]} missing: run 'apt-get install ${missing[*]}' as root (the tests need them)" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
