#!/usr/bin/env bash
# Fails when an ELF file under the given directories has an RPATH/RUNPATH with an empty
# entry: the loader reads an empty entry as the current directory, so a program started
# from an untrusted directory could load libraries from it.
set -euo pipefail
bad=0 checked=0
for dir in "$@"; do
  while IFS= read -r -d '' f; do
    head -c4 "$f" 2>/dev/null | grep -q $'\x7fELF' || continue
    path=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(R\(UN\)\?PATH).*\[\(.*\)\]$/\2/p')
    [[ -z "$path" ]] && continue
    checked=$((checked + 1))
    if [[ "$path" == :* || "$path" == *: || "$path" == *::* ]]; then
      echo "empty RPATH entry (= current directory) in $f: [$path]"
      bad=$((bad + 1))
    fi
  done < <(find "$dir" -type f \( -name '*.so*' -o -perm -u+x \) -print0)
done
echo "checked $checked files with an RPATH, $bad with an empty entry"
[[ $checked -gt 0 && $bad -eq 0 ]]
