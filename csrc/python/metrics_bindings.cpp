#include "metrics_bindings.hpp"

#include <string>

#include "../sinks/metric_table.hpp"

namespace steptrace::python {

namespace py = pybind11;
using detail::kMetrics;
using detail::kOtlpInstruments;

namespace {

py::tuple split_labels(std::string_view labels) {
  py::list out;
  while (!labels.empty()) {
    const std::size_t comma = labels.find(',');
    out.append(py::str(std::string(labels.substr(0, comma))));
    labels = comma == std::string_view::npos ? std::string_view{} : labels.substr(comma + 1);
  }
  return py::tuple(out);
}

py::str str(std::string_view s) { return py::str(s.data(), s.size()); }

// One dict per row of metrics.def, in its order; "otlp" is the instrument exporting the
// family over OTLP, or None.
py::list metric_table() {
  py::list rows;
  for (const detail::MetricDef& d : kMetrics) {
    py::dict row;
    row["name"] = str(d.name);
    row["type"] = str(detail::metric_type_name(d.type));
    row["labels"] = split_labels(d.labels);
    row["help"] = str(d.help);
    const detail::BucketBounds bounds = detail::metric_buckets(d.buckets);
    py::list buckets;
    for (std::size_t i = 0; i < bounds.size; ++i) buckets.append(bounds.data[i]);
    row["buckets"] = py::tuple(buckets);
    row["otlp"] = py::none();
    rows.append(row);
  }
  for (const detail::OtlpInstrumentDef& o : kOtlpInstruments) {
    py::dict otlp;
    otlp["name"] = str(o.name);
    otlp["instrument"] = str(o.instrument);
    otlp["unit"] = str(o.unit);
    otlp["description"] = str(o.description);
    rows[static_cast<std::size_t>(o.metric)]["otlp"] = otlp;
  }
  return rows;
}

}  // namespace

void bind_metrics(py::module_& m) {
  m.def("metric_table", &metric_table,
        "The metrics table (csrc/sinks/metrics.def): one dict per Prometheus family (name, "
        "type, labels, help, buckets, otlp), in the exposition's order.");
  m.attr("METRIC_MAX_CLUSTER_ROWS") = detail::kMaxClusterRows;
  m.attr("METRIC_MAX_ALERT_TYPES") = detail::kMaxAlertTypes;
}

}  // namespace steptrace::python
