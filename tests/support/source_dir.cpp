#include "support/source_dir.hpp"

namespace seqpar::test {

const char* source_dir() { return SEQPAR_SOURCE_DIR; }

}  // namespace seqpar::test
