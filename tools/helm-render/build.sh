#!/usr/bin/env bash
# Build tools/helm-render offline, in GOPATH mode, against the Go sources that Debian packages:
#   apt-get install -y golang-go golang-github-masterminds-sprig-dev golang-gopkg-yaml.v3-dev
# Usage: tools/helm-render/build.sh [OUTPUT]   (default: $TMPDIR/kvxfer-helm-render/helm-render)
# The Go build cache lives next to the output, so a second build is a no-op in about a second.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-${TMPDIR:-/tmp}/kvxfer-helm-render/helm-render}"
gocode="${GOCODE:-/usr/share/gocode}"
command -v go >/dev/null || { echo "go not found: apt-get install -y golang-go" >&2; exit 3; }
for pkg in github.com/Masterminds/sprig gopkg.in/yaml.v3; do
  [ -d "$gocode/src/$pkg" ] || {
    echo "$gocode/src/$pkg missing: apt-get install -y golang-github-masterminds-sprig-dev golang-gopkg-yaml.v3-dev" >&2
    exit 3
  }
done
work="$(dirname "$out")"
mkdir -p "$work"
cache="$work/gocache"
# Debian installs module-major-version packages without their /vN suffix (sprig v3 lies in
# .../Masterminds/sprig). A GOPATH overlay of symlinks gives them their import paths back.
overlay="$work/gopath"
for mod in github.com/Masterminds/sprig github.com/Masterminds/semver; do
  mkdir -p "$overlay/src/$mod"
  ln -sfn "$gocode/src/$mod" "$overlay/src/$mod/v3"
done
# GOPATH mode with GOPROXY=off and no GOFLAGS: nothing is fetched from the network.
cd "$here"
env GO111MODULE=off GOPATH="$overlay:$gocode" GOCACHE="$cache" GOPROXY=off GOFLAGS= CGO_ENABLED=0 \
  go build -trimpath -o "$out" .
echo "$out"
