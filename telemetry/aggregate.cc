#include "telemetry/aggregate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include "comm/env.h"
#include "comm/store.h"

namespace crossbar::telemetry {

AggregateOptions AggregateOptions::fromEnv() {
  AggregateOptions o;
  o.creep_bytes_per_step = env::getSize("CROSSBAR_TELEMETRY_CREEP_BYTES");
  o.stall_ns = env::getMillis("CROSSBAR_TELEMETRY_STALL_MS") * 1'000'000;
  return o;
}

namespace {

// Just enough JSON for our own lines: one object of integers, strings skipped, and one
// nested objects of integers ("phases", "waited_on"). Anything else makes the line invalid.
class LineParser {
 public:
  explicit LineParser(std::string_view s) : s_(s) {}

  bool parse(StepSummary& out) {
    if (!eat('{')) return false;
    bool have_rank = false, have_step = false, have_end = false;
    if (peek() == '}') return false;
    while (true) {
      std::string key;
      if (!str(key) || !eat(':')) return false;
      if (key == "phases" || key == "waited_on") {
        if (!eat('{')) return false;
        if (peek() != '}') {
          while (true) {
            std::string name;
            int64_t v;
            if (!str(name) || !eat(':') || !num(v)) return false;
            if (key == "phases") {
              out.phases.emplace_back(std::move(name), v);
            } else {
              char* end = nullptr;
              long peer = std::strtol(name.c_str(), &end, 10);
              if (name.empty() || *end) return false;
              out.waited_on.emplace_back(int(peer), v);
            }
            if (eat(',')) continue;
            break;
          }
        }
        if (!eat('}')) return false;
      } else if (peek() == '"') {
        std::string ignored;
        if (!str(ignored)) return false;
      } else {
        int64_t v;
        if (!num(v)) return false;
        if (key == "rank")
          out.rank = int(v), have_rank = true;
        else if (key == "world")
          out.world_size = int(v);
        else if (key == "step")
          out.step = uint64_t(v), have_step = true;
        else if (key == "start_ns")
          out.start_ns = v;
        else if (key == "end_ns")
          out.end_ns = v, have_end = true;
        else if (key == "comm_ns")
          out.comm_ns = v;
        else if (key == "wait_ns")
          out.wait_ns = v;
        else if (key == "ops")
          out.ops = uint64_t(v);
        else if (key == "bytes")
          out.bytes = uint64_t(v);
        else if (key == "dropped")
          out.dropped = uint64_t(v);
        else if (key == "rss_max")
          out.rss_max = uint64_t(v);
        else if (key == "device_mem_max")
          out.device_mem_max = uint64_t(v);
      }
      if (eat(',')) continue;
      break;
    }
    if (!eat('}')) return false;
    skipSpace();
    return pos_ == s_.size() && have_rank && have_step && have_end;
  }

 private:
  void skipSpace() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) pos_++;
  }
  char peek() {
    skipSpace();
    return pos_ < s_.size() ? s_[pos_] : '\0';
  }
  bool eat(char c) {
    if (peek() != c) return false;
    pos_++;
    return true;
  }
  bool str(std::string& out) {
    if (!eat('"')) return false;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      if (s_[pos_] == '\\' && pos_ + 1 < s_.size()) pos_++;
      out += s_[pos_++];
    }
    if (pos_ >= s_.size()) return false;
    pos_++;
    return true;
  }
  bool num(int64_t& v) {
    skipSpace();
    size_t start = pos_;
    if (pos_ < s_.size() && s_[pos_] == '-') pos_++;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) pos_++;
    if (pos_ == start || (pos_ == start + 1 && s_[start] == '-')) return false;
    v = std::stoll(std::string(s_.substr(start, pos_ - start)));
    return true;
  }

  std::string_view s_;
  size_t pos_ = 0;
};

int64_t median(std::vector<int64_t> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int64_t phaseNs(const StepSummary& s, std::string_view a, std::string_view b) {
  int64_t total = 0;
  for (const auto& [name, ns] : s.phases)
    if (name == a || name == b) total += ns;
  return total;
}

}  // namespace

std::optional<StepSummary> parseStepLine(std::string_view line) {
  StepSummary s;
  try {
    if (!LineParser(line).parse(s)) return std::nullopt;
  } catch (const std::exception&) {  // out-of-range numbers
    return std::nullopt;
  }
  return s;
}

std::vector<StepSummary> loadDir(const std::string& dir) {
  std::vector<StepSummary> out;
  static const std::regex name_re(R"(rank(\d+)\.jsonl)");
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (!std::regex_match(name, name_re)) continue;
    std::ifstream in(entry.path());
    std::string line;
    while (std::getline(in, line))
      if (auto s = parseStepLine(line)) out.push_back(std::move(*s));
  }
  return out;
}

Report aggregate(const std::vector<StepSummary>& summaries, const AggregateOptions& options) {
  Report report;
  int world = 0;
  for (const auto& s : summaries) world = std::max({world, s.world_size, s.rank + 1});
  report.world_size = world;
  // step -> rank -> summary (a duplicate line keeps the last one).
  std::map<uint64_t, std::map<int, const StepSummary*>> by_step;
  for (const auto& s : summaries) by_step[s.step][s.rank] = &s;

  std::map<int, std::vector<std::pair<double, double>>> rss_series;  // rank -> (step, rss)
  std::map<int, std::vector<std::pair<double, double>>> device_series;
  std::vector<double> worst_times;
  for (const auto& [step, ranks] : by_step) {
    if (int(ranks.size()) < world) {
      report.incomplete.push_back(step);
      continue;
    }
    StepReport r;
    r.step = step;
    std::vector<int64_t> times, busy, comm, wait, data;
    for (const auto& [rank, s] : ranks) {
      int64_t t = s->end_ns - s->start_ns;
      times.push_back(t);
      busy.push_back(t - std::max(s->comm_ns, s->wait_ns));  // outside communication
      comm.push_back(s->comm_ns);
      wait.push_back(s->wait_ns);
      data.push_back(phaseNs(*s, "data_loading", "data"));
      if (t > r.worst_ns || r.worst_rank < 0) r.worst_ns = t, r.worst_rank = rank;
      if (s->rss_max > r.rss_max || r.rss_max_rank < 0) r.rss_max = s->rss_max, r.rss_max_rank = rank;
      if (s->device_mem_max > r.device_mem_max || r.device_mem_max_rank < 0)
        r.device_mem_max = s->device_mem_max, r.device_mem_max_rank = rank;
      rss_series[rank].emplace_back(double(step), double(s->rss_max));
      device_series[rank].emplace_back(double(step), double(s->device_mem_max));
    }
    std::map<int, int64_t> waited_on;  // peer -> what the other ranks waited for it
    for (const auto& [rank, s] : ranks)
      for (const auto& [peer, ns] : s->waited_on)
        if (peer != rank) waited_on[peer] += ns;
    for (const auto& [peer, ns] : waited_on)
      if (ns > r.last_arrival_wait_ns) r.last_arrival = peer, r.last_arrival_wait_ns = ns;
    r.median_ns = median(times);
    double mean = 0, var = 0;
    for (auto t : times) mean += double(t);
    mean /= double(times.size());
    for (auto t : times) var += (double(t) - mean) * (double(t) - mean);
    r.stddev_ns = int64_t(std::sqrt(var / double(times.size())));
    int64_t busy_median = median(busy);
    size_t i = 0;
    int64_t busy_max = 0;
    for (const auto& [rank, s] : ranks) {
      (void)s;
      if (r.straggler < 0 || busy[i] > busy_max) r.straggler = rank, busy_max = busy[i];
      i++;
    }
    r.straggler_margin_ns = busy_max - busy_median;
    r.comm_median_ns = median(comm);
    r.comm_max_ns = *std::max_element(comm.begin(), comm.end());
    r.wait_median_ns = median(wait);
    r.wait_max_ns = *std::max_element(wait.begin(), wait.end());
    int64_t data_median = median(data);
    i = 0;
    for (const auto& [rank, s] : ranks) {
      (void)s;
      if (data[i] > data_median + options.stall_ns && data[i] > 3 * data_median) {
        r.stalls.push_back(rank);
        r.stall_max_ns = std::max(r.stall_max_ns, data[i]);
      }
      i++;
    }
    worst_times.push_back(double(r.worst_ns));
    report.steps.push_back(std::move(r));
  }

  if (!worst_times.empty()) {
    double mean = 0, var = 0;
    for (double t : worst_times) mean += t;
    mean /= double(worst_times.size());
    for (double t : worst_times) var += (t - mean) * (t - mean);
    report.step_time_mean_ns = mean;
    report.step_time_stddev_ns = std::sqrt(var / double(worst_times.size()));
  }

  // Memory creep: least-squares slope of the high-water over the last steps.
  auto slope = [&](const std::vector<std::pair<double, double>>& series) {
    size_t begin = std::min(series.size(), options.warmup_steps);
    if (series.size() - begin > options.creep_window) begin = series.size() - options.creep_window;
    size_t n = series.size() - begin;
    if (n < 3) return 0.0;
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (size_t k = begin; k < series.size(); ++k) {
      auto [x, y] = series[k];
      sx += x, sy += y, sxx += x * x, sxy += x * y;
    }
    double den = double(n) * sxx - sx * sx;
    return den != 0 ? (double(n) * sxy - sx * sy) / den : 0.0;
  };
  for (auto& [rank, series] : rss_series) {
    CreepReport c;
    c.rank = rank;
    c.slope_bytes_per_step = slope(series);
    c.flagged = c.slope_bytes_per_step > double(options.creep_bytes_per_step);
    c.device_slope_bytes_per_step = slope(device_series[rank]);
    c.device_flagged = c.device_slope_bytes_per_step > double(options.creep_bytes_per_step);
    report.creep.push_back(c);
  }
  return report;
}

std::string Report::toJson() const {
  std::string out =
      fmt::format("{{\"world\":{},\"step_time_mean_ns\":{:.0f},\"step_time_stddev_ns\":{:.0f},\"steps\":[",
                  world_size, step_time_mean_ns, step_time_stddev_ns);
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& s = steps[i];
    out += fmt::format(
        "{}{{\"step\":{},\"worst_rank\":{},\"worst_ns\":{},\"median_ns\":{},\"stddev_ns\":{},\"straggler\":{}"
        ","
        "\"straggler_margin_ns\":{},\"comm_median_ns\":{},\"comm_max_ns\":{},\"wait_median_ns\":{},"
        "\"wait_max_ns\":{},\"stalls\":[{}],\"stall_max_ns\":{},\"rss_max\":{},\"rss_max_rank\":{},"
        "\"device_mem_max\":{},\"device_mem_max_rank\":{},\"last_arrival\":{},\"last_arrival_wait_ns\":{}}}",
        i ? "," : "", s.step, s.worst_rank, s.worst_ns, s.median_ns, s.stddev_ns, s.straggler,
        s.straggler_margin_ns, s.comm_median_ns, s.comm_max_ns, s.wait_median_ns, s.wait_max_ns,
        fmt::join(s.stalls, ","), s.stall_max_ns, s.rss_max, s.rss_max_rank, s.device_mem_max,
        s.device_mem_max_rank, s.last_arrival, s.last_arrival_wait_ns);
  }
  out += fmt::format("],\"incomplete\":[{}],\"creep\":[", fmt::join(incomplete, ","));
  for (size_t i = 0; i < creep.size(); ++i)
    out += fmt::format(
        "{}{{\"rank\":{},\"slope_bytes_per_step\":{:.0f},\"flagged\":{},\"device_slope_bytes_per_step\":{:.0f},"
        "\"device_flagged\":{}}}",
        i ? "," : "", creep[i].rank, creep[i].slope_bytes_per_step, creep[i].flagged,
        creep[i].device_slope_bytes_per_step, creep[i].device_flagged);
  return out + "]}";
}

std::vector<StepSummary> collectFromStore(Store& store, int world_size, uint64_t step, int64_t timeout_ms) {
  std::vector<StepSummary> out;
  Deadline deadline = Deadline::after(Millis(timeout_ms));
  for (int r = 0; r < world_size; ++r) {
    Bytes value = store.get(fmt::format("telemetry/{}/{}", r, step), deadline);
    if (auto s = parseStepLine(toString(value))) out.push_back(std::move(*s));
  }
  return out;
}

}  // namespace crossbar::telemetry
