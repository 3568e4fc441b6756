#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <optional>

#include "core/error.hpp"
#include "trace/import/import.hpp"

namespace seqpar::import {

std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  for (const auto& in : inputs) {
    std::error_code ec;
    if (fs::is_directory(in, ec)) {
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(in, ec))
        if (e.is_regular_file()) files.push_back(e.path().string());
      std::sort(files.begin(), files.end());
      if (files.empty()) fail<trace_error>("input directory '{}' holds no files", in);
      out.insert(out.end(), files.begin(), files.end());
    } else if (fs::exists(in, ec)) {
      out.push_back(in);
    } else {
      fail<trace_error>("input '{}' does not exist", in);
    }
  }
  if (out.empty()) fail<trace_error>("no input files given");
  return out;
}

std::string dtype_from_c10(const std::string& name) {
  static const std::map<std::string, std::string> m = {{"Float", "float32"},
                                                       {"float", "float32"},
                                                       {"BFloat16", "bfloat16"},
                                                       {"Half", "float16"},
                                                       {"Double", "float64"},
                                                       {"Int", "int32"},
                                                       {"Long", "int64"},
                                                       {"Short", "int16"},
                                                       {"Char", "int8"},
                                                       {"Byte", "uint8"},
                                                       {"Bool", "bool"},
                                                       {"Float8_e4m3fn", "float8_e4m3fn"},
                                                       {"Float8_e5m2", "float8_e5m2"}};
  if (auto it = m.find(name); it != m.end()) return it->second;
  std::string low = name;
  for (auto& c : low) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return low;
}

std::string dtype_from_cpp(const std::string& name) {
  static const std::map<std::string, std::string> m = {{"float", "float32"},
                                                       {"double", "float64"},
                                                       {"c10::Half", "float16"},
                                                       {"c10::BFloat16", "bfloat16"},
                                                       {"signed char", "int8"},
                                                       {"unsigned char", "uint8"},
                                                       {"short", "int16"},
                                                       {"short int", "int16"},
                                                       {"int", "int32"},
                                                       {"long", "int64"},
                                                       {"long int", "int64"},
                                                       {"long long", "int64"},
                                                       {"long long int", "int64"},
                                                       {"bool", "bool"},
                                                       {"c10::Float8_e4m3fn", "float8_e4m3fn"},
                                                       {"c10::Float8_e5m2", "float8_e5m2"}};
  if (auto it = m.find(name); it != m.end()) return it->second;
  return "";
}

std::optional<std::string> dtype_from_scalar_type(int t) {
  static const std::map<int, std::string> m = {
      {0, "uint8"},   {1, "int8"},    {2, "int16"},   {3, "int32"}, {4, "int64"},
      {5, "float16"}, {6, "float32"}, {7, "float64"}, {11, "bool"}, {15, "bfloat16"}};
  if (auto it = m.find(t); it != m.end()) return it->second;
  return std::nullopt;
}

std::string op_from_c10d(const std::string& raw) {
  std::string n = raw;
  if (auto p = n.find(':'); p != std::string::npos) n = n.substr(p + 1);  // "nccl:all_to_all"
  if (auto p = n.find(' '); p != std::string::npos) n = n.substr(0, p);   // "send 0->1"
  static const std::map<std::string, std::string> m = {
      {"all_reduce", "all_reduce"},
      {"allreduce", "all_reduce"},
      {"allreduce_coalesced", "all_reduce"},
      {"all_reduce_coalesced", "all_reduce"},
      {"allgather_coalesced", "all_gather"},
      {"all_gather_coalesced", "all_gather"},
      {"reduce_scatter_coalesced", "reduce_scatter"},
      {"_reduce_scatter_base_coalesced", "reduce_scatter"},
      {"_allgather_base_coalesced", "all_gather"},
      {"all_to_all", "all_to_all"},
      {"all_to_allv", "all_to_all"},
      {"alltoall", "all_to_all"},
      {"alltoall_base", "all_to_all"},
      {"all_to_all_single", "all_to_all"},
      {"all_gather", "all_gather"},
      {"allgather", "all_gather"},
      {"_allgather_base", "all_gather"},
      {"_all_gather_base", "all_gather"},
      {"all_gather_base", "all_gather"},
      {"all_gather_into_tensor", "all_gather"},
      {"all_gather_into_tensor_coalesced", "all_gather"},
      {"allgather_into_tensor_coalesced", "all_gather"},
      {"reduce_scatter", "reduce_scatter"},
      {"_reduce_scatter_base", "reduce_scatter"},
      {"reduce_scatter_tensor", "reduce_scatter"},
      {"reduce_scatter_tensor_coalesced", "reduce_scatter"},
      {"broadcast", "broadcast"},
      {"barrier", "barrier"},
      {"send", "send"},
      {"recv", "recv"},
      {"recvAnysource", "recv"}};
  if (auto it = m.find(n); it != m.end()) return it->second;
  return "";
}

std::vector<int> parse_rank_list(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    fail<trace_error>("{}: rank list '{}' is not a list like [0, 1]", what, text.substr(0, 80));
  }
  if (!j.is_array())
    fail<trace_error>("{}: rank list '{}' is not a list", what, text.substr(0, 80));
  std::vector<int> out;
  for (const auto& v : j) {
    if (!v.is_number_integer() || v.get<std::int64_t>() < 0 || v.get<std::int64_t>() >= (1 << 20))
      fail<trace_error>("{}: rank list entry {} is not a rank", what, v.dump());
    out.push_back(v.get<int>());
  }
  return out;
}

}  // namespace seqpar::import
