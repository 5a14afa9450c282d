"""The cross-rank view: which rank holds the others up.

One code path serves the live run and the offline ``steptrace cluster RUN_DIR``:

- :func:`window_summary` turns one rank's step records of a window (``cluster_interval``
  steps) into a small summary: medians of step time, data wait, compute / communication /
  blocked time and the phases, with the blocked time taken out of the phase it happened in.
- :class:`ClusterAnalyzer` compares the ranks' summaries of a window and keeps the alert
  episodes: ``straggler`` (a rank's own work, compute + data, above the median of the
  other ranks), ``comm_straggler`` (a rank's communication above the others'),
  ``comm_heavy`` (communication a large share of the step) and ``rank_silent`` (a rank
  that stopped making progress while the others wait for it, or stopped publishing).
- :class:`ClusterExchange` (live) publishes this rank's summaries and heartbeats through
  torch.distributed's own store from a background thread; the aggregating rank reads
  them, and writes ``cluster`` records and the alerts into its own log.

Waiting is measured, not guessed: a rank blocked in a collective because a peer is late
shows it as exposed communication time; what every rank is blocked for (the least any
rank is blocked) is the communication itself, the rest of a rank's exposed time is
waiting for the slowest peer.

The package's modules: :mod:`.options` (the options and their ranges), :mod:`.stats`
(one rank's window summary, the medians), :mod:`.rules` (:class:`ClusterAnalyzer`),
:mod:`.episodes` (the one alert-episode tracker every rule uses), :mod:`.exchange` (the
live store thread), :mod:`.values` (other ranks' store values, parsed and checked one by
one), :mod:`.offline` (a run folder's records) and :mod:`.format` (the text of
``steptrace cluster``).
"""

from __future__ import annotations

from steptrace.cluster.episodes import EpisodeTracker
from steptrace.cluster.exchange import ClusterExchange, LogTail, logger
from steptrace.cluster.format import format_cluster, stragglers_found
from steptrace.cluster.offline import analyze_records
from steptrace.cluster.options import (
    CLUSTER_OPTIONS,
    HW_POWER_KEY,
    HW_TEMP_KEY,
    check_cluster_options,
    wants_exchange,
)
from steptrace.cluster.rules import ClusterAnalyzer
from steptrace.cluster.stats import step_split, window_summary

__all__ = [
    "CLUSTER_OPTIONS",
    "HW_POWER_KEY",
    "HW_TEMP_KEY",
    "ClusterAnalyzer",
    "ClusterExchange",
    "EpisodeTracker",
    "LogTail",
    "analyze_records",
    "check_cluster_options",
    "format_cluster",
    "step_split",
    "stragglers_found",
    "wants_exchange",
    "window_summary",
]
