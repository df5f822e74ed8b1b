#!/usr/bin/env bash
# The layering of src/: a file may include headers of its own room and of the rooms
# below it, never of a room above (util -> model -> kernels -> backend -> runtime ->
# text -> cache -> server -> cli). Prints every violation; exits 1 if there is one.
set -euo pipefail
cd "$(dirname "$0")/../src"
rank() {
  case "$1" in
    util) echo 0 ;; model) echo 1 ;; kernels) echo 2 ;; backend) echo 3 ;; runtime) echo 4 ;;
    text) echo 5 ;; cache) echo 6 ;; server) echo 7 ;; cli) echo 8 ;; *) echo -1 ;;
  esac
}
bad=0
while IFS= read -r f; do
  room=${f%%/*}
  r=$(rank "$room")
  [ "$r" -lt 0 ] && { echo "src/$f: in no known room"; bad=1; continue; }
  while IFS= read -r inc; do
    dep=${inc%%/*}
    d=$(rank "$dep")
    [ "$d" -lt 0 ] && continue  # (not a dsx header)
    if [ "$d" -gt "$r" ]; then
      echo "src/$f includes $inc: $room must not include $dep"
      bad=1
    fi
  done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f")
done < <(find . -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) | sed 's|^\./||' | sort)
[ "$bad" -eq 0 ] && echo "layering: ok"
exit "$bad"
