"""The names a kernel or module may not take, and why.

A kernel name becomes an ``extern "C" __global__`` symbol (so a C/C++ identifier no
header nvcc includes declares), a PTX ``.entry`` name, a file name under generated/, a
Python function of the ``kgen_kernels`` package and part of the kernel tests' ids. A
module name becomes a Python module of the ``kgen_kernels`` package and a C
identifier.

``GENERATED_PY_NAMES`` are the names the kgen_kernels package and its modules bind;
tests/cpu/test_names.py derives them from a built package and fails when one is
bound that is not listed here.
"""

from __future__ import annotations

import keyword
import re


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Names the kgen_kernels package and its modules bind (kgen/kgen_kernels/__init__.py,
# kgen.runtime.kernels): a kernel or module of that name would replace one of them.
GENERATED_PY_NAMES = frozenset({
    "MANIFEST", "MODULES", "ROOT", "KERNELS", "FATBINS", "Path", "expose",
})

C_KEYWORDS = _words("""
auto break case char const continue default do double else enum extern float for goto if
inline int long register restrict return short signed sizeof static struct switch typedef
union unsigned void volatile while _Alignas _Alignof _Atomic _Bool _Complex _Generic
_Imaginary _Noreturn _Static_assert _Thread_local
""")

CPP_KEYWORDS = _words("""
alignas alignof and and_eq asm bitand bitor bool catch char8_t char16_t char32_t class
compl concept consteval constexpr constinit const_cast co_await co_return co_yield decltype
delete dynamic_cast explicit export false final friend mutable namespace new noexcept not
not_eq nullptr operator or or_eq override private protected public reinterpret_cast
requires static_assert static_cast template this thread_local throw true try typeid
typename using virtual wchar_t xor xor_eq
""")

# CUDA's built-in variables and types: the vector types (char1 .. double4, every width
# and signedness cuda_runtime.h declares), dim3, half.
_VECTORS = " ".join(f"{base}{w}" for base in ("char", "uchar", "short", "ushort", "int", "uint",
                                              "long", "ulong", "longlong", "ulonglong",
                                              "float", "double") for w in (1, 2, 3, 4))
CUDA_BUILTINS = _words(f"""
threadIdx blockIdx blockDim gridDim warpSize dim3 half __half __half2 nullptr_t {_VECTORS}
""")

# Types and namespaces the headers nvcc includes declare at global scope.
C_TYPES = _words("""
size_t ptrdiff_t ssize_t max_align_t int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t
uint64_t intptr_t uintptr_t intmax_t uintmax_t std FILE
""")

# The CUDA runtime API (cudaMalloc, cudaStream_t, ...): cuda_runtime.h declares them all.
_CUDA_API = re.compile(r"cuda[A-Z_]")

# PTX: the predefined identifier WARP_SZ; an identifier made of one underscore (or
# one of ``_$%`` followed by nothing) is not a PTX name.
PTX_RESERVED = frozenset({"WARP_SZ"})

# Functions the headers nvcc always includes declare with C linkage (the C library
# the device runtime provides: printf, malloc, the math library, ...): an
# ``extern "C"`` kernel of the same name conflicts with them. A name missing here
# still fails at the spec line: the ptx stage maps such an nvcc error to its kernel.
C_LIBRARY = _words("""
printf fprintf sprintf snprintf vprintf puts putchar malloc calloc realloc free memcpy
memmove memset memcmp strlen strcpy strncpy strcmp strncmp strcat abort exit atexit
assert abs labs llabs div rand srand qsort bsearch atoi atol atof strtol strtod clock
acos acosf acosh acoshf asin asinf asinh asinhf atan atanf atan2 atan2f atanh atanhf cbrt
cbrtf ceil ceilf copysign copysignf cos cosf cosh coshf erf erff erfc erfcf exp expf exp2
exp2f expm1 expm1f fabs fabsf fdim fdimf floor floorf fma fmaf fmax fmaxf fmin fminf fmod
fmodf frexp frexpf hypot hypotf ilogb ilogbf ldexp ldexpf lgamma lgammaf llrint llrintf
llround llroundf log logf log10 log10f log1p log1pf log2 log2f logb logbf lrint lrintf
lround lroundf modf modff nan nanf nearbyint nearbyintf nextafter nextafterf pow powf
remainder remainderf remquo remquof rint rintf round roundf scalbln scalblnf scalbn scalbnf
sin sinf sinh sinhf sqrt sqrtf tan tanf tanh tanhf tgamma tgammaf trunc truncf isnan isinf
isfinite signbit rsqrt rsqrtf sincos sincosf min max umin umax
""")

# Macros the headers nvcc includes define (the C library's, <limits.h>, <float.h>,
# <math.h>, <stdio.h>, <stddef.h>, <stdarg.h>, <errno.h>, CUDA's version macros):
# the preprocessor replaces a kernel or module of such a name before the compiler sees
# it (``NULL`` becomes ``0``, ``EOF`` ``(-1)``), so nvcc fails far from the spec.
C_MACROS = _words("""
NULL EOF BUFSIZ FILENAME_MAX FOPEN_MAX L_tmpnam TMP_MAX SEEK_SET SEEK_CUR SEEK_END stdin
stdout stderr RAND_MAX EXIT_SUCCESS EXIT_FAILURE MB_CUR_MAX MB_LEN_MAX CLOCKS_PER_SEC errno
EDOM ERANGE EILSEQ offsetof va_start va_end va_arg va_copy INFINITY NAN HUGE_VAL HUGE_VALF
HUGE_VALL FP_NAN FP_INFINITE FP_ZERO FP_SUBNORMAL FP_NORMAL FP_ILOGB0 FP_ILOGBNAN MATH_ERRNO
MATH_ERREXCEPT math_errhandling M_E M_LOG2E M_LOG10E M_LN2 M_LN10 M_PI M_PI_2 M_PI_4 M_1_PI
M_2_PI M_2_SQRTPI M_SQRT2 M_SQRT1_2 CHAR_BIT SCHAR_MIN SCHAR_MAX UCHAR_MAX CHAR_MIN CHAR_MAX
SHRT_MIN SHRT_MAX USHRT_MAX INT_MIN INT_MAX UINT_MAX LONG_MIN LONG_MAX ULONG_MAX LLONG_MIN
LLONG_MAX ULLONG_MAX FLT_RADIX FLT_MANT_DIG FLT_DIG FLT_EPSILON FLT_MIN FLT_MAX DBL_MANT_DIG
DBL_DIG DBL_EPSILON DBL_MIN DBL_MAX LDBL_EPSILON LDBL_MIN LDBL_MAX INT8_MIN INT8_MAX
INT16_MIN INT16_MAX INT32_MIN INT32_MAX INT64_MIN INT64_MAX UINT8_MAX UINT16_MAX UINT32_MAX
UINT64_MAX INTPTR_MIN INTPTR_MAX UINTPTR_MAX INTMAX_MIN INTMAX_MAX UINTMAX_MAX SIZE_MAX
PTRDIFF_MIN PTRDIFF_MAX WCHAR_MIN WCHAR_MAX WINT_MIN WINT_MAX CUDA_VERSION CUDART_VERSION
CUDART_INF CUDART_INF_F CUDART_NAN CUDART_NAN_F
""")

# kgen's own device helpers and macros are kgen_* / KGEN_*.
HELPER_PREFIX = "kgen_"

# Longest module name: it names files (``test_<module>.py``, ``<module>.ptx``) whose
# names, with the build's scratch prefixes, stay far below a file system's 255 bytes.
MODULE_NAME_MAX = 64
# Longest kernel name: it is spelled in test names (``test_<kernel>_bit_exact_<other>``).
KERNEL_NAME_MAX = 96

_RESERVED_C = re.compile(r"__|_[A-Z]")


def _is_ptx_identifier(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9_$]*|[_$%][A-Za-z0-9_$]+", name))


def kernel_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a generated kernel, or None."""
    if not (name.isascii() and name.isidentifier()):
        return "is not an ASCII identifier"
    if len(name) > KERNEL_NAME_MAX:
        return f"is {len(name)} characters long (at most {KERNEL_NAME_MAX})"
    if keyword.iskeyword(name):
        return "is a Python keyword (the kernel is a Python function of kgen_kernels)"
    if name in C_KEYWORDS or name in CPP_KEYWORDS:
        return "is a C/C++ keyword (the kernel is an extern \"C\" __global__ function)"
    if name in CUDA_BUILTINS:
        return "is a CUDA built-in name"
    if name in C_TYPES:
        return "is a type or namespace the CUDA headers declare"
    if _CUDA_API.match(name):
        return "is a CUDA runtime API name (cuda_runtime.h declares cuda* names)"
    if _RESERVED_C.match(name):
        return "starts with '__' or '_' and a capital letter (reserved in C and C++)"
    if name in PTX_RESERVED or not _is_ptx_identifier(name):
        return "is not a PTX name (the kernel is a PTX .entry)"
    if name.lower().startswith(HELPER_PREFIX):
        return f"starts with '{HELPER_PREFIX}' (kgen's generated helpers and macros use it)"
    if name in C_LIBRARY:
        return "is a C library function the CUDA headers declare"
    if name in C_MACROS:
        return "is a macro the CUDA and C headers define (the preprocessor would replace it)"
    if name in GENERATED_PY_NAMES:
        return "is a name the generated Python code uses"
    return None


def module_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a generated module, or None."""
    if not (name.isascii() and name.isidentifier()):
        return "must be an ASCII identifier (it names the generated file)"
    if len(name) > MODULE_NAME_MAX:
        return (f"is {len(name)} characters long (at most {MODULE_NAME_MAX}: it names the "
                "generated files)")
    if keyword.iskeyword(name):
        return "is a Python keyword (the module is imported from kgen_kernels)"
    if name.startswith("_"):
        return "starts with '_' (generated/__init__.py and private modules use it)"
    if name in C_MACROS:
        return "is a macro the CUDA and C headers define (the module is a C identifier too)"
    if name in GENERATED_PY_NAMES:
        return "is a name the generated Python code uses"
    return None
