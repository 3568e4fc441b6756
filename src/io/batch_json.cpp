#include "io/batch_json.hpp"

#include <fmt/format.h>

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

namespace {

sample sample_from_json(const nlohmann::ordered_json& j, const std::string& where) {
  if (!j.is_object())
    fail<layout_error>(
        "{}: a sample must be a JSON object of keys (input_ids, labels, "
        "position_ids, …), got {}",
        where, j.type_name());
  sample s;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& v = it.value();
    sample_entry e;
    e.key = it.key();
    if (!v.is_array()) {
      e.value = v.dump();
      s.entries.push_back(std::move(e));
      continue;
    }
    const nlohmann::ordered_json* row = &v;
    if (!v.empty() && v.front().is_array()) {
      if (v.size() != 1 || (!v.front().empty() && v.front().front().is_array()))
        fail<layout_error>(
            "{}: '{}' is a {} tensor; the adapter cuts [batch 1, seqlen] tensors (a 3-D mask or "
            "batch > 1 fails inside its all_gather); give one flat row",
            where, e.key, v.size() != 1 ? fmt::format("{}-row", v.size()) : std::string("3-D"));
      row = &v.front();
    }
    std::vector<std::int64_t> t;
    t.reserve(row->size());
    for (std::size_t i = 0; i < row->size(); ++i) {
      if (!(*row)[i].is_number_integer())
        fail<layout_error>("{}: {}[{}] = {} is not an integer (seqpar reads integer tensors)",
                           where, e.key, i, (*row)[i].dump());
      t.push_back((*row)[i].get<std::int64_t>());
    }
    e.tokens = std::move(t);
    s.entries.push_back(std::move(e));
  }
  return s;
}

}  // namespace

std::vector<sample> samples_from_json(const nlohmann::ordered_json& j, int ulysses,
                                      const std::string& source) {
  if (j.is_object() && j.contains("rows")) {
    const auto& rows = j.at("rows");
    if (!rows.is_array() || j.size() != 1)
      fail<layout_error>(
          "{}: 'rows' must be an array of samples and the only key ({{\"rows\":[row_0,…]}})",
          source);
    std::vector<sample> out;
    for (std::size_t i = 0; i < rows.size(); ++i)
      out.push_back(sample_from_json(rows[i], fmt::format("{} rows[{}]", source, i)));
    return out;
  }
  const sample one = sample_from_json(j, source);
  return std::vector<sample>(static_cast<std::size_t>(std::max(ulysses, 1)), one);
}

nlohmann::ordered_json ds_collated_to_json(const ds_collated& c) {
  nlohmann::ordered_json steps = nlohmann::ordered_json::array();
  for (const auto& m : c.micro_steps) {
    nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
    for (const auto& r : m.ranks) {
      nlohmann::ordered_json x = nlohmann::ordered_json::object();
      x["cp_rank"] = r.cp_rank;
      for (const auto& e : r.entries)
        x[e.key] =
            e.tokens ? nlohmann::ordered_json(*e.tokens) : nlohmann::ordered_json::parse(e.value);
      ranks.push_back(std::move(x));
    }
    steps.push_back({{"source_rank", m.source_rank}, {"ranks", std::move(ranks)}});
  }
  return {{"profile", "deepspeed"}, {"ulysses", c.ulysses}, {"micro_steps", std::move(steps)}};
}

}  // namespace seqpar::io
