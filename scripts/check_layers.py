#!/usr/bin/env python3
"""Fails (exit 1, one line per offending include) when an include in csrc/ runs against
the layers (docs/architecture.md):

    core      the records, the step recorder's parts, the record pipeline, detect/ (the
              detectors), host/ (the host readers): includes core and the public headers only
    sinks     where records go (JSONL file, Prometheus): core
    backends  clocks, CUDA, CUPTI, NVML: backends and the public headers
    runtime   puts backends, pipeline and sinks together: everything
    torch, python   adapters and bindings on top: everything

Run by the build (the steptrace_layers target) and by tests/python/test_layers.py.
    python3 scripts/check_layers.py csrc
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ALLOWED = {
    "core": {"core"},
    "sinks": {"sinks", "core"},
    "backends": {"backends"},
    "runtime": {"runtime", "core", "sinks", "backends"},
    "torch": {"torch", "core", "sinks", "backends", "runtime"},
    "python": {"python", "core", "sinks", "backends", "runtime", "torch"},
}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def layer_of(path: Path, root: Path) -> str | None:
    try:
        return path.resolve().relative_to(root).parts[0]
    except (ValueError, IndexError):
        return None


def violations(root: Path) -> list[str]:
    root = root.resolve()
    found = []
    for source in sorted(root.rglob("*")):
        if source.suffix not in {".cpp", ".hpp", ".h", ".cc"}:
            continue
        layer = layer_of(source, root)
        if layer not in ALLOWED:
            continue
        for match in _INCLUDE.finditer(source.read_text(errors="replace")):
            name = match.group(1)
            if name.startswith("steptrace/"):
                continue  # the public headers: every layer may use them
            # Resolved as the compiler does: next to the file, else from csrc/.
            target = source.parent / name
            if not target.exists():
                target = root / name
            target_layer = layer_of(target, root)
            if target_layer is not None and target_layer not in ALLOWED[layer]:
                line = source.read_text(errors="replace")[:match.start()].count("\n") + 1
                found.append(f"{source.relative_to(root.parent)}:{line}: {layer}/ includes "
                             f"{target_layer}/ (\"{name}\"); {layer}/ may include "
                             f"{', '.join(sorted(ALLOWED[layer]))} and steptrace/ only")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent / "csrc")
    if not root.is_dir():
        print(f"check_layers: {root} is not a directory (give the csrc/ folder)", file=sys.stderr)
        return 2
    bad = violations(root)
    for line in bad:
        print(line, file=sys.stderr)
    if bad:
        print(f"check_layers: {len(bad)} include(s) against the layers (docs/architecture.md)",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
