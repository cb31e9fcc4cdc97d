#!/usr/bin/env bash
# Parses and lints every GDScript file of the Godot addon and its examples with gdtoolkit
# (gdparse, gdlint; settings in gdlintrc beside this script). Exits non-zero on any problem.
# Needs gdtoolkit 4 (pip install "gdtoolkit>=4,<5"); no Godot binary.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# Every .gd file, except addon copies inside example projects and Godot's import cache.
mapfile -t files < <(find . -name '*.gd' -not -path '*/.godot/*' -not -path './examples/*/addons/*' | sort)
if [ "${#files[@]}" -eq 0 ]; then
	echo "check.sh: no .gd files found" >&2
	exit 1
fi
echo "gdparse: ${#files[@]} files"
gdparse "${files[@]}"
echo "gdlint: ${#files[@]} files (config: $(pwd)/gdlintrc)"
gdlint "${files[@]}"
