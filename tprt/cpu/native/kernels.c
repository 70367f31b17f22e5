/* tprt's CPU kernels for decoding, where torch's general-purpose ones leave time on the table.
   Built at first use with -march=native by tprt.cpu.native (plain C, no torch headers) and called
   through ctypes with raw pointers; tprt/cpu/native/__init__.py checks shapes, dtypes and contiguity.

   Matrix-vector products for one-row (batch-1 decode) inputs: y[n] = sum_k W[n,k] x[k].
   oneDNN's and torch's one-row kernels stream the weight at 10-15 GB/s on one core where a plain
   read reaches ~20; these read each row front to back, one sequential stream the hardware
   prefetcher follows at full bandwidth. W is [n, k] row-major and contiguous; bf16 values are
   uint16_t.
   Sums are in float32, bf16 outputs rounded to nearest even, as torch rounds.

   The kernels are split by family, each file one job, and built as one library and one
   translation unit (this file includes them in order), so the families share static helpers and
   the compiler inlines across them:
   - common.h: includes, bf16 conversions, per-thread heap scratch, exp/softmax/SiLU;
   - pool.c: the persistent thread pool every kernel splits its work on;
   - gemv.c: one-row GEMVs, RMSNorm, few-row products;
   - attention.c: RoPE and the paged KV cache write (float32, int8), paged decode attention;
   - stack.c: a decoder layer's halves, and every layer of a decode step in one call;
   - int8.c: int8 weight-only products, and int8 quantization for the converter. */
#include "common.h"
#include "pool.c"
#include "gemv.c"
#include "attention.c"
#include "stack.c"
#include "int8.c"
