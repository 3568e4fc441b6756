#pragma once
// The checkout's root, for the tests that read committed data (tests/equivalence/data, traces/).

namespace seqpar::test {

/// meson's project_source_root() of the build that compiled this test. It is compiled in a
/// unit of its own (source_dir.cpp): a clone at another path then changes that small unit
/// alone, and the compiler cache serves every test that calls it (their preprocessed text no
/// longer holds the clone's path).
const char* source_dir();

}  // namespace seqpar::test
