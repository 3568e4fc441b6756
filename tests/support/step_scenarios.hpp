#pragma once
// The scenarios every backend of the tensor step (sim/tensor_step.hpp) is held to: the built-in
// default (a padded hybrid row), Ulysses with GQA repeats, a contiguous and a zigzag ring, every
// attention option of today's models (sinks, windows, chunks, bidirectional, soft-capping), the
// q/k norm of both kinds with projection biases, and each profile's loss (VeOmni's whole-row
// shift and FSDP averaging, DeepSpeed's sync Ulysses). The CPU runs them through eigen_compute
// (tests/equivalence/tensor_step-test.cpp), the GPU through cuda_compute (tests/gpu).
#include <string>
#include <vector>

#include "core/scenario.hpp"
#include "support/scenarios.hpp"

namespace seqpar::test {

struct named_scenario {
  std::string name;
  scenario s;
};

inline std::vector<named_scenario> tensor_step_scenarios() {
  std::vector<named_scenario> out;
  out.push_back({"default", builtin_scenario("default")});
  out.push_back({"ulysses 4, kv repeated", small_scenario(4, 1, 8, 2, {9, 14, 5})});
  auto contiguous = small_scenario(2, 2, 4, 2, {11, 13});
  contiguous.zigzag = false;
  contiguous.ring_backward = "ring";
  out.push_back({"contiguous ring, ring backward", contiguous});
  auto options = small_scenario(2, 2, 4, 2, {20, 12});
  options.layers = 2;
  options.attention_pattern = "WC";
  options.window = 5;
  options.chunk = 6;
  options.sinks = true;
  options.softcap = 20;
  out.push_back({"window, chunk, sinks, soft-cap", options});
  auto sinks = small_scenario(2, 2, 8, 2, {16, 12});
  sinks.sinks = true;
  out.push_back({"sinks", sinks});
  auto bidir = small_scenario(4, 1, 4, 4, {10, 10});
  bidir.bidirectional = true;
  bidir.ulysses_strategy = "sync";
  out.push_back({"bidirectional", bidir});
  auto norms = small_scenario(2, 1, 4, 2, {12, 9});
  norms.qk_norm = true;
  norms.qk_norm_type = "layernorm";
  norms.qkv_bias = true;
  norms.o_bias = true;
  norms.ulysses_strategy = "sync";
  out.push_back({"layernorm q/k norm, biases", norms});
  out.push_back({"veomni", small_scenario(4, 1, 8, 2, {13, 9}, profile::veomni)});
  out.push_back({"deepspeed", small_scenario(2, 1, 4, 2, {10, 8}, profile::deepspeed)});
  return out;
}

}  // namespace seqpar::test
