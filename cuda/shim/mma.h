#pragma once
// Empty: the CPU shim (spool_shim.h) emulates WMMA, nvcuda::wmma.
