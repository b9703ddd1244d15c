"""Support shared by the test suite and the benchmarks (as numpy.testing is numpy's): the tiny
corpus (:mod:`.corpus`), tiny random models (:mod:`.tiny_models`), local redis-server / moto S3
launchers (:mod:`.services`), Triton kernels run in Triton's interpreter on a CPU
(:mod:`.triton_interpreter`). Nothing in the product imports it."""
