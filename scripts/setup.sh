#!/usr/bin/env bash
# scripts/setup.sh - installs what lethe needs to build and test, if missing:
# Debian packages (compiler deps; clang for the libFuzzer harnesses; cmake
# builds xgrammar, see scripts/build-xgrammar.sh) and the PyPI packages the
# e2e tests use.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libcjson-dev libpcre2-dev libicu-dev libcurl4-openssl-dev libssl-dev curl python3-pip
      python3-venv clang   # python3-venv: the Python package's fresh-venv test (tests/e2e/test_python_pkg.py)
      chromium   # chromium: the dashboard's browser test (tests/e2e/test_dashboard.py)
      haproxy)   # haproxy: the load balancer of deploy/haproxy.cfg (tests/e2e/test_scaleout.py)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}" >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
py_missing=()
python3 -c 'import openai' 2>/dev/null || py_missing+=("openai>=1.40")
python3 -c 'import pytest' 2>/dev/null || py_missing+=("pytest")
python3 -c 'import requests' 2>/dev/null || py_missing+=("requests")
python3 -c 'import jsonschema' 2>/dev/null || py_missing+=("jsonschema")   # structured-output e2e tests
python3 -c 'import matplotlib' 2>/dev/null || py_missing+=("matplotlib")   # plots: scripts/gen_docs.py
python3 -c 'import websocket' 2>/dev/null || py_missing+=("websocket-client")   # DevTools: test_dashboard.py
if [ ${#py_missing[@]} -gt 0 ]; then
    echo "setup: installing PyPI packages: ${py_missing[*]}" >&2
    python3 -m pip install -q "${py_missing[@]}"
fi
