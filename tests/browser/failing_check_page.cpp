// Writes the --html page of a check that fails: KV heads repeated blockwise instead of
// interleaved (tests/support/bugs.hpp), injected from the test side through check_options'
// compute seam — a failing check cannot be made from the CLI, which has no bug switch.
//   failing_check_page OUT.html
#include <cstdio>

#include "io/file.hpp"
#include "support/bugs.hpp"
#include "verify/check_html.hpp"

int main(int argc, char** argv) {
  using namespace seqpar;
  if (argc != 2) {
    std::fprintf(stderr, "usage: failing_check_page OUT.html\n");
    return 2;
  }
  scenario s;
  s.name = "kv-repeated-blockwise";
  s.ulysses = 4;
  s.ring = 1;
  s.heads = 8;
  s.kv_heads = 2;
  s.head_dim = 8;
  s.hidden = 32;
  s.intermediate = 48;
  s.vocab = 40;
  s.docs = {9, 15};
  verify::check_options opt;
  opt.wrap_compute = test::wrap_compute_in<test::kv_heads_repeated_blockwise>();
  const auto rep = verify::run_check(s, opt);
  io::write_atomic(argv[1], verify::check_report_html(rep));
  return rep.pass ? 1 : 0;  // the page is of a failing check
}
