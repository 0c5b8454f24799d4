/* LD_PRELOAD shim for tests: makes Intel MKL take the code path it takes on an Intel CPU of the same ISA.
 *
 * MKL picks its kernels per CPU vendor: on AMD processors it runs its AVX2 path even where AVX-512 is available,
 * so a tolerance tuned on an AMD machine can fail on an Intel one (issue 16: a GaLore and a Shampoo test did).
 * MKL decides through the internal functions below; answering "Intel" lets an AMD machine run, and test, the
 * kernels an Intel user gets. No effect on an Intel CPU (already true) or without MKL (the symbols go unused).
 * Build: cc -shared -fPIC -O2 -o libmkl_intel_path.so tools/mkl_intel_path.c
 * Use:   LD_PRELOAD=$PWD/libmkl_intel_path.so python -m pytest ...   (MKL_VERBOSE=1 shows the chosen path)
 */
int mkl_serv_intel_cpu_true(void) { return 1; }
int mkl_serv_intel_cpu(void) { return 1; }
