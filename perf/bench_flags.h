// Long options of crossbar's own benchmarks (moe_dispatch_perf, moe_netns_bench): every
// flag but a switch takes the next argument as its value, and a bad value is an
// InvalidArgument naming the flag and what it expects, not a bare "stoi".
//
//   BenchFlags f(argc, argv);
//   while (f.next()) {
//     if (f.is("--iters")) o.iters = f.integer(1);
//     else if (f.is("--no-flat")) o.no_flat = true;
//     else return f.usage(text);   // --help / -h: exit code 0, anything else 2
//   }
#pragma once

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "comm/errors.h"

namespace crossbar::perf {

class BenchFlags {
 public:
  BenchFlags(int argc, char** argv) : argc_(argc), argv_(argv) {}

  // Steps to the next flag; false after the last.
  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    return true;
  }
  bool is(const char* name) const { return flag_ == name; }
  const std::string& flag() const { return flag_; }

  // The flag's value, as given.
  std::string text() {
    if (i_ + 1 >= argc_) throw InvalidArgument(flag_ + " needs a value");
    return argv_[++i_];
  }
  long long integer(long long lo = LLONG_MIN, long long hi = LLONG_MAX) { return integerOf(text(), lo, hi); }
  double real() {
    const std::string v = text();
    errno = 0;
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (v.empty() || errno != 0 || *end != '\0') bad(v, "a number");
    return d;
  }
  // One of `choices`.
  std::string choice(std::initializer_list<const char*> choices) {
    const std::string v = text();
    std::string all;
    for (const char* c : choices) {
      if (v == c) return v;
      all += (all.empty() ? "" : ", ") + std::string(c);
    }
    bad(v, "one of " + all);
  }
  // A comma-separated list (empty items dropped).
  std::vector<std::string> list() {
    std::vector<std::string> out;
    const std::string v = text();
    size_t p = 0;
    while (p <= v.size()) {
      size_t q = v.find(',', p);
      if (q == std::string::npos) q = v.size();
      if (q > p) out.push_back(v.substr(p, q - p));
      p = q + 1;
    }
    if (out.empty()) bad(v, "a comma-separated list");
    return out;
  }
  std::vector<size_t> integers(long long lo = 0) {
    std::vector<size_t> out;
    for (const std::string& s : list()) out.push_back(static_cast<size_t>(integerOf(s, lo, LLONG_MAX)));
    return out;
  }

  // Prints `usage` (the flags after the program name) and returns the exit code: 0 for
  // --help / -h, 2 for an unknown flag (named first).
  int usage(const std::string& text) const {
    const bool help = flag_ == "--help" || flag_ == "-h";
    if (!help) std::fprintf(stderr, "%s: unknown option '%s'\n", argv_[0], flag_.c_str());
    std::fprintf(help ? stdout : stderr, "usage: %s %s\n", argv_[0], text.c_str());
    return help ? 0 : 2;
  }

 private:
  [[noreturn]] void bad(const std::string& value, const std::string& expected) const {
    throw InvalidArgument("invalid value '" + value + "' for " + flag_ + ": expected " + expected);
  }
  long long integerOf(const std::string& v, long long lo, long long hi) const {
    errno = 0;
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || errno != 0 || *end != '\0') bad(v, "an integer");
    if (n < lo || n > hi)
      bad(v, hi == LLONG_MAX || hi == INT_MAX ? "at least " + std::to_string(lo)
                                              : "from " + std::to_string(lo) + " to " + std::to_string(hi));
    return n;
  }

  int argc_;
  char** argv_;
  int i_ = 0;
  std::string flag_;
};

}  // namespace crossbar::perf
