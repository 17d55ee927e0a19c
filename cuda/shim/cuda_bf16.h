#pragma once
// Empty: the CPU shim (spool_shim.h) defines __nv_bfloat16 and its conversions.
