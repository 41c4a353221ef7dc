/* A thread's scratch buffer for the native GEMMs (gemm_bf16.c, gemm_fp8.c, gemm_quant.c), grown as
 * needed and kept for the thread's next call. Their signatures are gemm_f32's (the native decoder
 * stack calls any of them through one pointer), which have no scratch argument and no way to fail:
 * memory that cannot be had ends the process with one line naming what it was for.
 *
 * Each including file declares its own `static _Thread_local Scratch name;`.
 */
#ifndef NORIA_THREAD_SCRATCH_H
#define NORIA_THREAD_SCRATCH_H

#include <stdio.h>
#include <stdlib.h>

typedef struct {
    void *p;
    size_t size;
} Scratch;

/* At least `bytes` bytes, 64-byte aligned; `what` names the buffer (SCRATCH_OWNER, the kernel, is
 * defined by the including file). */
static void *scratch_for(Scratch *s, size_t bytes, const char *what) {
    if (bytes > s->size) {
        free(s->p);
        s->p = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (s->p == NULL) {
            fprintf(stderr, SCRATCH_OWNER ": out of memory for %zu bytes of %s\n", bytes, what);
            abort();
        }
        s->size = bytes;
    }
    return s->p;
}

#endif
