#pragma once
// What meson wrote about this build (tools/version.hpp, generated): `seqpar --version` prints it.

namespace seqpar::cli {

/// The release, the git commit (dirty when the tree was), the backends built, the build type and
/// compiler. Kept in a unit of its own (build_info.cpp): the generated header changes at every
/// commit, and a unity build would otherwise recompile the verbs' whole unit with it.
struct build_info {
  const char* version;
  const char* git;
  const char* mpi;
  const char* cuda;
  const char* build;
};

build_info this_build();

}  // namespace seqpar::cli
