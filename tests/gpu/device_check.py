"""What the device check scripts share: the PASS/FAIL table and reading steps back."""

from __future__ import annotations

import steptrace


def cuda_device():
    """The CUDA device to check, after printing what it is; None (said) without one."""
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return None
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    return torch.device("cuda")


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
