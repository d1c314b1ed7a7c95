// A small JSON value for the load generator's results: null, bool, number, string, array and
// object (keys kept in insertion order), serialised with two-space indentation. Not a parser.
// Not thread-safe; a value is built by one thread and then written.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace pagedattn::loadgen {

class Json {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  Json() = default;  // null
  Json(bool b) : type_(Type::kBool), bool_(b) {}
  Json(int v) : type_(Type::kNumber), number_(v) {}
  Json(int64_t v) : type_(Type::kNumber), number_(static_cast<double>(v)) {}
  Json(uint64_t v) : type_(Type::kNumber), number_(static_cast<double>(v)) {}
  Json(double v) : type_(Type::kNumber), number_(v) {}
  Json(const char* s) : type_(Type::kString), string_(s) {}
  Json(std::string s) : type_(Type::kString), string_(std::move(s)) {}
  Json(absl::string_view s) : type_(Type::kString), string_(s) {}

  static Json Array() { Json j; j.type_ = Type::kArray; return j; }
  static Json Object() { Json j; j.type_ = Type::kObject; return j; }

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }

  // Object: sets (or replaces) key. Turns a null into an object first.
  Json& Set(absl::string_view key, Json value);
  // Object: the value under key, or nullptr.
  const Json* Find(absl::string_view key) const;
  Json* Find(absl::string_view key);
  // Array: appends. Turns a null into an array first.
  Json& Push(Json value);
  size_t size() const { return type_ == Type::kArray ? items_.size() : members_.size(); }

  double number() const { return number_; }
  bool boolean() const { return bool_; }
  const std::string& string() const { return string_; }

  // Non-finite numbers become null (JSON has no NaN or infinity).
  std::string Dump(int indent = 2) const;

 private:
  void DumpTo(std::string* out, int indent, int depth) const;

  Type type_ = Type::kNull;
  bool bool_ = false;
  double number_ = 0.0;
  std::string string_;
  std::vector<Json> items_;
  std::vector<std::pair<std::string, Json>> members_;
};

}  // namespace pagedattn::loadgen
