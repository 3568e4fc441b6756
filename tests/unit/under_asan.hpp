// Whether this test program is compiled under AddressSanitizer (build-asan: -O1 at the x86-64
// baseline, ~10× slower than build/). The whole step's finite-difference tests then take a sample
// of each parameter's elements, where build/ checks every one: the same code runs for every
// element, so the sanitizers see all of it either way.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool under_asan = true;
#elif defined(__has_feature)
inline constexpr bool under_asan = __has_feature(address_sanitizer);
#else
inline constexpr bool under_asan = false;
#endif
