#pragma once
// `seqpar check --html`: a check's report as one self-contained page.
#include <string>

#include "verify/check.hpp"

namespace seqpar::verify {

/// The verdict, every compared row (failing rows first), each failing row's error over the
/// tensor's axes (tokens × width, or a gradient's in × out features with head edges), the
/// collator's notes, the error model and the command that reproduces a failure.
std::string check_report_html(const check_report& r);

}  // namespace seqpar::verify
