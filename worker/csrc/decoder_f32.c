/* A Llama-family or Gemma 2 / 3 decoder stack in one call, for the CPU torch backend.
 *
 * Per layer the Python path makes nine native calls (norm, qkv GEMM, rotary
 * (with Qwen3's per-head q/k norm before it, in the same kernel), paged
 * attention, o GEMM, norm, gate/up GEMM, SiLU-and-mul, down GEMM), and
 * between them runs the modules' Python: wrappers, argument conversion, one
 * fresh tensor per result. On W1's 18-row decode step of the "small" model that
 * glue takes ~4 ms of a ~50 ms step (a quarter of it inside the wrappers, the
 * rest between calls). Here the same kernels are called in the same order on
 * the same inputs, from C, into scratch buffers the caller keeps across steps:
 * the output is bit for bit the Python path's.
 *
 * The kernels live in their own libraries (each built with its own flags:
 * gemm_f32.c in-order sums, fused_f32.c no contraction, paged_decode.c
 * reassociated), so they are reached through function pointers.
 *
 * Buffers: x [T, hidden] enters as the layer input, other [T, hidden] as the
 * residual stream (ignored when no layer ran before, as for layer 0). The layers
 * passed may be a run of the model's: the caller runs the others in Python. Per layer
 *   x = x + other -> residual; normed; o_proj -> other; other += x -> residual;
 *   normed; down_proj -> x.
 * so on return x holds the last layer's output and other the residual stream,
 * which the caller's final norm adds, as DecoderLayer.forward leaves them.
 * A Gemma layer also normalizes o_proj's output (other) and down_proj's (x) in
 * place, with the (1 + w) weights its Python layers pass the same norm kernel;
 * its MLP's activation is GeGLU (tanh), its attention may soft-cap the scores,
 * and Gemma 3's sliding layers rotate with a rope of their own.
 * A mixture-of-experts layer's MLP is the caller's function (its router and
 * experts: the model's own block, whose experts are one native call), which
 * reads st->normed and writes x, as the Python layer passes them.
 */
#include <stddef.h>
#include <stdint.h>

typedef void (*gemm_fn)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K, int num_threads);
typedef void (*norm_fn)(float *h, const float *residual, const float *weight, float *out, int64_t rows, int64_t n,
                        float eps, int num_threads);
typedef void (*rope_fn)(const float *qkv, int64_t ld, const float *cos, const float *sin, float *q, float *k,
                        float *v, int64_t T, int64_t H, int64_t KVH, int64_t D, int num_threads);
typedef void (*rope_partial_fn)(const float *qkv, int64_t ld, const float *cos, const float *sin, float *q, float *k,
                                float *v, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t R, int num_threads);
typedef void (*qk_rope_fn)(const float *qkv, int64_t ld, const float *cos, const float *sin, const float *q_weight,
                           const float *k_weight, float eps, float *q, float *k, float *v, int64_t T, int64_t H,
                           int64_t KVH, int64_t D, int num_threads);
typedef void (*silu_fn)(const float *gate_up, int64_t ld, float *out, int64_t T, int64_t n, int num_threads);
/* The caches' elements are float32, bf16 or float16: the caller points attn / attn_capped at the
 * paged_decode.c entry points for theirs, so the driver passes them through untyped. An fp8
 * cache has a K and a V scale per layer: the caller sets attn_scaled (paged_decode_capped_fp8,
 * cap 0 for none) and the driver passes each layer's scales. */
typedef int (*attn_capped_fn)(const float *q, void *k_cache, void *v_cache, const int64_t *block_table,
                              const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                              float scale, int64_t window, int num_threads, const float *k_new, const float *v_new,
                              const int64_t *slots, int64_t num_new, float cap);
typedef int (*attn_fn)(const float *q, void *k_cache, void *v_cache, const int64_t *block_table,
                       const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                       int num_threads, const float *k_new, const float *v_new, const int64_t *slots,
                       int64_t num_new);
typedef int (*attn_scaled_fn)(const float *q, void *k_cache, void *v_cache, const int64_t *block_table,
                              const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                              float scale, int64_t window, int num_threads, const float *k_new, const float *v_new,
                              const int64_t *slots, int64_t num_new, float cap, float k_scale, float v_scale);

typedef struct {
    gemm_fn gemm;
    norm_fn norm;
    rope_fn rope;
    silu_fn silu;
    attn_fn attn;
    qk_rope_fn qk_rope;
    rope_partial_fn rope_partial;
    silu_fn gelu_tanh;          /* GeGLU (tanh) and mul: silu's signature */
    attn_capped_fn attn_capped; /* attn with soft-capped scores */
    attn_scaled_fn attn_scaled; /* an fp8 cache's attention (then attn and attn_capped are unused), or NULL */
} Kernels;

typedef struct { /* packed weights (see gemm_f32.c), biases or NULL, norm weights, this layer's caches */
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    const float *input_norm, *post_norm;
    void *k_cache, *v_cache;
    int64_t window; /* sliding window, 0 for none */
    const float *q_norm, *k_norm; /* per-head q/k RMSNorm weights [head_dim] (Qwen3), or NULL */
    /* Gemma: norms of the attention's and the MLP's outputs before they join the residual
     * stream (post_norm is then the pre-feedforward norm), or NULL */
    const float *post_attn_norm, *post_mlp_norm;
    float soft_cap;     /* attention logit soft-cap, 0 for none */
    int32_t geglu;      /* the MLP's activation: GeGLU (tanh) if set, else SiLU */
    int64_t local_rope; /* rotate with Step's cos_local / sin_local (Gemma 3's sliding layers) */
    /* A sparse layer's MLP: x[:T] = moe(layer, normed[:T]) by the caller, 0 on success; NULL: dense */
    int (*moe)(int64_t layer, int64_t T);
    int64_t index; /* this layer's index in the model, moe's first argument */
    float k_scale, v_scale; /* an fp8 cache's scales (attn_scaled), else unused */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
} Shape;

typedef struct {
    int64_t tokens, max_blocks;
    const float *cos, *sin;                     /* [T, head_dim / 2] */
    const int64_t *tables, *lens, *slots;      /* per token: block table row, keys seen, KV slot */
    float *normed, *qkv, *q, *k, *v, *attn, *gate_up, *act; /* scratch */
    int num_threads;
    int residual; /* whether `other` holds a residual stream on entry (a layer ran before these) */
    int64_t rotary_dim; /* head_dim, or fewer for partial rotary (the first rotary_dim dims rotate) */
    const float *cos_local, *sin_local; /* the local_rope layers' [T, rotary_dim / 2] */
} Step;

/* Every struct's size and every field's offset, by name: worker/native_layout.py compares its
 * ctypes mirror with these at load, so a field added, moved or resized on one side only is an
 * error naming it, not a driver reading the wrong bytes. One list feeds the names and the values. */
#define DECODER_LAYOUT(S, F)                                                                                    \
    S(Kernels) F(Kernels, gemm) F(Kernels, norm) F(Kernels, rope) F(Kernels, silu) F(Kernels, attn)          \
    F(Kernels, qk_rope) F(Kernels, rope_partial) F(Kernels, gelu_tanh) F(Kernels, attn_capped)                 \
    F(Kernels, attn_scaled)                                                                                   \
    S(Layer) F(Layer, qkv) F(Layer, qkv_bias) F(Layer, o) F(Layer, o_bias) F(Layer, gate_up)                  \
    F(Layer, gate_up_bias) F(Layer, down) F(Layer, down_bias) F(Layer, input_norm) F(Layer, post_norm)        \
    F(Layer, k_cache) F(Layer, v_cache) F(Layer, window) F(Layer, q_norm) F(Layer, k_norm)                    \
    F(Layer, post_attn_norm) F(Layer, post_mlp_norm) F(Layer, soft_cap) F(Layer, geglu) F(Layer, local_rope) \
    F(Layer, moe) F(Layer, index) F(Layer, k_scale) F(Layer, v_scale)                                         \
    S(Shape) F(Shape, hidden) F(Shape, heads) F(Shape, kv_heads) F(Shape, head_dim) F(Shape, intermediate)   \
    F(Shape, block_size) F(Shape, eps) F(Shape, scale)                                                        \
    S(Step) F(Step, tokens) F(Step, max_blocks) F(Step, cos) F(Step, sin) F(Step, tables) F(Step, lens)      \
    F(Step, slots) F(Step, normed) F(Step, qkv) F(Step, q) F(Step, k) F(Step, v) F(Step, attn)               \
    F(Step, gate_up) F(Step, act) F(Step, num_threads) F(Step, residual) F(Step, rotary_dim)                  \
    F(Step, cos_local) F(Step, sin_local)
#define SIZE_NAME(S) "sizeof(" #S ") "
#define FIELD_NAME(S, f) #S "." #f " "
#define SIZE_VALUE(S) (int64_t) sizeof(S),
#define FIELD_VALUE(S, f) (int64_t) offsetof(S, f),

/* The names, space-separated, in the order of decoder_layout's values. */
const char *decoder_layout_names(void) { return DECODER_LAYOUT(SIZE_NAME, FIELD_NAME); }

int64_t decoder_layout(int64_t *out, int64_t cap) {
    const int64_t v[] = {DECODER_LAYOUT(SIZE_VALUE, FIELD_VALUE)};
    const int64_t n = (int64_t)(sizeof v / sizeof v[0]);
    for (int64_t i = 0; i < n && i < cap; i++)
        out[i] = v[i];
    return n;
}

/* Returns 0, -1 when the attention kernel could not allocate (nothing after it computed), or
 * -2 when a layer's moe call failed (the caller holds why). */
int decoder_stack(const Kernels *kn, const Layer *layers, int64_t num_layers, const Shape *s, const Step *st,
                  float *x, float *other) {
    const int64_t T = st->tokens, hid = s->hidden, D = s->head_dim, th = st->num_threads;
    const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D, qkv_n = q_size + 2 * kv_size;
    for (int64_t i = 0; i < num_layers; i++) {
        const Layer *l = &layers[i];
        const float *cos = l->local_rope ? st->cos_local : st->cos, *sin = l->local_rope ? st->sin_local : st->sin;
        kn->norm(x, i || st->residual ? other : 0, l->input_norm, st->normed, T, hid, s->eps, th);
        kn->gemm(st->normed, hid, l->qkv, l->qkv_bias, st->qkv, qkv_n, T, qkv_n, hid, th);
        if (l->q_norm)
            kn->qk_rope(st->qkv, qkv_n, cos, sin, l->q_norm, l->k_norm, s->eps, st->q, st->k, st->v, T,
                        s->heads, s->kv_heads, D, th);
        else if (st->rotary_dim == D)
            kn->rope(st->qkv, qkv_n, cos, sin, st->q, st->k, st->v, T, s->heads, s->kv_heads, D, th);
        else
            kn->rope_partial(st->qkv, qkv_n, cos, sin, st->q, st->k, st->v, T, s->heads, s->kv_heads, D,
                             st->rotary_dim, th);
        const int status =
            kn->attn_scaled
                ? kn->attn_scaled(st->q, l->k_cache, l->v_cache, st->tables, st->lens, st->attn, T, s->heads,
                                  s->kv_heads, D, s->block_size, st->max_blocks, s->scale, l->window, th, st->k,
                                  st->v, st->slots, T, l->soft_cap, l->k_scale, l->v_scale)
            : l->soft_cap > 0
                ? kn->attn_capped(st->q, l->k_cache, l->v_cache, st->tables, st->lens, st->attn, T, s->heads,
                                  s->kv_heads, D, s->block_size, st->max_blocks, s->scale, l->window, th, st->k,
                                  st->v, st->slots, T, l->soft_cap)
                : kn->attn(st->q, l->k_cache, l->v_cache, st->tables, st->lens, st->attn, T, s->heads, s->kv_heads,
                           D, s->block_size, st->max_blocks, s->scale, l->window, th, st->k, st->v, st->slots, T);
        if (status != 0)
            return -1;
        kn->gemm(st->attn, q_size, l->o, l->o_bias, other, hid, T, hid, q_size, th);
        if (l->post_attn_norm) /* in place: each row is summed before any of it is written */
            kn->norm(other, 0, l->post_attn_norm, other, T, hid, s->eps, th);
        kn->norm(other, x, l->post_norm, st->normed, T, hid, s->eps, th);
        if (l->moe) {
            if (l->moe(l->index, T) != 0)
                return -2;
        } else {
            kn->gemm(st->normed, hid, l->gate_up, l->gate_up_bias, st->gate_up, 2 * s->intermediate, T,
                     2 * s->intermediate, hid, th);
            (l->geglu ? kn->gelu_tanh : kn->silu)(st->gate_up, 2 * s->intermediate, st->act, T, s->intermediate,
                                                  th);
            kn->gemm(st->act, s->intermediate, l->down, l->down_bias, x, hid, T, hid, s->intermediate, th);
        }
        if (l->post_mlp_norm)
            kn->norm(x, 0, l->post_mlp_norm, x, T, hid, s->eps, th);
    }
    return 0;
}
