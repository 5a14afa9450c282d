"""Writes steptrace's Grafana dashboards (grafana/*.json) from one description, so the
three dashboards share their variables, links and panel conventions.

    python grafana/build_dashboards.py          # rewrite the JSON files
    python grafana/build_dashboards.py --check  # exit 1 when a file is out of date

A triage hierarchy: **overview** (the cluster: throughput, power, utilization, jobs, alerts;
each job's panels link to its per-job dashboard with the job pre-selected) -> **job** (one
job's step-time progression, phase split, where the wall clock goes (goodput), per-rank
compute / communication, per-GPU tensor core activity, DRAM bandwidth, SM occupancy, power,
temperature) -> **profiling** (one
run's step records and links to its HTML report and Perfetto trace). Hardware panels use
the NVIDIA DCGM exporter's metric names, so they work beside an existing DCGM exporter, and
show steptrace's own NVML figures (steptrace_gpu_*) beside them; steptrace never exports
DCGM's names itself, which would double every series where the exporter also runs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
METRICS_DEF = HERE.parent / "csrc" / "sinks" / "metrics.def"


def metric_families(path: Path = METRICS_DEF) -> dict[str, str]:
    """The Prometheus families of the metrics table, by id (``steps_total``:
    ``steptrace_steps_total``). Read from the table's file, so building the dashboards needs
    no compiled steptrace."""
    ids = re.findall(r"^STEPTRACE_METRIC\((\w+),", path.read_text(encoding="utf-8"), re.M)
    return {i: f"steptrace_{i}" for i in ids}


# Every metric name below is taken from the table: M.steps_total is "steptrace_steps_total",
# and an id the table lacks fails the build (AttributeError).
M = SimpleNamespace(**metric_families())
DS = {"type": "prometheus", "uid": "${datasource}"}
JOB_LINK = "/d/steptrace-job/steptrace-job?var-job=${__field.labels.job}&${__url_time_range}"
PROFILING_LINK = "/d/steptrace-profiling/steptrace-profiling?var-job=${job}&var-run_id=${__field.labels.run_id}&${__url_time_range}"


def var_datasource() -> dict:
    return {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}


def var_query(name: str, query: str, multi: bool = False) -> dict:
    return {"name": name, "type": "query", "datasource": DS, "query": {"query": query, "refId": name},
            "refresh": 2, "includeAll": multi, "multi": multi, "sort": 1}


def var_text(name: str, default: str, label: str) -> dict:
    return {"name": name, "type": "textbox", "label": label, "query": default,
            "current": {"text": default, "value": default}}


class Panels:
    """Lays panels out on Grafana's 24-column grid, left to right, top to bottom."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.x = self.y = self.row_h = 0

    def add(self, title: str, kind: str, targets: list[tuple[str, str]], *, w: int = 12, h: int = 8,
            unit: str = "short", links: list[dict] | None = None, description: str = "",
            options: dict | None = None, overrides: list[dict] | None = None) -> None:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel = {
            "id": len(self.items) + 1, "type": kind, "title": title, "description": description,
            "datasource": DS, "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(targets)],
            "fieldConfig": {"defaults": {"unit": unit, "links": links or []}, "overrides": overrides or []},
            "options": options or {},
        }
        self.items.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def text(self, title: str, content: str, *, w: int = 24, h: int = 4) -> None:
        self.add(title, "text", [], w=w, h=h, options={"mode": "markdown", "content": content})
        self.items[-1].pop("datasource")
        self.items[-1].pop("targets")


def dashboard(uid: str, title: str, variables: list[dict], panels: Panels, links: list[dict]) -> dict:
    return {
        "uid": uid, "title": title, "tags": ["steptrace"], "schemaVersion": 39, "version": 1,
        "editable": True, "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
        "templating": {"list": variables}, "panels": panels.items, "links": links,
        "annotations": {"list": []},
    }


def nav(uid: str, title: str, keep: bool = True) -> dict:
    return {"type": "link", "title": title, "url": f"/d/{uid}", "keepTime": True, "includeVars": keep,
            "icon": "dashboard", "targetBlank": False}


def overview() -> dict:
    p = Panels()
    job_link = [{"title": "Open the job's dashboard", "url": JOB_LINK}]
    p.add("Step throughput by job (steps/s)", "timeseries",
          [(f"sum by (job) (rate({M.steps_total}[5m]))", "{{job}}")], links=job_link, unit="short")
    p.add("Active jobs", "stat", [(f"count(count by (job) (rate({M.steps_total}[5m]) > 0))", "jobs")],
          w=6, unit="none")
    p.add("Alerts in the last hour", "stat", [(f"sum(increase({M.alerts_total}[1h]))", "alerts")],
          w=6, unit="none")
    p.add("Jobs: throughput, p95 step, alerts (click a job)", "table", [
        (f"sum by (job) (rate({M.steps_total}[5m]))", "steps/s"),
        ("steptrace:step_duration_seconds:p95_5m", "p95 step"),
        (f"sum by (job) (increase({M.alerts_total}[1h]))", "alerts 1h"),
    ], w=24, links=job_link, options={"showHeader": True})
    p.add("GPU power by host (DCGM / steptrace)", "timeseries",
          [("sum by (Hostname) (DCGM_FI_DEV_POWER_USAGE)", "{{Hostname}} (DCGM)"),
           (f"sum by (host) ({M.gpu_power_watts})", "{{host}} (steptrace)")],
          unit="watt", description="Where no DCGM exporter runs, steptrace's own NVML figures (one series per rank).")
    p.add("GPU utilization (DCGM; recorded, never paged)", "timeseries",
          [("avg by (Hostname) (DCGM_FI_DEV_GPU_UTIL)", "{{Hostname}}")], unit="percent")
    p.add("Alerts by type and job", "timeseries",
          [(f"sum by (job, type) (increase({M.alerts_total}[10m]))", "{{job}} {{type}}")],
          w=24, links=job_link, unit="none")
    return dashboard("steptrace-overview", "steptrace overview", [var_datasource()], p,
                     [nav("steptrace-job", "Job"), nav("steptrace-profiling", "Profiling")])


def right_axis(ref_id: str, unit: str) -> dict:
    """A field override: the query ``ref_id`` on a right-hand axis in ``unit``."""
    return {"matcher": {"id": "byFrameRefID", "options": ref_id},
            "properties": [{"id": "unit", "value": unit}, {"id": "custom.axisPlacement", "value": "right"}]}


def useful_work(p: Panels, sel: str) -> None:
    """MFU per rank beside the tensor cores' activity and the GPU's power, and tokens/s
    (docs/useful-work.md)."""
    p.add("MFU per rank, beside tensor-core activity and power", "timeseries", [
        (f"{M.mfu_ratio}{{{sel}}}", "r{{rank}} MFU"),
        (f"{M.tensor_active_ratio}{{{sel}}}", "r{{rank}} tensor cores active"),
        (f"{M.gpu_power_watts}{{{sel}}}", "r{{rank}} power"),
    ], w=16, unit="percentunit", overrides=[right_axis("C", "watt")],
          description="MFU: the last step's model FLOP/s over the device's peak (run_start.work says which "
                      "peak). Tensor cores busy at high power with a low MFU: the work is not the model's "
                      "(padding, recomputation, small matrices); a rank below the others: its steps are "
                      "slower for the same FLOPs.")
    p.add("Throughput: tokens/s and samples/s", "timeseries", [
        (f"sum(rate({M.tokens_total}{{{sel}}}[5m]))", "job tokens/s (5m, wall clock)"),
        (f"{M.tokens_per_second}{{{sel}}}", "r{{rank}} tokens/s (last step)"),
        (f"sum(rate({M.samples_total}{{{sel}}}[5m]))", "job samples/s (5m, wall clock)"),
    ], w=8, unit="short",
          description="The job's rate over the wall clock (evaluation and checkpoints included), summed over "
                      "the selected ranks, and each rank's rate over its last step's training iteration.")


def job() -> dict:
    p = Panels()
    sel = 'job="$job", rank=~"$rank"'
    run_link = [{"title": "Profile this run", "url": PROFILING_LINK}]
    p.add("Step time (p50 / p95, all ranks)", "timeseries", [
        (f"histogram_quantile(0.5, sum by (le) (rate({M.step_duration_seconds}_bucket{{{sel}}}[5m])))", "p50"),
        (f"histogram_quantile(0.95, sum by (le) (rate({M.step_duration_seconds}_bucket{{{sel}}}[5m])))", "p95"),
        (f"max({M.step_median_seconds}{{{sel}}})", "trailing median"),
    ], unit="s", links=run_link)
    p.add("Phase split (seconds per second of training)", "timeseries",
          [(f"sum by (phase) (rate({M.phase_duration_seconds}_sum{{{sel}}}[5m]))", "{{phase}}"),
           (f"sum(rate({M.data_wait_seconds_total}{{{sel}}}[5m]))", "data wait")],
          unit="s", options={"stacking": {"mode": "normal"}})
    wall = f"(sum(rate({M.time_seconds_total}{{{sel}}}[5m])) > 0)"
    p.add("Where the wall clock goes (seconds per second, by kind)", "timeseries",
          [(f"sum by (kind) (rate({M.time_seconds_total}{{{sel}}}[5m]))", "{{kind}}")],
          w=16, unit="s", options={"stacking": {"mode": "normal"}},
          description="Summed over the selected ranks (n ranks stack to n): training steps (less the "
                      "evaluation / checkpoint intervals inside them), the loader's waits (data, where the "
                      "loader is wrapped), evaluation, checkpoints, and other host work between steps. Time "
                      "is booked when the step after it ends, so a long evaluation shows when training "
                      "resumes.")
    p.add("Goodput: training share of the wall clock", "timeseries", [
        (f'sum(rate({M.time_seconds_total}{{{sel}, kind="step"}}[5m])) / {wall}', "training (goodput)"),
        (f"sum(rate({M.runq_wait_seconds_total}{{{sel}}}[5m])) / {wall}", "waiting for a CPU"),
    ], w=8, unit="percentunit",
          description="The share of the wall clock spent in training steps (recorded job-wide as "
                      "steptrace:goodput_ratio_5m:job; never alerted on), and the share the training thread "
                      "was runnable but waiting for a CPU (host contention, a ticket, never a page).")
    p.add("The job's waste by cause (seconds lost per second, across attempts)", "timeseries",
          [(f"sum by (cause) (rate({M.badput_seconds_total}{{{sel}}}[5m]))", "{{cause}}")],
          w=16, unit="s", options={"stacking": {"mode": "normal"}},
          description="Summed over the selected ranks (n ranks stack to n; x GPUs = GPU-hours lost): steps "
                      "above the ideal step time (slow_steps), the steps a failed attempt lost "
                      "(wasted_progress) and the restart's gap (recovery: booked when the next attempt "
                      "starts), startup, data, checkpoint save and restore, evaluation, compile, waiting for a "
                      "CPU (host_contention) and other. `steptrace goodput JOB_ROOT` gives the same table "
                      "offline, in GPU-hours and money (docs/goodput.md).")
    p.add("Job goodput across attempts", "timeseries",
          [(f"min({M.job_goodput_ratio}{{{sel}}})", "job goodput")], w=8, unit="percentunit",
          description="Productive training time (at the ideal step time) over all the wall clock the job "
                      "has used, its earlier attempts included; the lowest rank's view.")
    p.add("Compute / communication / exposed communication per rank", "timeseries", [
        (f"sum by (rank) (rate({M.compute_seconds_total}{{{sel}}}[5m]))", "compute r{{rank}}"),
        (f"sum by (rank) (rate({M.comm_seconds_total}{{{sel}}}[5m]))", "comm r{{rank}}"),
        (f"sum by (rank) (rate({M.comm_exposed_seconds_total}{{{sel}}}[5m]))", "blocked r{{rank}}"),
    ], w=24, unit="s",
          description="A straggler's rank has more compute; the ranks waiting for it have more blocked time.")
    p.add("Collective bandwidth per rank (bus / algorithm)", "timeseries", [
        (f"{M.comm_busbw_bytes_per_second}{{{sel}}}", "bus r{{rank}}"),
        (f"{M.comm_algbw_bytes_per_second}{{{sel}}}", "alg r{{rank}}"),
    ], w=24, unit="Bps",
          description="Each rank's collectives of its last step with known sizes, as nccl-tests defines them: "
                      "algorithm bandwidth is the payload over the time a collective was outstanding, bus "
                      "bandwidth that times the collective's bus factor (all-reduce 2(n-1)/n), comparable "
                      "with the link's peak. A rank far below the others has a slow link (comm_straggler); "
                      "waiting for a late rank lowers it on the waiting ranks too.")
    useful_work(p, sel)
    p.add("Tensor-core activity per GPU", "timeseries", [
        (f"{M.tensor_active_ratio}{{{sel}}}", "r{{rank}} (steptrace)"),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "{{Hostname}} gpu {{gpu}} (DCGM)"),
    ], w=8, unit="percentunit")
    p.add("DRAM bandwidth per GPU", "timeseries", [
        (f"{M.dram_throughput_ratio}{{{sel}}}", "r{{rank}} (steptrace)"),
        ("DCGM_FI_PROF_DRAM_ACTIVE", "{{Hostname}} gpu {{gpu}} (DCGM)"),
    ], w=8, unit="percentunit")
    p.add("SM occupancy per GPU", "timeseries", [
        (f"{M.sm_occupancy_ratio}{{{sel}}}", "r{{rank}} (steptrace)"),
        ("DCGM_FI_PROF_SM_OCCUPANCY", "{{Hostname}} gpu {{gpu}} (DCGM)"),
    ], w=8, unit="percentunit")
    p.add("GPU power (DCGM / steptrace)", "timeseries", [
        ("DCGM_FI_DEV_POWER_USAGE", "{{Hostname}} gpu {{gpu}} (DCGM)"),
        (f"{M.gpu_power_watts}{{{sel}}}", "r{{rank}} (steptrace)"),
        (f"max({M.gpu_power_limit_watts}{{{sel}}})", "power limit"),
    ], unit="watt")
    p.add("GPU temperature (DCGM / steptrace)", "timeseries", [
        ("DCGM_FI_DEV_GPU_TEMP", "{{Hostname}} gpu {{gpu}} (DCGM)"),
        (f"{M.gpu_temperature_celsius}{{{sel}}}", "r{{rank}} (steptrace)"),
    ], unit="celsius")
    p.add("Straggler score by rank (cross-rank view)", "timeseries",
          [(f'{M.rank_straggler_score}{{job="$job"}}', "r{{rank}}")], unit="percentunit",
          description="Each rank's own work (compute + data) over the other ranks' median, minus 1, per "
                      "cluster window (exported by the aggregating rank, at most 64 ranks: the stragglers "
                      "first). 0.1 is the straggler threshold.")
    p.add("Per-rank split of a step (cross-rank view)", "timeseries",
          [(f'{M.rank_split_seconds}{{job="$job"}}', "r{{rank}} {{part}}")], unit="s",
          options={"stacking": {"mode": "normal"}},
          description="Median per step in the last window: compute, communication net of waiting, waiting "
                      "on slower ranks, data loading.")
    p.add("GPU energy and throttling (steptrace)", "timeseries", [
        (f"sum by (rank) (rate({M.gpu_energy_joules_total}{{{sel}}}[5m]))", "r{{rank}} W (energy rate)"),
        (f"sum by (rank, reason) (rate({M.gpu_throttled_steps_total}{{{sel}}}[5m]))",
         "r{{rank}} throttled steps/s {{reason}}"),
    ], unit="short")
    p.add("Memory per rank", "timeseries", [(f'{M.memory_bytes}{{{sel}, kind=~"allocated|rss|device_used"}}',
                                              "r{{rank}} {{kind}}")], unit="bytes")
    p.add("Alerts", "table", [(f"sum by (rank, type) (increase({M.alerts_total}{{{sel}}}[$__range]))", "")],
          unit="none")
    variables = [var_datasource(), var_query("job", f"label_values({M.steps_total}, job)"),
                 var_query("rank", f'label_values({M.steps_total}{{job="$job"}}, rank)', multi=True)]
    return dashboard("steptrace-job", "steptrace job", variables, p,
                     [nav("steptrace-overview", "Overview", keep=False), nav("steptrace-profiling", "Profiling")])


def profiling() -> dict:
    p = Panels()
    sel = 'job="$job", run_id="$run_id"'
    p.text("Reports of this run", (
        "The run's own files, written next to its logs (`steptrace report RUN -o report.html`, "
        "`steptrace export RUN --format chrome -o trace.json`):\n\n"
        "* [HTML report](${report_base_url}/${run_id}/report.html)\n"
        "* [Perfetto / Chrome trace](${report_base_url}/${run_id}/trace.json) "
        "(open in https://ui.perfetto.dev)\n"
        "* `steptrace cluster RUN_DIR` names a straggler rank"))
    p.add("Step time by rank", "timeseries",
          [(f"rate({M.step_duration_seconds}_sum{{{sel}}}[1m]) / rate({M.step_duration_seconds}_count{{{sel}}}[1m])",
            "r{{rank}}")], unit="s")
    p.add("Time in flight of the running step", "timeseries",
          [(f"{M.step_in_flight_seconds}{{{sel}}}", "r{{rank}}"),
           (f"5 * {M.step_median_seconds}{{{sel}}}", "stall limit r{{rank}}")], unit="s")
    p.add("Phase p95 by phase", "timeseries",
          [(f"histogram_quantile(0.95, sum by (phase, le) (rate({M.phase_duration_seconds}_bucket{{{sel}}}[5m])))",
            "{{phase}}")], unit="s")
    p.add("Steps and error steps", "timeseries",
          [(f"sum(rate({M.steps_total}{{{sel}}}[5m]))", "steps/s"),
           (f"sum(rate({M.error_steps_total}{{{sel}}}[5m]))", "error steps/s")], unit="short")
    variables = [var_datasource(), var_query("job", f"label_values({M.steps_total}, job)"),
                 var_query("run_id", f'label_values({M.steps_total}{{job="$job"}}, run_id)'),
                 var_text("report_base_url", "http://reports.example/steptrace", "report server")]
    return dashboard("steptrace-profiling", "steptrace profiling", variables, p,
                     [nav("steptrace-overview", "Overview", keep=False), nav("steptrace-job", "Job")])


DASHBOARDS = {"steptrace-overview.json": overview, "steptrace-job.json": job, "steptrace-profiling.json": profiling}


def render(build) -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str]) -> int:
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = HERE / name, render(build)
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)} (run python grafana/build_dashboards.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
