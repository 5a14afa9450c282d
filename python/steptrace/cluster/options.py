"""The cross-rank view's options: their defaults, their allowed ranges, and whether a
profiler runs the exchange at all."""

from __future__ import annotations

from typing import Any, Mapping

from steptrace._options import OPTION_GROUPS, PYTHON_OPTIONS
from steptrace.errors import ConfigError

# Options of the cross-rank view (keyword arguments of steptrace.Profiler) and their
# defaults, from the option table (include/steptrace/config_options.def: what each means):
# cluster (auto: on when torch.distributed runs with more than one rank), the window
# (cluster_interval steps), the rank that writes cluster records, how often summaries are
# published (cluster_poll_s), when a rank is silent, the straggler / comm / hot-GPU rules.
CLUSTER_OPTIONS: dict[str, Any] = {k: v for k, v in PYTHON_OPTIONS.items()
                                   if OPTION_GROUPS[k] == "cluster"}

_RANGES: dict[str, tuple[float, float]] = {
    "cluster_interval": (2, 1_000_000),
    "cluster_rank": (0, 1 << 20),
    "cluster_poll_s": (0.05, 600),
    "cluster_silent_s": (0.1, 86_400),
    "straggler_pct": (0.1, 1000),
    "straggler_windows": (1, 1000),
    "straggler_min_ms": (0, 1e6),
    "straggler_min_s": (0, 86_400),
    "comm_imbalance_pct": (0.1, 1000),
    "comm_share_pct": (0.1, 100),
    "compute_comm_ratio": (0.01, 1000),
    "cluster_max_rows": (1, 1 << 20),
    "hot_gpu_c": (0.1, 100),
    "hot_gpu_power_pct": (0.1, 1000),
}

# The step record's hw fields the cross-rank view compares (issue 14's NVML figures).
HW_TEMP_KEY = "max_temp_c"
HW_POWER_KEY = "power_w"


def check_cluster_options(options: Mapping[str, Any]) -> None:
    """Raises ConfigError naming a bad value and what is allowed."""
    mode = options["cluster"]
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"option cluster={mode!r} is not allowed; allowed: 'auto', 'on', 'off'")
    for key, (lo, hi) in _RANGES.items():
        value = options[key]
        if not lo <= value <= hi:
            raise ConfigError(f"option {key}={value!r} is out of range; allowed: {lo:g}..{hi:g}")


def wants_exchange(mode: str, world_size: int) -> bool:
    """Whether a profiler with option ``cluster=mode`` runs the exchange: never for a single
    process; with ``auto`` whenever the run has several ranks (the store is looked up once
    torch.distributed is initialized)."""
    return mode != "off" and world_size >= 2
