#!/usr/bin/env bash
# The servers the scale-out tests start on loopback: PostgreSQL from Debian's packages (MLflow's server
# comes with the Python requirements). Needs root for apt-get; a no-op where PostgreSQL is installed.
set -euo pipefail
if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "PostgreSQL is missing: run 'apt-get install postgresql' as root (the scale-out tests need it)" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
