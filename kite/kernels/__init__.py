"""Native kernels (build/libkite_runtime.so via ctypes) with pure-torch fallbacks."""
