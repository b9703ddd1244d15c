// How many OpenMP threads a kernel call gets. On a small or shared machine a parallel region
// costs up to a scheduler time slice when a thread is descheduled at its barrier (seen here: a
// 0.06 ms k-means run took 80 ms with 2 threads at load average 5 on 2 cores), so calls whose
// estimated serial time is under ~5 ms run on one thread. KITE_RUNTIME_THREADS overrides.
#pragma once
#include <omp.h>
#include <stdlib.h>

static inline int kite_threads_for(double est_ns) {
  static int forced = -2;
  if (forced == -2) {
    const char* v = getenv("KITE_RUNTIME_THREADS");
    forced = v && *v ? atoi(v) : -1;
  }
  if (forced > 0) return forced;
  return est_ns < 5e6 ? 1 : omp_get_max_threads();
}
