/* The per-step messages (step, batch, act, actions) between msgpack bodies and message objects, in C; and
 * between Godot Variant bodies (the addon's) and messages, by the same code with the Variant form of each value.
 *
 * The same job as broker/protocol/hot.py, for the bodies this package's encoders write, without a Python
 * object per field: the body is read once, each array becomes a numpy view of it, the checks hot.py makes
 * (dtype names, shapes against data lengths, row counts, limits, finite rewards) are made on the way, and the
 * message is built as the message classes' ``unchecked`` constructors build it. Encoding walks the message's
 * parts and writes the bytes msgspec writes for hot.py's structs, large arrays by reference.
 *
 * It accepts a subset of what hot.py accepts (keys in the order the encoders write them, unsigned integers,
 * no infos) and gives the same message; anything else returns None and goes the Python way, which decides
 * and words every refusal. tests/test_native.py checks both ways agree, byte for byte and field for field.
 * No I/O, no state but what configure() is given once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "the wire is little-endian and this module views it in place: build without it (GDRL_BROKER_PURE=1)"
#endif

#define N_DTYPES 11
#define MAX_NDIM_C 32
#define MAX_NVEC_C 256 /* multi-discrete columns rows_match checks in C; wider goes the Python way */

/* --- what configure() hands over: the one place of each fact stays in Python ------------------------- */

static struct {
    int ready;
    PyObject *step_data_type, *game_step_type, *batch_type, *act_type, *actions_type;
    PyObject *dtype_names[N_DTYPES];  /* str, the wire names */
    const char *dtype_utf8[N_DTYPES]; /* the same, as the reader compares them (kept alive by dtype_names) */
    Py_ssize_t dtype_len[N_DTYPES];
    PyArray_Descr *dtypes[N_DTYPES];  /* their numpy dtypes */
    Py_ssize_t max_array_keys, max_text, max_groups, max_ndim;
    uint64_t int_max;
    PyObject *empty_str;
    /* attribute names, interned */
    PyObject *s_tick, *s_groups, *s_step, *s_data, *s_policy, *s_actions, *s_obs, *s_reward, *s_terminated,
        *s_truncated, *s_final_index, *s_final_obs, *s_infos, *s_frames, *s_cast, *s_B, *s_time_limit,
        *s_terminal;
} cfg;

/* A fast-call's argument count, or a TypeError naming the call. */
static int arity(Py_ssize_t nargs, Py_ssize_t expected, const char *usage) {
    if (nargs == expected) return 1;
    PyErr_SetString(PyExc_TypeError, usage);
    return 0;
}

/* --- building messages ------------------------------------------------------------------------------ */

/* The fields of each message class, in constructor order: configure() checks them against the class's
 * __slots__, so a changed class fails at import instead of being built wrong. */
#define MAX_FIELDS 8
typedef struct {
    PyObject **type;
    PyObject **names[MAX_FIELDS];
    int n;
} Layout;

static Layout step_data_layout = {&cfg.step_data_type,
                                  {&cfg.s_obs, &cfg.s_reward, &cfg.s_terminated, &cfg.s_truncated, &cfg.s_final_index,
                                   &cfg.s_final_obs, &cfg.s_infos, &cfg.s_frames},
                                  8};
static Layout game_step_layout = {&cfg.game_step_type, {&cfg.s_tick, &cfg.s_groups}, 2};
static Layout batch_layout = {&cfg.batch_type, {&cfg.s_step, &cfg.s_data, &cfg.s_policy}, 3};
static Layout act_layout = {&cfg.act_type, {&cfg.s_step, &cfg.s_actions, &cfg.s_policy}, 3};
static Layout actions_layout = {&cfg.actions_type, {&cfg.s_tick, &cfg.s_groups}, 2};

/* What the classes' ``unchecked`` does (object.__new__, then object.__setattr__ per field), without the
 * Python frame: the values were checked on the way in. */
static PyObject *make(Layout *layout, PyObject **values) {
    PyObject *empty = PyTuple_New(0);
    PyObject *message = empty ? PyBaseObject_Type.tp_new((PyTypeObject *)*layout->type, empty, NULL) : NULL;
    Py_XDECREF(empty);
    for (int i = 0; message && i < layout->n; i++)
        if (PyObject_GenericSetAttr(message, *layout->names[i], values[i]) < 0) Py_CLEAR(message);
    return message;
}

static int check_layout(Layout *layout, PyObject *type) {
    PyObject *slots = PyObject_GetAttrString(type, "__slots__");
    int ok = slots && PyTuple_Check(slots) && PyTuple_GET_SIZE(slots) == layout->n;
    for (int i = 0; ok && i < layout->n; i++)
        ok = PyUnicode_Check(PyTuple_GET_ITEM(slots, i)) &&
             PyUnicode_Compare(PyTuple_GET_ITEM(slots, i), *layout->names[i]) == 0;
    Py_XDECREF(slots);
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%R has other fields than broker/protocol/_native.c builds", type);
    }
    return ok;
}

/* --- reading msgpack ---------------------------------------------------------------------------------- */

typedef struct {
    const unsigned char *p, *end;
    int godot; /* the body is a Godot Variant (the addon's var_to_bytes), not msgpack: the same fields and order */
} Reader;

static int need(Reader *r, Py_ssize_t n) { return r->end - r->p >= n; }

/* --- reading Godot Variants: the same message layout as msgpack, in the types variant.py's fast reader takes.
 * Each value has a 4-byte little-endian header (type, flags); containers and byte strings a 32-bit count;
 * bytes are padded to 4. Anything else (typed containers, StringName keys) is left to the Python way. */
enum { V_NIL = 0, V_INT = 2, V_STRING = 4, V_DICTIONARY = 27, V_ARRAY = 28, V_PACKED_BYTES = 29, V_INT64 = 2 | 1 << 16 };

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* A value of type ``header`` with a count (at most 0x7fffffff, as Godot's); nothing consumed otherwise. */
static int godot_count(Reader *r, uint32_t header, Py_ssize_t *n) {
    if (!need(r, 8) || le32(r->p) != header || le32(r->p + 4) > 0x7fffffffu) return 0;
    *n = (Py_ssize_t)le32(r->p + 4);
    r->p += 8;
    return 1;
}

/* A String's or PackedByteArray's bytes, then its padding. */
static int godot_bytes(Reader *r, uint32_t header, const unsigned char **s, Py_ssize_t *n) {
    Reader probe = *r;
    if (!godot_count(&probe, header, n)) return 0;
    Py_ssize_t padded = *n + ((4 - (*n & 3)) & 3);
    if (!need(&probe, padded)) return 0;
    *s = probe.p;
    r->p = probe.p + padded;
    return 1;
}

static int godot_uint(Reader *r, uint64_t *v) {
    if (!need(r, 4)) return 0;
    uint32_t header = le32(r->p);
    if (header == V_INT && need(r, 8)) {
        int32_t value = (int32_t)le32(r->p + 4);
        if (value < 0) return 0;
        *v = (uint64_t)value;
        r->p += 8;
        return 1;
    }
    if (header == V_INT64 && need(r, 12)) {
        uint64_t value = (uint64_t)le32(r->p + 4) | (uint64_t)le32(r->p + 8) << 32;
        if (value >> 63) return 0; /* negative */
        *v = value;
        r->p += 12;
        return 1;
    }
    return 0;
}

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* A container or string header: ``fix`` is the fix-form's first byte, ``mask`` its length bits, then the
 * 8/16/32-bit forms' first bytes (0 where the kind has none). */
static int read_len(Reader *r, unsigned fix, unsigned mask, unsigned c8, unsigned c16, unsigned c32, Py_ssize_t *n) {
    if (!need(r, 1)) return 0;
    unsigned c = r->p[0];
    if ((c & ~mask) == fix) {
        *n = c & mask;
        r->p += 1;
        return 1;
    }
    int width = c8 && c == c8 ? 1 : c == c16 ? 2 : c == c32 ? 4 : 0;
    if (!width || !need(r, 1 + width)) return 0;
    *n = (Py_ssize_t)be(r->p + 1, width);
    r->p += 1 + width;
    return 1;
}

static int read_map(Reader *r, Py_ssize_t *n) {
    return r->godot ? godot_count(r, V_DICTIONARY, n) : read_len(r, 0x80, 0x0f, 0, 0xde, 0xdf, n);
}
static int read_array(Reader *r, Py_ssize_t *n) {
    return r->godot ? godot_count(r, V_ARRAY, n) : read_len(r, 0x90, 0x0f, 0, 0xdc, 0xdd, n);
}

static int read_str(Reader *r, const char **s, Py_ssize_t *n) {
    if (r->godot) return godot_bytes(r, V_STRING, (const unsigned char **)s, n);
    if (!read_len(r, 0xa0, 0x1f, 0xd9, 0xda, 0xdb, n) || !need(r, *n)) return 0;
    *s = (const char *)r->p;
    r->p += *n;
    return 1;
}

static int read_bin(Reader *r, const unsigned char **s, Py_ssize_t *n) {
    if (r->godot) return godot_bytes(r, V_PACKED_BYTES, s, n);
    if (!need(r, 1)) return 0;
    unsigned c = r->p[0];
    int width = c == 0xc4 ? 1 : c == 0xc5 ? 2 : c == 0xc6 ? 4 : 0;
    if (!width || !need(r, 1 + width)) return 0;
    *n = (Py_ssize_t)be(r->p + 1, width);
    r->p += 1 + width;
    if (!need(r, *n)) return 0;
    *s = r->p;
    r->p += *n;
    return 1;
}

/* A non-negative integer in any unsigned form (a game may patch its tick into a fixed-width uint32). */
static int read_uint(Reader *r, uint64_t *v) {
    if (r->godot) return godot_uint(r, v);
    if (!need(r, 1)) return 0;
    unsigned c = r->p[0];
    if (c <= 0x7f) {
        *v = c;
        r->p += 1;
        return 1;
    }
    int width = c == 0xcc ? 1 : c == 0xcd ? 2 : c == 0xce ? 4 : c == 0xcf ? 8 : 0;
    if (!width || !need(r, 1 + width)) return 0;
    *v = be(r->p + 1, width);
    r->p += 1 + width;
    return 1;
}

static int is_nil(Reader *r) {
    if (r->godot) {
        if (!need(r, 4) || le32(r->p) != V_NIL) return 0;
        r->p += 4;
        return 1;
    }
    if (need(r, 1) && r->p[0] == 0xc0) {
        r->p += 1;
        return 1;
    }
    return 0;
}

/* The next key is ``key`` (consumed), or nothing is consumed. */
static int key_is(Reader *r, const char *key) {
    Reader probe = *r;
    const char *s;
    Py_ssize_t n;
    size_t len = strlen(key);
    if (!read_str(&probe, &s, &n) || (size_t)n != len || memcmp(s, key, len) != 0) return 0;
    *r = probe;
    return 1;
}

/* Whether the next key is ``key``; nothing is consumed. */
static int key_ahead(Reader *r, const char *key) {
    Reader probe = *r;
    return key_is(&probe, key);
}

static PyObject *read_text(Reader *r) {
    const char *s;
    Py_ssize_t n;
    if (!read_str(r, &s, &n)) return NULL;
    PyObject *text = PyUnicode_DecodeUTF8(s, n, NULL);
    if (text == NULL) PyErr_Clear();
    return text;
}

/* --- arrays ------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject *base; /* what every view keeps alive: the body */
    int writable;
} Body;

static int dtype_index(const char *s, Py_ssize_t n) {
    for (int i = 0; i < N_DTYPES; i++)
        if (cfg.dtype_len[i] == n && memcmp(cfg.dtype_utf8[i], s, n) == 0) return i;
    return -1;
}

/* {"dtype", "shape", "data"}: a view of the data, which must fill the shape exactly. NULL: not this way. */
static PyObject *read_ndarray(Reader *r, Body *body) {
    Py_ssize_t entries, ndim, nbytes;
    const char *name;
    Py_ssize_t name_len;
    const unsigned char *data;
    npy_intp dims[MAX_NDIM_C];
    if (!read_map(r, &entries) || entries != 3 || !key_is(r, "dtype") || !read_str(r, &name, &name_len)) return NULL;
    int dtype = dtype_index(name, name_len);
    if (dtype < 0 || !key_is(r, "shape") || !read_array(r, &ndim) || ndim > cfg.max_ndim || ndim > MAX_NDIM_C)
        return NULL;
    uint64_t count = 1;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        uint64_t size;
        if (!read_uint(r, &size) || size > (uint64_t)PY_SSIZE_T_MAX) return NULL;
        dims[i] = (npy_intp)size;
        if (size && count > (uint64_t)PY_SSIZE_T_MAX / size) return NULL;
        count *= size;
    }
    if (!key_is(r, "data") || !read_bin(r, &data, &nbytes)) return NULL;
    PyArray_Descr *descr = cfg.dtypes[dtype];
    if (count > (uint64_t)PY_SSIZE_T_MAX / (uint64_t)PyDataType_ELSIZE(descr) || count * (uint64_t)PyDataType_ELSIZE(descr) != (uint64_t)nbytes)
        return NULL;
    Py_INCREF(descr); /* stolen by the constructor */
    int flags = NPY_ARRAY_C_CONTIGUOUS | (body->writable ? NPY_ARRAY_WRITEABLE : 0);
    PyObject *array =
        PyArray_NewFromDescr(&PyArray_Type, descr, (int)ndim, dims, NULL, (void *)data, flags, NULL);
    if (array == NULL) {
        PyErr_Clear();
        return NULL;
    }
    Py_INCREF(body->base);
    if (PyArray_SetBaseObject((PyArrayObject *)array, body->base) < 0) {
        PyErr_Clear();
        Py_DECREF(array);
        return NULL;
    }
    return array;
}

/* A map of key -> array, each with ``rows`` leading rows unless ``rows`` < 0. */
static PyObject *read_arrays(Reader *r, Body *body, Py_ssize_t rows) {
    Py_ssize_t n;
    if (!read_map(r, &n) || n > cfg.max_array_keys) return NULL;
    PyObject *arrays = PyDict_New();
    if (arrays == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = read_text(r);
        PyObject *array = key ? read_ndarray(r, body) : NULL;
        int ok = array != NULL;
        if (ok && rows >= 0) {
            PyArrayObject *a = (PyArrayObject *)array;
            ok = PyArray_NDIM(a) >= 1 && PyArray_DIMS(a)[0] == rows;
        }
        if (ok) ok = PyDict_SetItem(arrays, key, array) == 0;
        Py_XDECREF(key);
        Py_XDECREF(array);
        if (!ok) {
            PyErr_Clear();
            Py_DECREF(arrays);
            return NULL;
        }
    }
    return arrays;
}

static int has(PyObject *array, int ndim, int type_num) {
    PyArrayObject *a = (PyArrayObject *)array;
    return PyArray_NDIM(a) == ndim && PyArray_TYPE(a) == type_num;
}

/* A value is NaN or infinite when its exponent bits are all ones. Values are loaded with memcpy (an array
 * viewed in a frame lies wherever msgpack put it, often unaligned), and each block is judged without a branch
 * per value, so the compiler can vectorize it: 400 x 64 observations cost about a microsecond. */
#define FINITE_BLOCK 256

#define DEFINE_FINITE(name, bits_t, exponent)                                                        \
    static int name(const void *data, npy_intp n) {                                                    \
        const char *p = data;                                                                          \
        for (npy_intp start = 0; start < n; start += FINITE_BLOCK) {                                   \
            npy_intp end = start + FINITE_BLOCK < n ? start + FINITE_BLOCK : n;                         \
            bits_t bad = 0;                                                                            \
            for (npy_intp i = start; i < end; i++) {                                                   \
                bits_t bits;                                                                           \
                memcpy(&bits, p + i * sizeof bits, sizeof bits);                                       \
                bad |= (bits_t)((bits & (exponent)) == (exponent));                                    \
            }                                                                                          \
            if (bad) return 0;                                                                         \
        }                                                                                              \
        return 1;                                                                                      \
    }

DEFINE_FINITE(finite_f32, uint32_t, 0x7f800000u)
DEFINE_FINITE(finite_f64, uint64_t, 0x7ff0000000000000ull)

/* --- step data: obs, reward, terminated, truncated, [final], [frames] ----------------------------------- */

/* Reads the step data's fields (``fields`` of them, the map header already read) into a StepData. A batch
 * passes ``policy_follows``: one field left over that is "policy" is left for it, and said there. NULL: not
 * this way. */
static PyObject *read_step_data(Reader *r, Body *body, Py_ssize_t fields, int *policy_follows) {
    PyObject *obs = NULL, *reward = NULL, *terminated = NULL, *truncated = NULL;
    PyObject *final_index = NULL, *final_obs = NULL, *frames = NULL, *result = NULL;
    Py_ssize_t most = policy_follows ? 7 : 6; /* obs, reward, terminated, truncated, final, frames[, policy] */
    if (fields < 4 || fields > most || !key_is(r, "obs") || !(obs = read_arrays(r, body, -1))) goto done;
    if (!key_is(r, "reward") || !(reward = read_ndarray(r, body)) || !has(reward, 1, NPY_FLOAT32)) goto done;
    npy_intp n = PyArray_DIMS((PyArrayObject *)reward)[0];
    if (!finite_f32(PyArray_DATA((PyArrayObject *)reward), n)) goto done;
    if (!key_is(r, "terminated") || !(terminated = read_ndarray(r, body)) || !has(terminated, 1, NPY_BOOL) ||
        PyArray_DIMS((PyArrayObject *)terminated)[0] != n)
        goto done;
    if (!key_is(r, "truncated") || !(truncated = read_ndarray(r, body)) || !has(truncated, 1, NPY_BOOL) ||
        PyArray_DIMS((PyArrayObject *)truncated)[0] != n)
        goto done;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(obs, &pos, &key, &value)) {
        PyArrayObject *a = (PyArrayObject *)value;
        if (PyArray_NDIM(a) < 1 || PyArray_DIMS(a)[0] != n) goto done;
    }
    Py_ssize_t left = fields - 4;
    if (left && key_is(r, "final")) {
        left--;
        if (!is_nil(r)) {
            Py_ssize_t entries;
            if (!read_map(r, &entries) || entries != 2 || !key_is(r, "index")) goto done;
            if (!(final_index = read_ndarray(r, body)) || !has(final_index, 1, NPY_INT32)) goto done;
            npy_intp k = PyArray_DIMS((PyArrayObject *)final_index)[0];
            const char *rows = PyArray_DATA((PyArrayObject *)final_index);
            for (npy_intp i = 0; i < k; i++) {
                int32_t row;
                memcpy(&row, rows + i * sizeof row, sizeof row);
                if (row < 0 || row >= n) goto done;
            }
            if (!key_is(r, "obs") || !(final_obs = read_arrays(r, body, k))) goto done;
        }
    }
    if (left && key_is(r, "frames")) {
        left--;
        if (!(frames = read_ndarray(r, body)) || !has(frames, 1, NPY_INT32) ||
            PyArray_DIMS((PyArrayObject *)frames)[0] != n)
            goto done;
    }
    if (left == 1 && policy_follows && key_ahead(r, "policy")) {
        *policy_follows = 1;
        left = 0;
    }
    if (left) goto done; /* infos, or anything else: the Python way */
    PyObject *infos = PyDict_New(); /* each its own, as unchecked() gives it */
    if (infos == NULL) goto done;
    PyObject *values[] = {obs, reward, terminated, truncated, final_index ? final_index : Py_None,
                          final_obs ? final_obs : Py_None, infos, frames ? frames : Py_None};
    result = make(&step_data_layout, values);
    Py_DECREF(infos);
done:
    if (result == NULL) PyErr_Clear();
    Py_XDECREF(obs);
    Py_XDECREF(reward);
    Py_XDECREF(terminated);
    Py_XDECREF(truncated);
    Py_XDECREF(final_index);
    Py_XDECREF(final_obs);
    Py_XDECREF(frames);
    return result;
}

static PyObject *read_counter(Reader *r) {
    uint64_t v;
    if (!read_uint(r, &v) || v > cfg.int_max) return NULL;
    return PyLong_FromUnsignedLongLong(v);
}

/* A trailing "policy" (batch, act): the text, or "" when absent. */
static PyObject *read_policy(Reader *r, int present) {
    if (!present) {
        Py_INCREF(cfg.empty_str);
        return cfg.empty_str;
    }
    PyObject *policy = key_is(r, "policy") ? read_text(r) : NULL;
    if (policy != NULL && PyUnicode_GET_LENGTH(policy) > cfg.max_text) Py_CLEAR(policy);
    return policy;
}

/* The message of ``layout`` from a, b[, c]; the values are dropped, and NULL (not this way) if any is missing. */
static PyObject *build(Layout *layout, PyObject *a, PyObject *b, PyObject *c) {
    PyObject *values[] = {a, b, c};
    PyObject *message = a && b && (layout->n == 2 || c) ? make(layout, values) : NULL;
    if (message == NULL) PyErr_Clear();
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    return message;
}

static PyObject *decode_step(Reader *r, Body *body, Py_ssize_t entries) {
    Py_ssize_t n;
    if (entries != 3 || !key_is(r, "tick")) return NULL;
    PyObject *tick = read_counter(r);
    if (tick == NULL || !key_is(r, "groups") || !read_map(r, &n) || n < 1 || n > cfg.max_groups) {
        Py_XDECREF(tick);
        return NULL;
    }
    PyObject *groups = PyDict_New();
    for (Py_ssize_t i = 0; groups && i < n; i++) {
        Py_ssize_t fields;
        PyObject *name = read_text(r);
        PyObject *data = name && read_map(r, &fields) ? read_step_data(r, body, fields, NULL) : NULL;
        if (data == NULL || PyDict_SetItem(groups, name, data) < 0) Py_CLEAR(groups);
        Py_XDECREF(name);
        Py_XDECREF(data);
    }
    PyErr_Clear();
    return build(&game_step_layout, tick, groups, NULL);
}

static PyObject *decode_batch(Reader *r, Body *body, Py_ssize_t entries) {
    if (entries < 6 || !key_is(r, "step")) return NULL;
    PyObject *step = read_counter(r);
    if (step == NULL) return NULL;
    int with_policy = 0; /* a policy (samplers' batches) comes last: the step data has the rest */
    PyObject *data = read_step_data(r, body, entries - 2, &with_policy);
    PyObject *policy = data ? read_policy(r, with_policy) : NULL;
    return build(&batch_layout, step, data, policy);
}

static PyObject *decode_act(Reader *r, Body *body, Py_ssize_t entries) {
    if ((entries != 3 && entries != 4) || !key_is(r, "step")) return NULL;
    PyObject *step = read_counter(r);
    PyObject *actions = step && key_is(r, "actions") ? read_arrays(r, body, -1) : NULL;
    PyObject *policy = actions ? read_policy(r, entries == 4) : NULL;
    return build(&act_layout, step, actions, policy);
}

static PyObject *decode_actions(Reader *r, Body *body, Py_ssize_t entries) {
    Py_ssize_t n;
    if (entries != 3 || !key_is(r, "tick")) return NULL;
    PyObject *tick = read_counter(r);
    if (tick == NULL || !key_is(r, "groups") || !read_map(r, &n) || n > cfg.max_groups) {
        Py_XDECREF(tick);
        return NULL;
    }
    PyObject *groups = PyDict_New();
    for (Py_ssize_t i = 0; groups && i < n; i++) {
        PyObject *name = read_text(r);
        PyObject *arrays = name ? read_arrays(r, body, -1) : NULL;
        if (arrays == NULL || PyDict_SetItem(groups, name, arrays) < 0) Py_CLEAR(groups);
        Py_XDECREF(name);
        Py_XDECREF(arrays);
    }
    PyErr_Clear();
    return build(&actions_layout, tick, groups, NULL);
}

static PyObject *decode_message(PyObject *arg, int godot) {
    if (!cfg.ready) {
        PyErr_SetString(PyExc_RuntimeError, "broker.protocol._native is not configured");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    /* The arrays keep a view alive, never a bare bytearray, whose memory could move under them. */
    PyObject *base = PyBytes_CheckExact(arg) || PyMemoryView_Check(arg) ? (Py_INCREF(arg), arg) : PyMemoryView_FromObject(arg);
    Body body = {base, !view.readonly};
    Reader r = {view.buf, (const unsigned char *)view.buf + view.len, godot};
    PyObject *message = NULL;
    Py_ssize_t entries;
    const char *type;
    Py_ssize_t type_len;
    if (base != NULL && read_map(&r, &entries) && key_is(&r, "type") && read_str(&r, &type, &type_len)) {
        if (type_len == 4 && memcmp(type, "step", 4) == 0)
            message = decode_step(&r, &body, entries);
        else if (type_len == 5 && memcmp(type, "batch", 5) == 0)
            message = decode_batch(&r, &body, entries);
        else if (type_len == 3 && memcmp(type, "act", 3) == 0)
            message = decode_act(&r, &body, entries);
        else if (type_len == 7 && memcmp(type, "actions", 7) == 0)
            message = decode_actions(&r, &body, entries);
        if (message != NULL && r.p != r.end) Py_CLEAR(message); /* trailing bytes */
    }
    PyErr_Clear();
    Py_XDECREF(base);
    PyBuffer_Release(&view);
    if (message == NULL) Py_RETURN_NONE;
    return message;
}

static PyObject *native_decode(PyObject *self, PyObject *arg) { return decode_message(arg, 0); }

static PyObject *native_decode_godot(PyObject *self, PyObject *arg) { return decode_message(arg, 1); }

/* --- writing msgpack ---------------------------------------------------------------------------------- */

typedef struct {
    unsigned char *buf;
    Py_ssize_t len, cap;
    PyObject *parts;        /* list: the encoded pieces and the referenced arrays' memory, in order */
    Py_ssize_t piece_start; /* where the piece being written began */
    Py_ssize_t total;       /* body bytes, referenced ones included */
    Py_ssize_t min_bytes;   /* arrays of this many bytes or more go by reference (< 0: never) */
    int writable_too;
    int godot; /* write a Godot Variant (var_to_bytes' bytes, as variant.encode writes them), not msgpack */
} Writer;

static int grow(Writer *w, Py_ssize_t n) {
    if (w->len + n <= w->cap) return 1;
    Py_ssize_t cap = w->cap * 2 > w->len + n ? w->cap * 2 : w->len + n + 256;
    unsigned char *buf = PyMem_Realloc(w->buf, cap);
    if (buf == NULL) return 0;
    w->buf = buf;
    w->cap = cap;
    return 1;
}

static int put(Writer *w, const void *data, Py_ssize_t n) {
    if (!grow(w, n)) return 0;
    memcpy(w->buf + w->len, data, n);
    w->len += n;
    return 1;
}

static int put_be(Writer *w, unsigned first, uint64_t v, int width) {
    unsigned char b[9];
    b[0] = (unsigned char)first;
    for (int i = 0; i < width; i++) b[1 + i] = (unsigned char)(v >> (8 * (width - 1 - i)));
    return put(w, b, 1 + width);
}

static int put_len(Writer *w, unsigned fix, Py_ssize_t fix_max, unsigned c8, unsigned c16, unsigned c32, Py_ssize_t n) {
    if (n <= fix_max) return put_be(w, fix | (unsigned)n, 0, 0);
    if (c8 && n < 0x100) return put_be(w, c8, n, 1);
    if (n < 0x10000) return put_be(w, c16, n, 2);
    return put_be(w, c32, n, 4);
}

static int put_le32(Writer *w, uint32_t value) {
    unsigned char b[4] = {value & 0xff, (value >> 8) & 0xff, (value >> 16) & 0xff, (value >> 24) & 0xff};
    return put(w, b, 4);
}

/* A Variant's 4-byte header and a 32-bit value (a count, a length, an int). */
static int put_le2(Writer *w, uint32_t header, uint32_t value) { return put_le32(w, header) && put_le32(w, value); }

static int put_pad(Writer *w, Py_ssize_t n) {
    static const unsigned char zeros[4] = {0};
    return put(w, zeros, (4 - (n & 3)) & 3);
}

static int put_godot_count(Writer *w, uint32_t header, Py_ssize_t n) {
    return n <= 0x7fffffff && put_le2(w, header, (uint32_t)n);
}

static int put_map(Writer *w, Py_ssize_t n) {
    return w->godot ? put_godot_count(w, V_DICTIONARY, n) : put_len(w, 0x80, 15, 0, 0xde, 0xdf, n);
}
static int put_array(Writer *w, Py_ssize_t n) {
    return w->godot ? put_godot_count(w, V_ARRAY, n) : put_len(w, 0x90, 15, 0, 0xdc, 0xdd, n);
}
/* A Variant's bytes are padded after them: put_ndarray writes the padding. */
static int put_bin_header(Writer *w, Py_ssize_t n) {
    return w->godot ? put_godot_count(w, V_PACKED_BYTES, n) : put_len(w, 0, -1, 0xc4, 0xc5, 0xc6, n);
}

static int put_str(Writer *w, const char *s, Py_ssize_t n) {
    if (w->godot) return put_godot_count(w, V_STRING, n) && put(w, s, n) && put_pad(w, n);
    return put_len(w, 0xa0, 31, 0xd9, 0xda, 0xdb, n) && put(w, s, n);
}

/* Godot's integers: 32-bit unless the value needs 64 (variant.encode's rule, and the engine's). */
static int put_godot_int(Writer *w, long long v) {
    if (v >= INT32_MIN && v <= INT32_MAX) return put_le2(w, V_INT, (uint32_t)(int32_t)v);
    uint64_t u = (uint64_t)v;
    return put_le2(w, V_INT64, (uint32_t)u) && put_le32(w, (uint32_t)(u >> 32));
}

static int put_cstr(Writer *w, const char *s) { return put_str(w, s, (Py_ssize_t)strlen(s)); }

static int put_text(Writer *w, PyObject *text) {
    Py_ssize_t n;
    const char *s = PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, &n) : NULL;
    return s != NULL && put_str(w, s, n);
}

/* msgspec's integers: the smallest form. */
static int put_uint(Writer *w, uint64_t u) {
    if (w->godot) return u <= (uint64_t)INT64_MAX && put_godot_int(w, (long long)u);
    if (u <= 0x7f) return put_be(w, (unsigned)u, 0, 0);
    if (u <= 0xff) return put_be(w, 0xcc, u, 1);
    if (u <= 0xffff) return put_be(w, 0xcd, u, 2);
    if (u <= 0xffffffffULL) return put_be(w, 0xce, u, 4);
    return put_be(w, 0xcf, u, 8);
}

static int put_int(Writer *w, PyObject *value) {
    if (!PyLong_Check(value)) return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) return 0;
    if (w->godot) return put_godot_int(w, v);
    if (v >= 0) return put_uint(w, (uint64_t)v);
    if (v >= -32) return put_be(w, (unsigned)(v & 0xff), 0, 0);
    if (v >= -128) return put_be(w, 0xd0, (uint64_t)v & 0xff, 1);
    if (v >= -32768) return put_be(w, 0xd1, (uint64_t)v & 0xffff, 2);
    if (v >= -2147483648LL) return put_be(w, 0xd2, (uint64_t)v & 0xffffffffULL, 4);
    return put_be(w, 0xd3, (uint64_t)v, 8);
}

static int wire_dtype(PyArrayObject *a) {
    PyArray_Descr *d = PyArray_DESCR(a);
    if (d->byteorder == '>' || PyDataType_HASFIELDS(d) || PyDataType_HASSUBARRAY(d)) return -1;
    for (int i = 0; i < N_DTYPES; i++)
        if (cfg.dtypes[i]->kind == d->kind && PyDataType_ELSIZE(cfg.dtypes[i]) == PyDataType_ELSIZE(d)) return i;
    return -1;
}

/* Ends the piece being written and appends ``memory`` after it. */
static int put_reference(Writer *w, PyObject *array, Py_ssize_t nbytes) {
    if (w->len > w->piece_start) {
        PyObject *piece = PyBytes_FromStringAndSize((const char *)w->buf + w->piece_start, w->len - w->piece_start);
        int ok = piece != NULL && PyList_Append(w->parts, piece) == 0;
        Py_XDECREF(piece);
        if (!ok) return 0;
    }
    PyObject *view = PyMemoryView_FromObject(array);
    PyObject *bytes = view ? PyObject_CallMethodOneArg(view, cfg.s_cast, cfg.s_B) : NULL;
    Py_XDECREF(view);
    int ok = bytes != NULL && PyList_Append(w->parts, bytes) == 0;
    Py_XDECREF(bytes);
    w->piece_start = w->len;
    w->total += nbytes;
    return ok;
}

/* {"dtype", "shape", "data"} as hot._array_out writes it; 0: not this way (a cast, a copy or a 0-d array). */
static int put_ndarray(Writer *w, PyObject *value, int by_reference) {
    if (!PyArray_Check(value)) return 0;
    PyArrayObject *a = (PyArrayObject *)value;
    int dtype = wire_dtype(a);
    int ndim = PyArray_NDIM(a);
    if (dtype < 0 || ndim == 0 || !PyArray_IS_C_CONTIGUOUS(a)) return 0;
    if (!put_map(w, 3) || !put_cstr(w, "dtype") || !put_text(w, cfg.dtype_names[dtype]) || !put_cstr(w, "shape") ||
        !put_array(w, ndim))
        return 0;
    for (int i = 0; i < ndim; i++)
        if (!put_uint(w, (uint64_t)PyArray_DIMS(a)[i])) return 0;
    Py_ssize_t nbytes = PyArray_NBYTES(a);
    if (!put_cstr(w, "data") || !put_bin_header(w, nbytes)) return 0;
    if (w->godot) return put(w, PyArray_DATA(a), nbytes) && put_pad(w, nbytes); /* never by reference */
    if (by_reference && w->min_bytes >= 0 && nbytes >= w->min_bytes && (w->writable_too || !PyArray_ISWRITEABLE(a)))
        return put_reference(w, value, nbytes);
    return put(w, PyArray_DATA(a), nbytes);
}

static int put_arrays(Writer *w, PyObject *arrays, int by_reference) {
    if (!PyDict_Check(arrays) || !put_map(w, PyDict_GET_SIZE(arrays))) return 0;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(arrays, &pos, &key, &value))
        if (!put_text(w, key) || !put_ndarray(w, value, by_reference)) return 0;
    return 1;
}

/* A StepData's parts, read before anything is written: the map headers need their counts first. */
typedef struct {
    PyObject *obs, *reward, *terminated, *truncated, *final_index, *final_obs, *infos, *frames;
    int with_final;
    Py_ssize_t count; /* fields to write: hot._step_data_parts under msgspec's omit_defaults */
} Parts;

static void drop_parts(Parts *p) {
    Py_XDECREF(p->obs);
    Py_XDECREF(p->reward);
    Py_XDECREF(p->terminated);
    Py_XDECREF(p->truncated);
    Py_XDECREF(p->final_index);
    Py_XDECREF(p->final_obs);
    Py_XDECREF(p->infos);
    Py_XDECREF(p->frames);
}

static int get_parts(PyObject *data, Parts *p) {
    memset(p, 0, sizeof *p);
    p->obs = PyObject_GetAttr(data, cfg.s_obs);
    p->reward = PyObject_GetAttr(data, cfg.s_reward);
    p->terminated = PyObject_GetAttr(data, cfg.s_terminated);
    p->truncated = PyObject_GetAttr(data, cfg.s_truncated);
    p->final_index = PyObject_GetAttr(data, cfg.s_final_index);
    p->final_obs = PyObject_GetAttr(data, cfg.s_final_obs);
    p->infos = PyObject_GetAttr(data, cfg.s_infos);
    p->frames = PyObject_GetAttr(data, cfg.s_frames);
    if (!p->obs || !p->reward || !p->terminated || !p->truncated || !p->final_index || !p->final_obs || !p->infos ||
        !p->frames)
        return 0;
    if (PyObject_IsTrue(p->infos) != 0) return 0; /* infos (or an error): the Python way */
    p->with_final = p->final_index != Py_None && p->final_obs != Py_None && PyObject_Length(p->final_index) > 0;
    if (PyErr_Occurred()) return 0;
    p->count = 4 + p->with_final + (p->frames != Py_None);
    return 1;
}

static int put_parts(Writer *w, Parts *p) {
    if (!put_cstr(w, "obs") || !put_arrays(w, p->obs, 1) || !put_cstr(w, "reward") || !put_ndarray(w, p->reward, 0) ||
        !put_cstr(w, "terminated") || !put_ndarray(w, p->terminated, 0) || !put_cstr(w, "truncated") ||
        !put_ndarray(w, p->truncated, 0))
        return 0;
    if (p->with_final && (!put_cstr(w, "final") || !put_map(w, 2) || !put_cstr(w, "index") ||
                          !put_ndarray(w, p->final_index, 0) || !put_cstr(w, "obs") || !put_arrays(w, p->final_obs, 1)))
        return 0;
    return p->frames == Py_None || (put_cstr(w, "frames") && put_ndarray(w, p->frames, 0));
}

static int put_batch(Writer *w, PyObject *message) {
    PyObject *step = PyObject_GetAttr(message, cfg.s_step), *data = PyObject_GetAttr(message, cfg.s_data);
    PyObject *policy = PyObject_GetAttr(message, cfg.s_policy);
    int named = policy ? PyObject_IsTrue(policy) : -1;
    Parts parts = {0};
    int ok = step && data && named >= 0 && get_parts(data, &parts) && put_map(w, 2 + parts.count + named) &&
             put_cstr(w, "type") && put_cstr(w, "batch") && put_cstr(w, "step") && put_int(w, step) &&
             put_parts(w, &parts) && (!named || (put_cstr(w, "policy") && put_text(w, policy)));
    drop_parts(&parts);
    Py_XDECREF(step);
    Py_XDECREF(data);
    Py_XDECREF(policy);
    return ok;
}

static int put_act(Writer *w, PyObject *message) {
    PyObject *step = PyObject_GetAttr(message, cfg.s_step), *actions = PyObject_GetAttr(message, cfg.s_actions);
    PyObject *policy = PyObject_GetAttr(message, cfg.s_policy);
    int named = policy ? PyObject_IsTrue(policy) : -1;
    int ok = step && actions && named >= 0 && put_map(w, 3 + named) && put_cstr(w, "type") && put_cstr(w, "act") &&
             put_cstr(w, "step") && put_int(w, step) && put_cstr(w, "actions") && put_arrays(w, actions, 1) &&
             (!named || (put_cstr(w, "policy") && put_text(w, policy)));
    Py_XDECREF(step);
    Py_XDECREF(actions);
    Py_XDECREF(policy);
    return ok;
}

/* A step (groups of step data) or actions (groups of action arrays) message. */
static int put_groups(Writer *w, PyObject *message, int is_step) {
    PyObject *tick = PyObject_GetAttr(message, cfg.s_tick), *groups = PyObject_GetAttr(message, cfg.s_groups);
    int ok = tick && groups && PyDict_Check(groups) && put_map(w, 3) && put_cstr(w, "type") &&
             put_cstr(w, is_step ? "step" : "actions") && put_cstr(w, "tick") && put_int(w, tick) &&
             put_cstr(w, "groups") && put_map(w, PyDict_GET_SIZE(groups));
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (ok && PyDict_Next(groups, &pos, &key, &value)) {
        if (!put_text(w, key)) {
            ok = 0;
        } else if (is_step) {
            Parts parts;
            ok = get_parts(value, &parts) && put_map(w, parts.count) && put_parts(w, &parts);
            drop_parts(&parts);
        } else {
            ok = put_arrays(w, value, 1);
        }
    }
    Py_XDECREF(tick);
    Py_XDECREF(groups);
    return ok;
}

static int put_message(Writer *w, PyObject *message) {
    PyTypeObject *type = Py_TYPE(message);
    if (type == (PyTypeObject *)cfg.batch_type) return put_batch(w, message);
    if (type == (PyTypeObject *)cfg.act_type) return put_act(w, message);
    if (type == (PyTypeObject *)cfg.game_step_type) return put_groups(w, message, 1);
    if (type == (PyTypeObject *)cfg.actions_type) return put_groups(w, message, 0);
    return 0;
}

/* encode(message, min_bytes, writable_too) -> list of buffers (the first with the frame header), or None.
 * Arrays of ``min_bytes`` or more go by reference (read-only ones only, unless ``writable_too``); a negative
 * ``min_bytes``: none. Joined, the buffers are hot.encode_hot_frame's bytes. */
static PyObject *encode_frame(PyObject *message, Py_ssize_t min_bytes, int writable_too, int godot) {
    if (!cfg.ready) {
        PyErr_SetString(PyExc_RuntimeError, "broker.protocol._native is not configured");
        return NULL;
    }
    /* The first piece begins with the frame's 4 header bytes (one write for them and the body's beginning),
     * filled in once the body's size is known. */
    Writer w = {NULL, 0, 0, PyList_New(0), 0, 0, min_bytes, writable_too, godot};
    if (w.parts == NULL) return NULL;
    PyObject *result = NULL;
    if (grow(&w, 512)) {
        w.len = 4;
        if (put_message(&w, message) && w.total + (w.len - 4) <= (Py_ssize_t)UINT32_MAX) {
            uint32_t size = (uint32_t)(w.total + (w.len - 4));
            unsigned char header[4] = {size & 0xff, (size >> 8) & 0xff, (size >> 16) & 0xff, (size >> 24) & 0xff};
            if (PyList_GET_SIZE(w.parts) == 0) /* the header's piece is still in the buffer */
                memcpy(w.buf, header, 4);
            else /* a bytes object made here, seen by nobody yet: written in place */
                memcpy(PyBytes_AS_STRING(PyList_GET_ITEM(w.parts, 0)), header, 4);
            result = w.parts;
            if (w.len > w.piece_start) {
                PyObject *piece = PyBytes_FromStringAndSize((const char *)w.buf + w.piece_start, w.len - w.piece_start);
                if (piece == NULL || PyList_Append(w.parts, piece) < 0) result = NULL;
                Py_XDECREF(piece);
            }
        }
    }
    PyMem_Free(w.buf);
    if (result == NULL) {
        Py_DECREF(w.parts);
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return result;
}

static PyObject *native_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 3, "encode(message, min_bytes, writable_too)")) return NULL;
    Py_ssize_t min_bytes = PyLong_AsSsize_t(args[1]);
    int writable_too = PyObject_IsTrue(args[2]);
    if ((min_bytes == -1 || writable_too < 0) && PyErr_Occurred()) return NULL;
    return encode_frame(args[0], min_bytes, writable_too, 0);
}

/* encode_godot(message) -> the frame (header and Variant body) as bytes, or None. Nothing goes by reference. */
static PyObject *native_encode_godot(PyObject *self, PyObject *message) {
    PyObject *parts = encode_frame(message, -1, 0, 1);
    if (parts == NULL || parts == Py_None) return parts;
    PyObject *frame = PyList_GET_SIZE(parts) == 1 ? PyList_GET_ITEM(parts, 0) : NULL;
    Py_XINCREF(frame);
    Py_DECREF(parts);
    if (frame == NULL) Py_RETURN_NONE;
    return frame;
}

/* all_finite(array) -> bool, or None for what this does not read (the caller's numpy way decides). */
static PyObject *native_all_finite(PyObject *self, PyObject *arg) {
    if (!PyArray_Check(arg)) Py_RETURN_NONE;
    PyArrayObject *a = (PyArrayObject *)arg;
    if (!PyArray_IS_C_CONTIGUOUS(a) || PyArray_ISBYTESWAPPED(a)) Py_RETURN_NONE;
    int ok;
    if (PyArray_TYPE(a) == NPY_FLOAT32)
        ok = finite_f32(PyArray_DATA(a), PyArray_SIZE(a));
    else if (PyArray_TYPE(a) == NPY_FLOAT64)
        ok = finite_f64(PyArray_DATA(a), PyArray_SIZE(a));
    else
        Py_RETURN_NONE;
    return PyBool_FromLong(ok);
}

/* --- episode ends: the per-step questions the hub asks of a step's flags, without temporary arrays ------ */

/* A 1-d bool array's bytes, or NULL (the caller's numpy way decides). */
static const unsigned char *flags_of(PyObject *array, npy_intp n) {
    if (!PyArray_Check(array)) return NULL;
    PyArrayObject *a = (PyArrayObject *)array;
    if (PyArray_TYPE(a) != NPY_BOOL || PyArray_NDIM(a) != 1 || PyArray_DIMS(a)[0] != n || !PyArray_IS_C_CONTIGUOUS(a))
        return NULL;
    return PyArray_DATA(a);
}

static npy_intp rows_of(PyObject *array) {
    return PyArray_Check(array) && PyArray_NDIM((PyArrayObject *)array) == 1 ? PyArray_DIMS((PyArrayObject *)array)[0]
                                                                               : -1;
}

/* The rows of a step's terminated and truncated flags (1-d bool arrays of one length) and their bytes, or -1
 * when they are not that (the caller's numpy way decides). */
static npy_intp read_flags(PyObject *terminated, PyObject *truncated, const unsigned char **t, const unsigned char **u) {
    npy_intp n = rows_of(terminated);
    *t = n >= 0 ? flags_of(terminated, n) : NULL;
    *u = *t ? flags_of(truncated, n) : NULL;
    return *u ? n : -1;
}

/* ended_rows(terminated, truncated) -> int: rows whose episode ended (either flag), or None. */
static PyObject *native_ended_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 2, "ended_rows(terminated, truncated)")) return NULL;
    const unsigned char *terminated, *truncated;
    npy_intp n = read_flags(args[0], args[1], &terminated, &truncated);
    if (n < 0) Py_RETURN_NONE;
    npy_intp count = 0;
    for (npy_intp i = 0; i < n; i++) count += (terminated[i] | truncated[i]) != 0;
    return PyLong_FromSsize_t(count);
}

/* as_is(terminated, truncated, final_index, final_obs) -> bool, or None: accumulate._as_is's question (a
 * step that can be delivered unchanged as one tick: no row both terminated and truncated, and the final
 * observations given for exactly the rows that ended). */
static PyObject *native_as_is(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 4, "as_is(terminated, truncated, final_index, final_obs)")) return NULL;
    const unsigned char *terminated, *truncated;
    npy_intp n = read_flags(args[0], args[1], &terminated, &truncated);
    if (n < 0) Py_RETURN_NONE;
    PyObject *index = args[2];
    npy_intp ended = 0, both = 0;
    for (npy_intp i = 0; i < n; i++) {
        ended += (terminated[i] | truncated[i]) != 0;
        both += (terminated[i] & truncated[i]) != 0;
    }
    if (ended == 0) {
        if (index == Py_None) Py_RETURN_TRUE;
        npy_intp k = rows_of(index);
        if (k < 0) Py_RETURN_NONE;
        return PyBool_FromLong(k == 0);
    }
    if (index == Py_None || args[3] == Py_None || both) Py_RETURN_FALSE;
    PyArrayObject *a = (PyArrayObject *)index;
    if (!PyArray_Check(index) || PyArray_NDIM(a) != 1 || PyArray_TYPE(a) != NPY_INT32 || !PyArray_IS_C_CONTIGUOUS(a))
        Py_RETURN_NONE;
    npy_intp k = PyArray_DIMS(a)[0];
    if (k != ended) Py_RETURN_FALSE;
    const char *rows = PyArray_DATA(a);
    for (npy_intp i = 0; i < k; i++) {
        int32_t row;
        memcpy(&row, rows + i * sizeof row, sizeof row);
        if (row < 0 || row >= n) Py_RETURN_NONE; /* numpy's indexing decides what that means */
        if (!(terminated[row] | truncated[row])) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* add_returns(returns, reward, terminated, truncated) -> list[float] | None: each row's reward added to its
 * running return (float64, in place); the rows whose episode ended give their return (in row order) and
 * start again from 0. None, and nothing changed, for arrays this does not read (numpy's way then). */
static PyObject *native_add_returns(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 4, "add_returns(returns, reward, terminated, truncated)")) return NULL;
    PyArrayObject *returns = (PyArrayObject *)args[0], *reward = (PyArrayObject *)args[1];
    const unsigned char *terminated, *truncated;
    npy_intp n = read_flags(args[2], args[3], &terminated, &truncated);
    if (n < 0 || rows_of(args[1]) != n || !PyArray_Check(args[0]) || PyArray_TYPE(returns) != NPY_FLOAT64 ||
        PyArray_NDIM(returns) != 1 || PyArray_DIMS(returns)[0] != n || !PyArray_IS_C_CONTIGUOUS(returns) ||
        !PyArray_ISALIGNED(returns) || !PyArray_ISWRITEABLE(returns) || PyArray_TYPE(reward) != NPY_FLOAT32 ||
        !PyArray_IS_C_CONTIGUOUS(reward) || PyArray_ISBYTESWAPPED(reward))
        Py_RETURN_NONE;
    double *sums = PyArray_DATA(returns);
    const char *rewards = PyArray_DATA(reward);
    PyObject *ended = PyList_New(0);
    for (npy_intp i = 0; ended && i < n; i++) {
        float r;
        memcpy(&r, rewards + i * sizeof r, sizeof r);
        sums[i] += (double)r;
        if (terminated[i] | truncated[i]) {
            PyObject *value = PyFloat_FromDouble(sums[i]);
            if (value == NULL || PyList_Append(ended, value) < 0) Py_CLEAR(ended);
            Py_XDECREF(value);
            sums[i] = 0.0;
        }
    }
    return ended;
}

/* step_ends(terminated, truncated, frames) -> (dones, infos, ended) | None: what SB3's step_wait returns of a
 * step's ends: ``dones`` (terminated or truncated, a new bool array), one info dict per env
 * ({"TimeLimit.truncated": truncated and not terminated}, and "frames" from int32 rows when given) and how many
 * rows ended. None for arrays this does not read (numpy's way then). */
static PyObject *native_step_ends(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 3, "step_ends(terminated, truncated, frames)")) return NULL;
    const unsigned char *terminated, *truncated;
    npy_intp n = read_flags(args[0], args[1], &terminated, &truncated);
    if (n < 0) Py_RETURN_NONE;
    const char *frames = NULL;
    if (args[2] != Py_None) {
        PyArrayObject *f = (PyArrayObject *)args[2];
        if (!PyArray_Check(args[2]) || PyArray_TYPE(f) != NPY_INT32 || PyArray_NDIM(f) != 1 ||
            PyArray_DIMS(f)[0] != n || !PyArray_IS_C_CONTIGUOUS(f) || PyArray_ISBYTESWAPPED(f))
            Py_RETURN_NONE;
        frames = PyArray_DATA(f);
    }
    PyObject *dones = PyArray_SimpleNew(1, &n, NPY_BOOL);
    PyObject *infos = dones ? PyList_New(n) : NULL;
    npy_intp ended = 0;
    unsigned char *done = dones ? PyArray_DATA((PyArrayObject *)dones) : NULL;
    for (npy_intp i = 0; infos && i < n; i++) {
        done[i] = (terminated[i] | truncated[i]) != 0;
        ended += done[i];
        PyObject *info = PyDict_New();
        int ok = info != NULL &&
                 PyDict_SetItem(info, cfg.s_time_limit, (truncated[i] && !terminated[i]) ? Py_True : Py_False) == 0;
        if (ok && frames) {
            int32_t count;
            memcpy(&count, frames + i * sizeof count, sizeof count);
            PyObject *value = PyLong_FromLong(count);
            ok = value != NULL && PyDict_SetItem(info, cfg.s_frames, value) == 0;
            Py_XDECREF(value);
        }
        if (!ok) {
            Py_XDECREF(info);
            Py_CLEAR(infos);
            break;
        }
        PyList_SET_ITEM(infos, i, info);
    }
    if (infos == NULL) {
        Py_XDECREF(dones);
        return NULL;
    }
    return Py_BuildValue("(NNn)", dones, infos, (Py_ssize_t)ended);
}

/* clip_unit(actions) -> float32 array | None: SB3's actions for a lone Box action key, as the clients send
 * them: a new (n, columns) float32 array (a 1-d array becomes one column), each value clipped to [-1, 1] as
 * np.minimum(np.maximum(a, -1), 1) clips it (NaN stays NaN). None for arrays this does not read. */
static PyObject *native_clip_unit(PyObject *self, PyObject *arg) {
    if (!PyArray_Check(arg)) Py_RETURN_NONE;
    PyArrayObject *a = (PyArrayObject *)arg;
    int type = PyArray_TYPE(a), ndim = PyArray_NDIM(a);
    if ((type != NPY_FLOAT32 && type != NPY_FLOAT64) || (ndim != 1 && ndim != 2) || !PyArray_IS_C_CONTIGUOUS(a) ||
        !PyArray_ISALIGNED(a) || PyArray_ISBYTESWAPPED(a))
        Py_RETURN_NONE;
    npy_intp dims[2] = {PyArray_DIMS(a)[0], ndim == 2 ? PyArray_DIMS(a)[1] : 1};
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (out == NULL) return NULL;
    float *to = PyArray_DATA((PyArrayObject *)out);
    npy_intp size = dims[0] * dims[1];
    if (type == NPY_FLOAT32) {
        const float *from = PyArray_DATA(a);
        for (npy_intp i = 0; i < size; i++) {
            float v = from[i];
            to[i] = v < -1.0f ? -1.0f : v > 1.0f ? 1.0f : v;
        }
    } else {
        const double *from = PyArray_DATA(a);
        for (npy_intp i = 0; i < size; i++) {
            double v = from[i];
            to[i] = (float)(v < -1.0 ? -1.0 : v > 1.0 ? 1.0 : v);
        }
    }
    return out;
}

/* owned_arrays(arrays, plan) -> dict | None: clients.spaces.ObsConverter's common case. ``plan`` holds (key,
 * dtype) pairs in the space's order; each array of that exact dtype, C-contiguous, is handed over as it is
 * when writable, else copied into a new array of its own. None when any key is missing or needs a cast or a
 * layout change (numpy's way then). */
static PyObject *native_owned_arrays(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 2, "owned_arrays(arrays, plan)")) return NULL;
    PyObject *arrays = args[0], *plan = args[1];
    if (!PyDict_CheckExact(arrays) || !PyTuple_CheckExact(plan)) Py_RETURN_NONE;
    Py_ssize_t n = PyTuple_GET_SIZE(plan);
    for (Py_ssize_t j = 0; j < n; j++) { /* decided before anything is built */
        PyObject *entry = PyTuple_GET_ITEM(plan, j);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 || !PyArray_DescrCheck(PyTuple_GET_ITEM(entry, 1)))
            Py_RETURN_NONE;
        PyObject *value = PyDict_GetItemWithError(arrays, PyTuple_GET_ITEM(entry, 0));
        if (value == NULL) {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
        PyArrayObject *a = (PyArrayObject *)value;
        if (!PyArray_Check(value) || !PyArray_IS_C_CONTIGUOUS(a) ||
            !PyArray_EquivTypes(PyArray_DESCR(a), (PyArray_Descr *)PyTuple_GET_ITEM(entry, 1)))
            Py_RETURN_NONE;
    }
    PyObject *out = PyDict_New();
    for (Py_ssize_t j = 0; out && j < n; j++) {
        PyObject *entry = PyTuple_GET_ITEM(plan, j), *key = PyTuple_GET_ITEM(entry, 0);
        PyArrayObject *a = (PyArrayObject *)PyDict_GetItem(arrays, key);
        PyObject *owned = PyArray_ISWRITEABLE(a) ? Py_NewRef(a) : PyArray_NewCopy(a, NPY_CORDER);
        if (owned == NULL || PyDict_SetItem(out, key, owned) < 0) Py_CLEAR(out);
        Py_XDECREF(owned);
    }
    return out;
}

/* A new C-contiguous array holding row ``row`` of ``source`` (C-contiguous, ndim >= 2), of ``source``'s dtype:
 * what ``source[row].copy()`` gives, without the view. */
static PyObject *row_copy(PyArrayObject *source, npy_intp row) {
    PyArray_Descr *descr = PyArray_DESCR(source);
    Py_INCREF(descr);
    PyObject *out = PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(source) - 1, PyArray_DIMS(source) + 1,
                                         NULL, NULL, 0, NULL);
    if (out == NULL) return NULL;
    npy_intp bytes = PyArray_NBYTES((PyArrayObject *)out);
    memcpy(PyArray_DATA((PyArrayObject *)out), PyArray_BYTES(source) + row * bytes, (size_t)bytes);
    return out;
}

/* Whether ``value`` is an array row_copy reads: C-contiguous, ndim >= 2, ``rows`` rows (and, given, of ``dtype``). */
static int rows_array(PyObject *value, npy_intp rows, PyObject *dtype) {
    if (!PyArray_Check(value)) return 0;
    PyArrayObject *a = (PyArrayObject *)value;
    return PyArray_NDIM(a) >= 2 && PyArray_DIMS(a)[0] == rows && PyArray_IS_C_CONTIGUOUS(a) &&
           (dtype == NULL || PyArray_EquivTypes(PyArray_DESCR(a), (PyArray_Descr *)dtype));
}

/* terminal_obs(infos, dones, final_index, final_obs, obs, plan) -> True | None: SB3's "terminal_observation" in the
 * info of every row that ended: a new array per key of the game's final observation of that row when the step
 * has one (the last entry of final_index naming the row), else of the row of ``obs`` (the step's own, as
 * godot_rl gives it). ``plan``: ObsConverter's (key, dtype) pairs, the dtype each final observation must have.
 * None, and nothing changed, for what this does not read: a cast, 1-d arrays, other layouts (numpy's way). */
static PyObject *native_terminal_obs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 6, "terminal_obs(infos, dones, final_index, final_obs, obs, plan)")) return NULL;
    PyObject *infos = args[0], *index = args[2], *final_obs = args[3], *obs = args[4], *plan = args[5];
    if (!PyList_CheckExact(infos) || !PyDict_CheckExact(obs) || !PyTuple_CheckExact(plan)) Py_RETURN_NONE;
    npy_intp n = PyList_GET_SIZE(infos);
    const unsigned char *done = flags_of(args[1], n);
    if (done == NULL) Py_RETURN_NONE;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(obs, &pos, &key, &value))
        if (!rows_array(value, n, NULL)) Py_RETURN_NONE;
    npy_intp k = 0;
    const char *rows = NULL;
    int finals = index != Py_None && final_obs != Py_None;
    if (finals) {
        PyArrayObject *a = (PyArrayObject *)index;
        if (!PyArray_Check(index) || PyArray_NDIM(a) != 1 || PyArray_TYPE(a) != NPY_INT32 ||
            !PyArray_IS_C_CONTIGUOUS(a) || PyArray_ISBYTESWAPPED(a) || !PyDict_CheckExact(final_obs))
            Py_RETURN_NONE;
        k = PyArray_DIMS(a)[0];
        rows = PyArray_DATA(a);
        pos = 0;
        while (PyDict_Next(final_obs, &pos, &key, &value)) {
            PyObject *dtype = NULL;
            for (Py_ssize_t j = 0; dtype == NULL && j < PyTuple_GET_SIZE(plan); j++) {
                PyObject *entry = PyTuple_GET_ITEM(plan, j);
                if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2) Py_RETURN_NONE;
                int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, 0), key, Py_EQ);
                if (same < 0) return NULL;
                if (same) dtype = PyTuple_GET_ITEM(entry, 1);
            }
            if (dtype == NULL || !PyArray_DescrCheck(dtype) || !rows_array(value, k, dtype)) Py_RETURN_NONE;
        }
    }
    for (npy_intp i = 0; i < n; i++)
        if (done[i] && !PyDict_CheckExact(PyList_GET_ITEM(infos, i))) Py_RETURN_NONE;
    /* Each row's entry in final_index (the last one naming it), -1 for none: one pass, as a dict of them would. */
    npy_intp *final_of = PyMem_Malloc(sizeof(npy_intp) * (size_t)(n ? n : 1));
    if (final_of == NULL) return PyErr_NoMemory();
    for (npy_intp i = 0; i < n; i++) final_of[i] = -1;
    for (npy_intp j = 0; j < k; j++) {
        int32_t row;
        memcpy(&row, rows + j * sizeof row, sizeof row);
        if (row >= 0 && row < n) final_of[row] = j;
    }
    PyObject *result = Py_True;
    for (npy_intp i = 0; result && i < n; i++) {
        if (!done[i]) continue;
        PyObject *source = final_of[i] >= 0 ? final_obs : obs, *terminal = PyDict_New();
        npy_intp row = final_of[i] >= 0 ? final_of[i] : i;
        pos = 0;
        while (terminal && PyDict_Next(source, &pos, &key, &value)) {
            PyObject *copy = row_copy((PyArrayObject *)value, row);
            if (copy == NULL || PyDict_SetItem(terminal, key, copy) < 0) Py_CLEAR(terminal);
            Py_XDECREF(copy);
        }
        if (terminal == NULL || PyDict_SetItem(PyList_GET_ITEM(infos, i), cfg.s_terminal, terminal) < 0) result = NULL;
        Py_XDECREF(terminal);
    }
    PyMem_Free(final_of);
    return Py_XNewRef(result);
}

/* new(cls, *values) -> message: cls.unchecked(*values) for the step data and the per-step messages (every
 * field given, in constructor order), without the Python frame. A TypeError for any other class or count. */
static PyObject *native_new(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Layout *layouts[] = {&step_data_layout, &game_step_layout, &batch_layout, &act_layout, &actions_layout};
    for (size_t j = 0; cfg.ready && nargs >= 1 && j < sizeof layouts / sizeof layouts[0]; j++)
        if (args[0] == *layouts[j]->type && nargs - 1 == layouts[j]->n) return make(layouts[j], (PyObject **)args + 1);
    PyErr_SetString(PyExc_TypeError, "new(cls, *values): a configured message class and every one of its fields");
    return NULL;
}

/* --- the per-step checks and the batch's stacking: the common case in one call ---------------------- */

/* A layout entry's values hold: every value of a float array finite; an int32 array's values in [0, n) for a
 * discrete space (bound: an int) or in [0, nvec[column]) for a multi-discrete one (bound: a tuple); no value
 * check for bound None. -1: not read here (the caller's Python way decides). */
static int values_hold(PyArrayObject *a, PyObject *bound) {
    npy_intp size = PyArray_SIZE(a);
    int type = PyArray_TYPE(a);
    if (type == NPY_FLOAT32) return bound == Py_None ? finite_f32(PyArray_DATA(a), size) : -1;
    if (type == NPY_FLOAT64) return bound == Py_None ? finite_f64(PyArray_DATA(a), size) : -1;
    if (bound == Py_None) return 1;
    if (type != NPY_INT32) return -1;
    const char *data = PyArray_DATA(a);
    if (PyLong_CheckExact(bound)) {
        long n = PyLong_AsLong(bound);
        if (n == -1 && PyErr_Occurred()) return -1;
        for (npy_intp i = 0; i < size; i++) {
            int32_t v;
            memcpy(&v, data + i * sizeof v, sizeof v);
            if (v < 0 || v >= n) return 0;
        }
        return 1;
    }
    if (!PyTuple_CheckExact(bound) || PyArray_NDIM(a) != 2) return -1;
    npy_intp columns = PyArray_DIMS(a)[1];
    if (PyTuple_GET_SIZE(bound) != columns || columns > MAX_NVEC_C) return -1;
    long nvec[MAX_NVEC_C];
    for (npy_intp c = 0; c < columns; c++) {
        nvec[c] = PyLong_AsLong(PyTuple_GET_ITEM(bound, c));
        if (nvec[c] == -1 && PyErr_Occurred()) return -1;
    }
    for (npy_intp i = 0; i < size; i++) {
        int32_t v;
        memcpy(&v, data + i * sizeof v, sizeof v);
        if (v < 0 || v >= nvec[i % columns]) return 0;
    }
    return 1;
}

/* rows_match(arrays, layout, n_rows) -> True, or None: spaces.check_rows' common case, decided in one call.
 * ``layout`` is spaces.check_layout's tuple of (key, numpy dtype, row shape, bound). True when ``arrays`` (a dict)
 * has exactly the layout's keys in its order, each a C-contiguous array of the key's dtype with n_rows rows of
 * its row shape, whose values hold (values_hold). None for anything else, a refusal included: check_rows then
 * decides and words it. */
static PyObject *native_rows_match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 3, "rows_match(arrays, layout, n_rows)")) return NULL;
    PyObject *arrays = args[0], *layout = args[1];
    Py_ssize_t n_rows = PyLong_AsSsize_t(args[2]);
    if (n_rows == -1 && PyErr_Occurred()) return NULL;
    if (!PyDict_CheckExact(arrays) || !PyTuple_CheckExact(layout)) Py_RETURN_NONE;
    Py_ssize_t n_keys = PyTuple_GET_SIZE(layout);
    if (PyDict_GET_SIZE(arrays) != n_keys) Py_RETURN_NONE;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    for (Py_ssize_t i = 0; i < n_keys; i++) {
        PyObject *entry = PyTuple_GET_ITEM(layout, i);
        if (!PyDict_Next(arrays, &pos, &key, &value) || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4)
            Py_RETURN_NONE;
        PyObject *want_key = PyTuple_GET_ITEM(entry, 0), *row_shape = PyTuple_GET_ITEM(entry, 2);
        if (key != want_key && (!PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(want_key) ||
                                PyUnicode_Compare(key, want_key) != 0))
            Py_RETURN_NONE;
        PyArray_Descr *want = (PyArray_Descr *)PyTuple_GET_ITEM(entry, 1);
        if (!PyArray_CheckExact(value) || !PyArray_DescrCheck(want) || !PyTuple_CheckExact(row_shape)) Py_RETURN_NONE;
        PyArrayObject *a = (PyArrayObject *)value;
        if ((PyArray_DESCR(a) != want && !PyArray_EquivTypes(PyArray_DESCR(a), want)) || PyArray_ISBYTESWAPPED(a) ||
            !PyArray_IS_C_CONTIGUOUS(a))
            Py_RETURN_NONE;
        Py_ssize_t row_ndim = PyTuple_GET_SIZE(row_shape);
        if (PyArray_NDIM(a) != row_ndim + 1 || PyArray_DIMS(a)[0] != n_rows) Py_RETURN_NONE;
        for (Py_ssize_t d = 0; d < row_ndim; d++) {
            Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(row_shape, d));
            if (size == -1 && PyErr_Occurred()) return NULL;
            if (PyArray_DIMS(a)[d + 1] != size) Py_RETURN_NONE;
        }
        if (values_hold(a, PyTuple_GET_ITEM(entry, 3)) != 1) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    Py_RETURN_TRUE;
}

/* The arrays of a stack (a list of C-contiguous arrays of one dtype, in native byte order, with one row shape)
 * and their total rows; -1 when they are not that. A dtype holding object references is never copied byte for
 * byte (its references would not be counted), nor are two dtypes numpy would convert between. */
static npy_intp stack_rows(PyObject *arrays) {
    if (!PyList_CheckExact(arrays) || PyList_GET_SIZE(arrays) == 0) return -1;
    PyArrayObject *first = (PyArrayObject *)PyList_GET_ITEM(arrays, 0);
    if (!PyArray_CheckExact((PyObject *)first) || PyArray_NDIM(first) < 1) return -1;
    int ndim = PyArray_NDIM(first);
    npy_intp total = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(arrays); i++) {
        PyArrayObject *a = (PyArrayObject *)PyList_GET_ITEM(arrays, i);
        if (!PyArray_CheckExact((PyObject *)a) || PyArray_NDIM(a) != ndim || !PyArray_IS_C_CONTIGUOUS(a) ||
            PyArray_ISBYTESWAPPED(a) || !PyArray_EquivTypes(PyArray_DESCR(a), PyArray_DESCR(first)) ||
            PyDataType_REFCHK(PyArray_DESCR(a)))
            return -1;
        for (int d = 1; d < ndim; d++)
            if (PyArray_DIMS(a)[d] != PyArray_DIMS(first)[d]) return -1;
        total += PyArray_DIMS(a)[0];
    }
    return total;
}

/* stack(arrays, read_only) -> ndarray, or None: the arrays one after another along their first axis, copied
 * into one new array (read-only when asked: batching._frozen says why), as numpy's concatenate gives them. None
 * for arrays stack_rows does not take (concatenate then). */
static PyObject *native_stack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 2, "stack(arrays, read_only)")) return NULL;
    PyObject *arrays = args[0];
    npy_intp total = stack_rows(arrays);
    if (total < 0) Py_RETURN_NONE;
    PyArrayObject *first = (PyArrayObject *)PyList_GET_ITEM(arrays, 0);
    npy_intp dims[NPY_MAXDIMS];
    int ndim = PyArray_NDIM(first);
    memcpy(dims, PyArray_DIMS(first), ndim * sizeof dims[0]);
    dims[0] = total;
    PyArray_Descr *descr = PyArray_DESCR(first);
    Py_INCREF(descr);
    PyArrayObject *out = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, descr, ndim, dims, NULL, NULL, 0, NULL);
    if (out == NULL) return NULL;
    char *to = PyArray_DATA(out);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(arrays); i++) {
        PyArrayObject *a = (PyArrayObject *)PyList_GET_ITEM(arrays, i);
        npy_intp nbytes = PyArray_NBYTES(a);
        if (nbytes) memcpy(to, PyArray_DATA(a), nbytes);
        to += nbytes;
    }
    if (PyObject_IsTrue(args[1])) PyArray_CLEARFLAGS(out, NPY_ARRAY_WRITEABLE);
    return (PyObject *)out;
}

/* stack_index(indexes, offsets) -> int32 ndarray, or None: each 1-d int32 array of row indexes plus its part's
 * offset (a list of ints of the same length), one after another: a batch's final_index from its parts'. None
 * for anything else (numpy's way then). */
static PyObject *native_stack_index(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!arity(nargs, 2, "stack_index(indexes, offsets)")) return NULL;
    PyObject *indexes = args[0], *offsets = args[1];
    npy_intp total = stack_rows(indexes);
    if (total < 0 || !PyList_CheckExact(offsets) || PyList_GET_SIZE(offsets) != PyList_GET_SIZE(indexes) ||
        PyArray_TYPE((PyArrayObject *)PyList_GET_ITEM(indexes, 0)) != NPY_INT32 ||
        PyArray_NDIM((PyArrayObject *)PyList_GET_ITEM(indexes, 0)) != 1)
        Py_RETURN_NONE;
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, &total, NPY_INT32);
    if (out == NULL) return NULL;
    char *to = PyArray_DATA(out);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(indexes); i++) {
        PyArrayObject *a = (PyArrayObject *)PyList_GET_ITEM(indexes, i);
        long offset = PyLong_AsLong(PyList_GET_ITEM(offsets, i));
        if ((offset == -1 && PyErr_Occurred()) || offset < 0 || offset > INT32_MAX) {
            PyErr_Clear();
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        const char *from = PyArray_DATA(a);
        for (npy_intp j = 0; j < PyArray_DIMS(a)[0]; j++) {
            int32_t row;
            memcpy(&row, from + j * sizeof row, sizeof row);
            if ((int64_t)row + offset > INT32_MAX) {
                Py_DECREF(out);
                Py_RETURN_NONE;
            }
            row = (int32_t)(row + offset);
            memcpy(to, &row, sizeof row);
            to += sizeof row;
        }
    }
    return (PyObject *)out;
}

/* --- configure ---------------------------------------------------------------------------------------- */

/* configure(step_data, game_step, batch, act, actions, dtypes, limits): the message classes, the wire dtypes
 * ({name: numpy dtype}, in arrays.DTYPES' order) and the limits (a dict), from their one place in Python. */
static PyObject *native_configure(PyObject *self, PyObject *args) {
    PyObject *step_data, *game_step, *batch, *act, *actions, *dtypes, *limits;
    if (!PyArg_ParseTuple(args, "OOOOOO!O!", &step_data, &game_step, &batch, &act, &actions, &PyDict_Type, &dtypes,
                          &PyDict_Type, &limits))
        return NULL;
    PyObject *types[] = {step_data, game_step, batch, act, actions};
    Layout *layouts[] = {&step_data_layout, &game_step_layout, &batch_layout, &act_layout, &actions_layout};
    for (int j = 0; j < 5; j++) { /* all checked before any is taken */
        if (!PyType_Check(types[j])) {
            PyErr_SetString(PyExc_TypeError, "configure: the message classes");
            return NULL;
        }
        if (!check_layout(layouts[j], types[j])) return NULL;
    }
    if (PyDict_GET_SIZE(dtypes) != N_DTYPES) {
        PyErr_SetString(PyExc_ValueError, "expected the 11 wire dtypes");
        return NULL;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    int i = 0;
    while (PyDict_Next(dtypes, &pos, &key, &value)) {
        PyArray_Descr *descr = NULL;
        if (!PyUnicode_Check(key) || !PyArray_DescrConverter(value, &descr)) {
            PyErr_SetString(PyExc_ValueError, "dtypes: name -> numpy dtype");
            return NULL;
        }
        const char *utf8 = PyUnicode_AsUTF8AndSize(key, &cfg.dtype_len[i]);
        if (utf8 == NULL) {
            Py_DECREF(descr);
            return NULL;
        }
        Py_INCREF(key);
        Py_XSETREF(cfg.dtype_names[i], key);
        Py_XSETREF(cfg.dtypes[i], descr);
        cfg.dtype_utf8[i] = utf8;
        i++;
    }
    struct {
        const char *name;
        Py_ssize_t *slot;
    } sizes[] = {{"max_array_keys", &cfg.max_array_keys}, {"max_text", &cfg.max_text},
                 {"max_groups", &cfg.max_groups}, {"max_ndim", &cfg.max_ndim}};
    for (size_t j = 0; j < sizeof sizes / sizeof sizes[0]; j++) {
        PyObject *v = PyDict_GetItemString(limits, sizes[j].name);
        if (v == NULL || (*sizes[j].slot = PyLong_AsSsize_t(v)) < 0) {
            PyErr_Format(PyExc_ValueError, "limits: %s missing or negative", sizes[j].name);
            return NULL;
        }
    }
    PyObject *int_max = PyDict_GetItemString(limits, "int_max");
    if (int_max == NULL || (cfg.int_max = PyLong_AsUnsignedLongLong(int_max)) == (uint64_t)-1) {
        PyErr_SetString(PyExc_ValueError, "limits: int_max missing");
        return NULL;
    }
    for (int j = 0; j < 5; j++) {
        Py_INCREF(types[j]);
        Py_XSETREF(*layouts[j]->type, types[j]);
    }
    cfg.ready = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", native_configure, METH_VARARGS, "Hand over the message classes, wire dtypes and limits."},
    {"decode", native_decode, METH_O, "A step, batch, act or actions message from a msgpack body, or None."},
    {"decode_godot", native_decode_godot, METH_O,
     "The same from a Godot Variant body (the addon's var_to_bytes), or None."},
    {"encode_godot", native_encode_godot, METH_O, "encode_godot(message): the frame with a Godot Variant body, or None."},
    {"encode", (PyCFunction)(void (*)(void))native_encode, METH_FASTCALL,
     "encode(message, min_bytes, writable_too): the frame as buffers, or None."},
    {"all_finite", native_all_finite, METH_O, "Whether a float array has no NaN or infinity; None: not read here."},
    {"ended_rows", (PyCFunction)(void (*)(void))native_ended_rows, METH_FASTCALL,
     "ended_rows(terminated, truncated): how many rows ended their episode; None: not read here."},
    {"add_returns", (PyCFunction)(void (*)(void))native_add_returns, METH_FASTCALL,
     "add_returns(returns, reward, terminated, truncated): the ended rows' returns; None: not read here."},
    {"step_ends", (PyCFunction)(void (*)(void))native_step_ends, METH_FASTCALL,
     "step_ends(terminated, truncated, frames): SB3's dones, per-env infos and ended count; None: not read here."},
    {"clip_unit", native_clip_unit, METH_O, "clip_unit(actions): a new (n, columns) float32 array in [-1, 1]; None."},
    {"owned_arrays", (PyCFunction)(void (*)(void))native_owned_arrays, METH_FASTCALL,
     "owned_arrays(arrays, plan): each array of the plan's dtype, writable (copied if not); None: numpy's way."},
    {"terminal_obs", (PyCFunction)(void (*)(void))native_terminal_obs, METH_FASTCALL,
     "terminal_obs(infos, dones, final_index, final_obs, obs, plan): SB3's terminal observations; None: numpy's way."},
    {"new", (PyCFunction)(void (*)(void))native_new, METH_FASTCALL,
     "new(cls, *values): cls.unchecked(*values) for a configured message class, every field given."},
    {"rows_match", (PyCFunction)(void (*)(void))native_rows_match, METH_FASTCALL,
     "rows_match(arrays, layout, n_rows): True when spaces.check_rows would accept them; None: not decided here."},
    {"stack", (PyCFunction)(void (*)(void))native_stack, METH_FASTCALL,
     "stack(arrays, read_only): the arrays concatenated along their first axis; None: not stacked here."},
    {"stack_index", (PyCFunction)(void (*)(void))native_stack_index, METH_FASTCALL,
     "stack_index(indexes, offsets): int32 row indexes plus each part's offset, concatenated; None: not here."},
    {"as_is", (PyCFunction)(void (*)(void))native_as_is, METH_FASTCALL,
     "as_is(terminated, truncated, final_index, final_obs): accumulate._as_is; None: not read here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    import_array();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {{&cfg.s_tick, "tick"},       {&cfg.s_groups, "groups"},           {&cfg.s_step, "step"},
                 {&cfg.s_data, "data"},       {&cfg.s_policy, "policy"},           {&cfg.s_actions, "actions"},
                 {&cfg.s_obs, "obs"},         {&cfg.s_reward, "reward"},           {&cfg.s_terminated, "terminated"},
                 {&cfg.s_truncated, "truncated"}, {&cfg.s_final_index, "final_index"}, {&cfg.s_final_obs, "final_obs"},
                 {&cfg.s_infos, "infos"},     {&cfg.s_frames, "frames"},           {&cfg.s_cast, "cast"},
                 {&cfg.s_B, "B"},             {&cfg.empty_str, ""},                {&cfg.s_time_limit, "TimeLimit.truncated"},
                 {&cfg.s_terminal, "terminal_observation"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
