"""What the device check scripts share: the PASS/FAIL table and reading steps back."""

from __future__ import annotations

import steptrace


class Checks:
    """Collects named checks; table() prints them and gives the exit code."""

    def __init__(self) -> None:
        self.results: list[tuple[str, str, bool]] = []

    def __call__(self, name: str, detail: str, ok: bool) -> None:
        self.results.append((name, detail, ok))

    def table(self) -> int:
        width = max((len(n) for n, _, _ in self.results), default=0)
        for name, detail, ok in self.results:
            print(f"{'PASS' if ok else 'FAIL'}  {name:<{width}}  {detail}")
        return 0 if self.results and all(ok for _, _, ok in self.results) else 1


def steps(path) -> list[dict]:
    return [r for r in steptrace.read(path) if r["kind"] == "step"]
