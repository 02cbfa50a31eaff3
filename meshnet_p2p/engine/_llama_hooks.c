/*
 * Native hooks for llama.cpp's scheduler: the hidden-state capture (cb_eval)
 * and the abort check (abort_callback).
 *
 * Why C: the scheduler asks the eval callback about every graph node (~470 per
 * decode of a 15-layer shard). A Python ctypes callback costs 0.1-0.3 ms per
 * step, about 4% of decode speed on a small model; this costs nothing.
 *
 * The ggml functions are passed in as pointers (resolved by ctypes from the
 * libggml-base that libllama uses), so this file links against nothing and
 * needs no ggml headers: the tensor is an opaque pointer here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef const char *(*get_name_fn)(const void *tensor);
typedef size_t (*nbytes_fn)(const void *tensor);
typedef void (*tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

/* Must match CaptureState in llama_native.py field for field. */
typedef struct {
    get_name_fn get_name;
    nbytes_fn nbytes;
    tensor_get_fn tensor_get;
    char target[64];        /* e.g. "l_out-9"; empty: capture nothing */
    uint8_t *buf;           /* destination of captured rows */
    uint64_t cap;           /* bytes available at buf */
    uint64_t len;           /* bytes written so far */
    int32_t captures;       /* how many times the target was captured */
    int32_t overflow;       /* set if a capture did not fit */
    volatile int32_t abort; /* set from another thread to abort the decode */
    int32_t stop_after;     /* nonzero: cut the graph after the capture */
} meshnet_capture_state;

__attribute__((visibility("default")))
bool meshnet_capture_eval(void *tensor, bool ask, void *user_data) {
    meshnet_capture_state *s = (meshnet_capture_state *)user_data;
    if (s->target[0] == '\0') {
        return ask ? false : true;
    }
    const char *name = s->get_name(tensor);
    if (name == NULL || strncmp(name, s->target, sizeof(s->target)) != 0) {
        /* Not ours: not interested when asked; keep computing otherwise. */
        return ask ? false : true;
    }
    if (ask) {
        return true;
    }
    size_t n = s->nbytes(tensor);
    if (s->len + n > s->cap) {
        s->overflow = 1;
        return false;
    }
    s->tensor_get(tensor, s->buf + s->len, 0, n);
    s->len += n;
    s->captures += 1;
    /* Returning false ends the current scheduler split: on CPU that skips the
     * final norm and lm_head, which a non-tail shard must not pay for. */
    return s->stop_after ? false : true;
}

__attribute__((visibility("default")))
bool meshnet_abort_check(void *user_data) {
    meshnet_capture_state *s = (meshnet_capture_state *)user_data;
    return s->abort != 0;
}

__attribute__((visibility("default")))
size_t meshnet_capture_state_size(void) {
    return sizeof(meshnet_capture_state);
}

static struct PyModuleDef hooks_module = {
    PyModuleDef_HEAD_INIT, "_llama_hooks",
    "Native llama.cpp scheduler hooks (load with ctypes from __file__).", -1, NULL,
};

PyMODINIT_FUNC PyInit__llama_hooks(void) {
    return PyModule_Create(&hooks_module);
}
