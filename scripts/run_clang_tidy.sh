#!/usr/bin/env bash
# clang-tidy (the repo's .clang-tidy) over C++ files of csrc/ (or any files named).
#
#   scripts/run_clang_tidy.sh [-p BUILD_DIR] [--base REV] [FILE.cpp ...]
#
# Without files: the .cpp files changed against REV (default HEAD; staged, unstaged and
# untracked, so `--base HEAD~3` covers the last three commits and the work on top), and
# for each changed header the .cpp of the same name beside it, where there is one (a header
# is checked through a file that includes it: HeaderFilterRegex is csrc/).
# BUILD_DIR (default build/dev, else the first build/*/ with a compile database) must be a
# configured CMake build; its compile_commands.json is made by re-running CMake with
# CMAKE_EXPORT_COMPILE_COMMANDS=ON where it is missing (`ninja -t compdb` lists the link and
# custom rules too, with empty commands).
#
# -std: CMake's cxx_std_17 adds no -std flag with GCC 12, whose default is already gnu++17,
# so the compile database has none; clang-tidy 14 (clang's default: gnu++14) then parses
# every file as C++14 and fails in <optional>, <string_view>, ... ("no template named
# 'optional' in namespace 'std'"). The flag is added here, as GCC compiles the files.
set -euo pipefail

cd "$(dirname "$0")/.."
build=""
base=HEAD
while [[ $# -gt 0 ]]; do
  case "$1" in
    -p) build="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    *) break ;;
  esac
done
if [[ -z "$build" ]]; then
  for d in build/dev build/*/; do
    d="${d%/}"
    if [[ -f "$d/compile_commands.json" || -f "$d/CMakeCache.txt" ]]; then
      build="$d"
      break
    fi
  done
fi
if [[ -z "$build" || ! -f "$build/CMakeCache.txt" ]]; then
  echo "run_clang_tidy: no configured build directory (give one with -p BUILD_DIR)" >&2
  exit 2
fi
if [[ ! -f "$build/compile_commands.json" ]]; then
  cmake -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "$build" >/dev/null
fi

files=("$@")
if [[ ${#files[@]} -eq 0 ]]; then
  mapfile -t changed < <({
    git diff --name-only "$base" -- csrc
    git ls-files --others --exclude-standard -- csrc
  } | sort -u)
  for f in "${changed[@]}"; do
    [[ -f "$f" ]] || continue
    case "$f" in
      *.cpp) files+=("$f") ;;
      *.hpp) [[ -f "${f%.hpp}.cpp" ]] && files+=("${f%.hpp}.cpp") ;;
    esac
  done
  mapfile -t files < <(printf '%s\n' "${files[@]}" | sort -u | sed '/^$/d')
fi
if [[ ${#files[@]} -eq 0 ]]; then
  echo "run_clang_tidy: no changed C++ file"
  exit 0
fi

status=0
for f in "${files[@]}"; do
  echo "== $f"
  if ! grep -qF "\"file\": \"$PWD/$f\"" "$build/compile_commands.json"; then
    echo "   skipped: not in $build's compile database (csrc/python: see docs/development.md)"
    continue
  fi
  # stderr: only what is not the count of warnings in headers outside csrc/
  clang-tidy -p "$build" --quiet --extra-arg=-std=gnu++17 "$f" \
    2> >(grep -v ' warnings\? generated\.$' >&2) || status=1
done
exit $status
