#include <omp.h>
#include <stdio.h>

#include "kite_runtime.h"

extern "C" const char* kite_runtime_version(void) {
  static char buf[96];
  snprintf(buf, sizeof buf, "kite-runtime %d.0 (cpu, openmp %d threads)", KITE_RUNTIME_ABI,
           omp_get_max_threads());
  return buf;
}
extern "C" int kite_runtime_abi(void) { return KITE_RUNTIME_ABI; }
extern "C" int kite_runtime_threads(void) { return omp_get_max_threads(); }
