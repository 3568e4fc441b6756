// fmt's out-of-line functions, compiled into the wheel's binary (meson.build, -Dwheel=true):
// Debian ships fmt as a shared library only, and a wheel's binary must need nothing but the C
// and C++ runtimes. The library's own implementation header defines them here with external
// linkage (FMT_HEADER_ONLY is not set, so they are not inline), exactly once in the program;
// the templates fmt declares FMT_API are instantiated for char, as the rest of seqpar uses
// them. Every other file includes fmt as in the shared-library build, at no extra cost.
#include <fmt/format-inl.h>

FMT_BEGIN_NAMESPACE
namespace detail {

template FMT_API auto thousands_sep_impl<char>(locale_ref) -> thousands_sep_result<char>;
template FMT_API auto decimal_point_impl(locale_ref) -> char;
template FMT_API auto dragonbox::to_decimal(float x) noexcept -> dragonbox::decimal_fp<float>;
template FMT_API auto dragonbox::to_decimal(double x) noexcept -> dragonbox::decimal_fp<double>;

}  // namespace detail
FMT_END_NAMESPACE
