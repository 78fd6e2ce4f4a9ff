// Compiles the kernel file ORCA_KERNEL_FILE (a quoted name, defined by the includer) once per
// instruction set, into namespaces avx512, avx2 and base, each with ORCA_KERNEL_ISA set to the
// index the .cc files' dispatch tables and native.py's ISAS use (0, 1, 2). GCC's target pragmas let
// one translation unit hold every variant, so the library stays portable (no -march=native): the
// best one the CPU has is picked at load.
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
namespace avx512 {
#define ORCA_KERNEL_ISA 0
#include ORCA_KERNEL_FILE
#undef ORCA_KERNEL_ISA
}  // namespace avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define ORCA_KERNEL_ISA 1
#include ORCA_KERNEL_FILE
#undef ORCA_KERNEL_ISA
}  // namespace avx2
#pragma GCC pop_options
#endif
namespace base {
#define ORCA_KERNEL_ISA 2
#include ORCA_KERNEL_FILE
#undef ORCA_KERNEL_ISA
}  // namespace base
