#pragma once
// Which sanitizer this translation unit is built under, for g++ (__SANITIZE_*__) and clang
// (__has_feature): SEQPAR_ASAN, SEQPAR_TSAN defined to 1 when on.

#if defined(__SANITIZE_ADDRESS__)
#define SEQPAR_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SEQPAR_ASAN 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define SEQPAR_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SEQPAR_TSAN 1
#endif
#endif
