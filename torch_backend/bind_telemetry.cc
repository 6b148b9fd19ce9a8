// crossbar._C._telemetry: the Python face of the telemetry recorder (telemetry/), used
// by crossbar/telemetry.py. The recorder is the one the collectives write their op
// records into, so a torch job on the crossbar backend gets per-op records for free;
// Python adds step boundaries, phases and the CUDA memory high-water.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "telemetry/aggregate.h"
#include "telemetry/telemetry.h"

namespace py = pybind11;
namespace tel = crossbar::telemetry;

namespace {

py::dict summaryToDict(const tel::StepSummary& s) {
  py::dict d;
  d["rank"] = s.rank;
  d["world"] = s.world_size;
  d["step"] = s.step;
  d["start_ns"] = s.start_ns;
  d["end_ns"] = s.end_ns;
  d["step_ns"] = s.end_ns - s.start_ns;
  d["comm_ns"] = s.comm_ns;
  d["wait_ns"] = s.wait_ns;
  d["ops"] = s.ops;
  d["bytes"] = s.bytes;
  d["dropped"] = s.dropped;
  d["rss_max"] = s.rss_max;
  d["device_mem_max"] = s.device_mem_max;
  py::dict phases;
  for (const auto& [name, ns] : s.phases) phases[py::str(name)] = ns;
  d["phases"] = phases;
  py::dict waited;
  for (const auto& [peer, ns] : s.waited_on) waited[py::int_(peer)] = ns;
  d["waited_on"] = waited;
  return d;
}

}  // namespace

void bindTelemetry(py::module_& m) {
  auto t = m.def_submodule("_telemetry", "telemetry recorder (see crossbar.telemetry)");
  t.def(
      "configure",
      [](bool enabled, int rank, int world_size, const std::string& dir) {
        tel::Recorder& rec = tel::Recorder::instance();
        tel::Config c = rec.config();  // keeps the ring size and the device gauge
        c.enabled = enabled;
        c.rank = rank;
        c.world_size = world_size;
        c.dir = dir;
        rec.configure(std::move(c));
      },
      py::arg("enabled"), py::arg("rank"), py::arg("world_size"), py::arg("dir"),
      "Reconfigures the recorder (drops unflushed records; a directory starts a fresh rank<r>.jsonl).");
  t.def("config", [] {
    tel::Config c = tel::Recorder::instance().config();
    py::dict d;
    d["enabled"] = c.enabled;
    d["rank"] = c.rank;
    d["world_size"] = c.world_size;
    d["dir"] = c.dir;
    d["ring_capacity"] = c.ring_capacity;
    return d;
  });
  t.def("enabled", [] { return tel::Recorder::instance().enabled(); });
  t.def("now_ns", &tel::nowNs, "CLOCK_MONOTONIC in ns (the recorder's clock)");
  t.def("host_rss", &tel::hostRssBytes);
  t.def(
      "record_phase",
      [](const std::string& name, int64_t start_ns, int64_t end_ns) {
        tel::Recorder& rec = tel::Recorder::instance();
        rec.recordPhase(name, start_ns, end_ns);
        rec.sampleMemory();
      },
      py::arg("name"), py::arg("start_ns"), py::arg("end_ns"));
  t.def("sample_memory", [] { tel::Recorder::instance().sampleMemory(); });
  t.def("note_device_memory", [](uint64_t bytes) { tel::Recorder::instance().noteDeviceMemory(bytes); });
  t.def("current_step", [] { return tel::Recorder::instance().currentStep(); });
  t.def(
      "step",
      [] {
        tel::StepSummary s;
        {
          py::gil_scoped_release release;  // drains rings and writes a line
          s = tel::Recorder::instance().step();
        }
        return summaryToDict(s);
      },
      "Ends the current step: one JSON line (when enabled); returns its summary.");
  t.def(
      "aggregate_dir",
      [](const std::string& dir) {
        py::gil_scoped_release release;
        return tel::aggregate(tel::loadDir(dir), tel::AggregateOptions::fromEnv()).toJson();
      },
      py::arg("dir"), "Joins the ranks' rank<r>.jsonl files in `dir`; the report as JSON text.");
}
