// How every kernel of this directory is exported: a C name (loaded with ctypes by
// vllm/_custom_ops.py), visible although the library hides everything else by default.
#pragma once

#define VLLM_EXPORT extern "C" __attribute__((visibility("default")))
