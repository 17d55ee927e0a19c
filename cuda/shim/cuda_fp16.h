#pragma once
// Empty: the CPU shim (spool_shim.h) defines __half and its conversions.
