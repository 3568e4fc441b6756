#include "io/batch_json.hpp"

#include "core/error.hpp"

namespace seqpar::io {

static std::vector<std::int64_t> int_array(const nlohmann::json& j, const char* key,
                                           const std::string& source) {
  const auto& a = j.at(key);
  if (!a.is_array())
    fail<layout_error>("{}: '{}' must be an array of integers, got {}", source, key, a.type_name());
  // Accept [1, S] (one row, as the collator receives it) as well as a flat list.
  const nlohmann::json* row = &a;
  if (!a.empty() && a.front().is_array()) {
    if (a.size() != 1)
      fail<layout_error>("{}: '{}' has {} rows; the SP collator takes one packed row", source, key,
                         a.size());
    row = &a.front();
  }
  std::vector<std::int64_t> out;
  out.reserve(row->size());
  for (std::size_t i = 0; i < row->size(); ++i) {
    const auto& v = (*row)[i];
    if (!v.is_number_integer())
      fail<layout_error>("{}: {}[{}] = {} is not an integer", source, key, i, v.dump());
    out.push_back(v.get<std::int64_t>());
  }
  return out;
}

packed_batch batch_from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object())
    fail<layout_error>("{}: a batch must be a JSON object with input_ids, labels, position_ids",
                       source);
  for (const char* key : {"input_ids", "labels", "position_ids"})
    if (!j.contains(key))
      fail<layout_error>(
          "{}: the batch has no '{}'; it needs input_ids, labels and position_ids "
          "(attention_mask optional)",
          source, key);
  packed_batch b;
  b.input_ids = int_array(j, "input_ids", source);
  b.labels = int_array(j, "labels", source);
  b.position_ids = int_array(j, "position_ids", source);
  if (j.contains("attention_mask") && !j.at("attention_mask").is_null())
    b.attention_mask = int_array(j, "attention_mask", source);
  return b;
}

nlohmann::json collated_to_json(const collated_batch& cb) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : cb.ranks) {
    nlohmann::json x = {{"cp_rank", r.cp_rank},       {"input_ids", r.input_ids},
                        {"labels", r.labels},         {"position_ids", r.position_ids},
                        {"cu_seqlens", r.cu_seqlens}, {"max_seqlen", r.max_seqlen}};
    if (r.attention_mask) x["attention_mask"] = *r.attention_mask;
    if (r.tail_padding_length) x["tail_padding_length"] = *r.tail_padding_length;
    ranks.push_back(std::move(x));
  }
  const auto& o = cb.options;
  return {{"profile", profile_name(o.profile)},
          {"ulysses", o.ulysses},
          {"ring", o.ring},
          {"cp_size", o.ulysses * o.ring},
          {"original_length", cb.original_length},
          {"padded_length", cb.padded_length},
          {"ranks", std::move(ranks)}};
}

}  // namespace seqpar::io
