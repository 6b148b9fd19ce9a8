// The registry of every CROSSBAR_* environment variable. Each variable is declared
// once, in env.cc's table, with its type, default and description; reading an
// undeclared name is a bug (InternalError). Bad values raise InvalidArgument
// listing what is accepted.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace crossbar::env {

enum class Type { kBool, kInt, kSize, kString, kEnum, kMillis };

struct Variable {
  std::string_view name;
  Type type;
  std::string_view default_value;  // as text, same syntax as the environment
  std::string_view description;
  std::vector<std::string_view> choices = {};  // kEnum only (case-insensitive)
};

// Every declared variable, in declaration order.
const std::vector<Variable>& all();
const Variable& lookup(std::string_view name);  // InternalError if undeclared

// Raw value: the environment's if set (and non-empty), else the default.
std::string raw(std::string_view name);
bool isSet(std::string_view name);

bool getBool(std::string_view name);        // 1/0, true/false, yes/no, on/off
int64_t getInt(std::string_view name);      // decimal integer
uint64_t getSize(std::string_view name);    // bytes, with optional K/M/G/T suffix (powers of 2)
int64_t getMillis(std::string_view name);   // milliseconds; suffixes ms, s, m accepted
std::string getString(std::string_view name);
std::string getEnum(std::string_view name);  // lower-cased, validated against choices

// Parsers shared with command-line tools (throw InvalidArgument naming `what`).
uint64_t parseSize(std::string_view text, std::string_view what);
bool parseBool(std::string_view text, std::string_view what);
int64_t parseInt(std::string_view text, std::string_view what);

const char* typeName(Type type);

}  // namespace crossbar::env
