#!/usr/bin/env bash
# Installs the Debian packages dsx builds against (idempotent).
set -euo pipefail
pkgs=(build-essential cmake pkg-config git libgtest-dev nlohmann-json3-dev libpcre2-dev libutf8proc-dev libssl-dev libxxhash-dev libcpp-httplib-dev python3-numpy python3-torch)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
