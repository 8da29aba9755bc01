/* The glibc symbol versions the native libraries bind to (include after the system headers).
 *
 * A library built on a recent glibc binds each libc function to that function's newest symbol
 * version, and a loader (or `auditwheel`) then needs a glibc at least as new: built on glibc 2.34+,
 * pthread_create, pthread_once, pthread_mutex_trylock and dlsym would ask for GLIBC_2.34 (the
 * version at which libpthread and libdl moved into libc) and expf for GLIBC_2.27 (a rewrite),
 * so a wheel carrying the libraries would be tagged manylinux_2_34. Bound to their first x86-64
 * versions (GLIBC_2.2.5, which every later glibc still exports) they load on any glibc 2.17+,
 * clock_gettime@GLIBC_2.17 then being the newest: `scripts/build_wheel.sh` tags the wheel
 * manylinux_2_17. Same functions, same results: the 2.34 versions are the old ones moved, and
 * expf's old version is as accurate (the kernels' own exponentials are their polynomials).
 * x86-64 glibc only (aarch64's first version is 2.17 already; musl has no symbol versions);
 * -DMLXCEL_NO_SYMVER leaves the defaults. */
#ifndef MLXCEL_GLIBC_VERSIONS_H
#define MLXCEL_GLIBC_VERSIONS_H
#if defined(__GLIBC__) && defined(__x86_64__) && !defined(MLXCEL_NO_SYMVER)
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_once,pthread_once@GLIBC_2.2.5");
__asm__(".symver pthread_mutex_trylock,pthread_mutex_trylock@GLIBC_2.2.5");
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver expf,expf@GLIBC_2.2.5");
#endif
#endif /* MLXCEL_GLIBC_VERSIONS_H */
