/* A godot_rl plugin game's per-step JSON, in C: its ``step``/``reset`` replies read straight into one array per
 * observation key and group, and the ``action`` requests written from the hub's arrays.
 *
 * The same job as broker/legacy/wire.py (orjson's decode, then ``decode_rows``/``decode_numbers``/
 * ``decode_flags`` and ``encode_actions`` + ``encode_message``), without a Python object per number: a reply of
 * 400 agents x 64 numbers is 25,600 floats that orjson would build and numpy would read back.
 *
 * The reader accepts a strict subset of what the Python way accepts and gives the same arrays: JSON exactly
 * (whitespace anywhere), ASCII strings, numbers as Python reads them (an integer token as int -> float, so
 * "-0" is 0.0; others as float(), correctly rounded), observation rows holding each key of their group once as
 * a flat list of numbers (or a hex string, for an image key), rewards as numbers, ``done`` as booleans, infos
 * as objects (the non-empty ones handed back as byte ranges for the Python way to decode). The frame-wide
 * bounds of json_body.py are counted on the way: values (every ``,`` ``[`` ``{`` ``:`` byte, as
 * ``_check_json_bounds`` counts them) and nesting. Anything else (escaped keys, booleans among numbers, nested
 * observation lists, a discrete observation, NaN, long integers, non-ASCII text, a key twice) returns None and
 * the Python way decides and words any refusal. tests/test_wire_native.py checks that both ways agree.
 *
 * The writer gives byte for byte the frame ``encode_message`` writes (json.dumps' separators, floats as
 * float.__repr__, NaN and infinities as wire.encode_actions replaces them). No I/O, no state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "frame headers are written little-endian in place: build without it (GDRL_BROKER_PURE=1)"
#endif

#define KIND_FLOATS 0 /* a float32 box: a flat list of ``size`` numbers */
#define KIND_HEX 1    /* a uint8 image: a string of 2 x ``size`` hex digits */
#define DECLINE 0
#define OK 1
#define FAIL -1 /* a Python exception is set (memory) */
#define MAX_NUMBER_TEXT 64

/* --- reading ---------------------------------------------------------------------------------------- */

typedef struct {
    const unsigned char *p, *end;
    Py_ssize_t marks; /* , [ { : bytes, inside strings too: what json_body._check_json_bounds counts */
    int depth, max_depth;
} Scan;

static inline int peek(Scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\n' || *s->p == '\r' || *s->p == '\t')) s->p++;
    return s->p < s->end ? *s->p : -1;
}

/* One structural byte, counted as the bounds check counts it; opening brackets add a level. */
static inline int take(Scan *s, int c) {
    if (peek(s) != c) return 0;
    s->p++;
    if (c == ',' || c == ':') s->marks++;
    else if (c == '[' || c == '{') {
        s->marks++;
        if (++s->depth > s->max_depth) return 0;
    } else if (c == ']' || c == '}')
        s->depth--;
    return 1;
}

static int16_t HEX[256]; /* a byte's value as a hex digit, -1 if it is none: filled by the module's init */

static inline int hex_value(unsigned char c) { return HEX[c]; }

/* A string at the cursor: its raw content and whether it holds escapes. Controls, non-ASCII bytes and
 * surrogate escapes decline (the Python way refuses them or decodes them in ways not repeated here). */
static int string(Scan *s, const unsigned char **start, Py_ssize_t *length, int *escaped) {
    if (peek(s) != '"') return DECLINE;
    const unsigned char *p = ++s->p, *end = s->end;
    *escaped = 0;
    while (p < end) {
        unsigned char c = *p;
        if (c == '"') {
            *start = s->p;
            *length = p - s->p;
            s->p = p + 1;
            return OK;
        }
        if (c < 0x20 || c >= 0x80) return DECLINE;
        if (c == '\\') {
            *escaped = 1;
            if (p + 1 >= end) return DECLINE;
            switch (p[1]) {
            case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
                p += 2;
                continue;
            case 'u': {
                if (end - p < 6) return DECLINE;
                unsigned code = 0;
                for (int k = 2; k < 6; k++) {
                    int h = hex_value(p[k]);
                    if (h < 0) return DECLINE;
                    code = code * 16 + (unsigned)h;
                }
                if (code >= 0xD800 && code <= 0xDFFF) return DECLINE;
                p += 6;
                continue;
            }
            default:
                return DECLINE;
            }
        }
        if (c == ',' || c == ':' || c == '[' || c == '{') s->marks++;
        p++;
    }
    return DECLINE;
}

static const double POW10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

static inline int digit_at(const unsigned char *p, const unsigned char *end) { return p < end && *p >= '0' && *p <= '9'; }

/* A JSON number (its grammar exactly) as the Python way reads it. An integer token is a Python int, which
 * numpy makes a float (so "-0" is 0.0): up to 18 digits here, beyond is declined (json_body.py may refuse
 * it). Others are float(): exact by Clinger's fast path when the digits fit 53 bits and the power of ten
 * is at most 22, else by Python's own correctly rounded conversion. */
static int number(Scan *s, double *out) {
    peek(s);
    const unsigned char *p = s->p, *begin = p, *end = s->end;
    int negative = 0, is_int = 1, dropped = 0, int_digits = 0;
    uint64_t mantissa = 0;
    long exponent = 0;
    if (p < end && *p == '-') {
        negative = 1;
        p++;
    }
    if (!digit_at(p, end)) return DECLINE;
    if (*p == '0') {
        p++;
        int_digits = 1;
        if (digit_at(p, end)) return DECLINE; /* a leading zero: not JSON */
    } else {
        for (; digit_at(p, end); p++, int_digits++) {
            if (mantissa < 100000000000000000ULL) mantissa = mantissa * 10 + (uint64_t)(*p - '0');
            else {
                dropped = 1;
                exponent++;
            }
        }
    }
    if (p < end && *p == '.') {
        is_int = 0;
        p++;
        if (!digit_at(p, end)) return DECLINE;
        for (; digit_at(p, end); p++) {
            if (mantissa < 100000000000000000ULL) {
                mantissa = mantissa * 10 + (uint64_t)(*p - '0');
                exponent--;
            } else if (*p != '0')
                dropped = 1;
        }
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        is_int = 0;
        p++;
        int exp_negative = 0;
        if (p < end && (*p == '+' || *p == '-')) exp_negative = *p++ == '-';
        if (!digit_at(p, end)) return DECLINE;
        long e = 0;
        for (; digit_at(p, end); p++)
            if (e < 100000) e = e * 10 + (*p - '0');
        exponent += exp_negative ? -e : e;
    }
    s->p = p;
    if (is_int) {
        if (int_digits > 18) return DECLINE;
        int64_t value = (int64_t)mantissa;
        *out = (double)(negative ? -value : value);
        return OK;
    }
    if (!dropped && mantissa <= (1ULL << 53) && exponent >= -22 && exponent <= 22) {
        double value = (double)mantissa;
        value = exponent < 0 ? value / POW10[-exponent] : value * POW10[exponent];
        *out = negative ? -value : value;
        return OK;
    }
    char text[MAX_NUMBER_TEXT];
    Py_ssize_t n = p - begin;
    if (n >= MAX_NUMBER_TEXT) return DECLINE;
    memcpy(text, begin, (size_t)n);
    text[n] = '\0';
    char *stop = NULL;
    double value = PyOS_string_to_double(text, &stop, NULL);
    if (value == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return DECLINE;
    }
    if (stop != text + n) return DECLINE;
    *out = value;
    return OK;
}

/* A number the broker keeps as float32: finite and within float32's range, as wire._numbers demands. */
static inline int float32_number(Scan *s, float *out) {
    double value;
    if (!number(s, &value) || !(fabs(value) <= (double)FLT_MAX)) return DECLINE;
    *out = (float)value;
    return OK;
}

static int literal(Scan *s, const char *word, size_t n) {
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0) return DECLINE;
    s->p += n;
    return OK;
}

/* Any value, checked as JSON and counted, not kept. */
static int skip_value(Scan *s) {
    const unsigned char *start;
    Py_ssize_t length;
    int escaped;
    double ignored;
    switch (peek(s)) {
    case '{':
        take(s, '{');
        if (s->depth > s->max_depth) return DECLINE;
        if (take(s, '}')) return OK;
        do {
            if (!string(s, &start, &length, &escaped) || !take(s, ':') || !skip_value(s)) return DECLINE;
        } while (take(s, ','));
        return take(s, '}');
    case '[':
        take(s, '[');
        if (s->depth > s->max_depth) return DECLINE;
        if (take(s, ']')) return OK;
        do {
            if (!skip_value(s)) return DECLINE;
        } while (take(s, ','));
        return take(s, ']');
    case '"':
        return string(s, &start, &length, &escaped);
    case 't':
        return literal(s, "true", 4);
    case 'f':
        return literal(s, "false", 5);
    case 'n':
        return literal(s, "null", 4);
    default:
        return number(s, &ignored) && isfinite(ignored);
    }
}

/* One observation key of one group: where its rows go. */
typedef struct {
    const char *name;
    Py_ssize_t name_length, size;
    int kind;
    PyArrayObject *array;
} Key;

typedef struct {
    Py_ssize_t rows;
    Key *keys;
    int n_keys;
} Group;

typedef struct {
    Py_ssize_t n_agents;
    const int32_t *agent_group, *agent_row;
    Group *groups;
    int n_groups;
} Plan;

static int observation_value(Scan *s, Key *key, Py_ssize_t row) {
    if (key->kind == KIND_HEX) { /* a string of exactly 2 x size hex digits, read in one pass */
        if (peek(s) != '"') return DECLINE;
        const unsigned char *digits = s->p + 1;
        Py_ssize_t n = 2 * key->size;
        if (s->end - digits < n + 1 || digits[n] != '"') return DECLINE;
        uint8_t *out = (uint8_t *)PyArray_DATA(key->array) + row * key->size;
        int bad = 0;
        for (Py_ssize_t i = 0; i < key->size; i++) {
            int high = HEX[digits[2 * i]], low = HEX[digits[2 * i + 1]];
            bad |= high | low; /* negative once any is not a hex digit (a quote or backslash included) */
            out[i] = (uint8_t)(high * 16 + low);
        }
        s->p = digits + n + 1;
        return bad >= 0;
    }
    float *out = (float *)PyArray_DATA(key->array) + row * key->size;
    if (!take(s, '[')) return DECLINE;
    if (key->size == 0) return take(s, ']');
    for (Py_ssize_t i = 0; i < key->size; i++)
        if ((i && !take(s, ',')) || !float32_number(s, out + i)) return DECLINE;
    return take(s, ']');
}

/* One agent's observation map: every key of its group once, others skipped. */
static int observation_row(Scan *s, const Plan *plan, Py_ssize_t agent) {
    Group *group = &plan->groups[plan->agent_group[agent]];
    Py_ssize_t row = plan->agent_row[agent];
    uint64_t seen = 0;
    int found = 0;
    if (!take(s, '{')) return DECLINE;
    if (take(s, '}')) return group->n_keys == 0;
    do {
        const unsigned char *name;
        Py_ssize_t length;
        int escaped;
        if (!string(s, &name, &length, &escaped) || escaped || !take(s, ':')) return DECLINE;
        int k = 0;
        while (k < group->n_keys &&
               (group->keys[k].name_length != length || memcmp(group->keys[k].name, name, (size_t)length) != 0))
            k++;
        if (k == group->n_keys) {
            if (!skip_value(s)) return DECLINE;
            continue;
        }
        if (seen & (1ULL << k)) return DECLINE;
        seen |= 1ULL << k;
        found++;
        if (!observation_value(s, &group->keys[k], row)) return DECLINE;
    } while (take(s, ','));
    return take(s, '}') && found == group->n_keys;
}

static int observations(Scan *s, const Plan *plan) {
    if (!take(s, '[')) return DECLINE;
    for (Py_ssize_t i = 0; i < plan->n_agents; i++)
        if ((i && !take(s, ',')) || !observation_row(s, plan, i)) return DECLINE;
    return take(s, ']');
}

static int rewards(Scan *s, Py_ssize_t n, float *out) {
    if (!take(s, '[')) return DECLINE;
    for (Py_ssize_t i = 0; i < n; i++)
        if ((i && !take(s, ',')) || !float32_number(s, out + i)) return DECLINE;
    return take(s, ']');
}

static int flags(Scan *s, Py_ssize_t n, npy_bool *out) {
    if (!take(s, '[')) return DECLINE;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i && !take(s, ',')) return DECLINE;
        int c = peek(s);
        if (c == 't' && literal(s, "true", 4)) out[i] = 1;
        else if (c == 'f' && literal(s, "false", 5)) out[i] = 0;
        else return DECLINE;
    }
    return take(s, ']');
}

/* Infos: every one a map; the non-empty ones as (agent, start, end) in ``spans``. */
static int infos(Scan *s, Py_ssize_t n, const unsigned char *body, PyObject *spans) {
    if (!take(s, '[')) return DECLINE;
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((i && !take(s, ',')) || peek(s) != '{') return DECLINE;
        const unsigned char *start = s->p;
        take(s, '{');
        if (s->depth > s->max_depth) return DECLINE;
        if (take(s, '}')) continue;
        s->p = start;
        s->depth--;
        s->marks--;
        if (!skip_value(s)) return DECLINE;
        PyObject *span = Py_BuildValue("(nnn)", i, (Py_ssize_t)(start - body), (Py_ssize_t)(s->p - body));
        if (span == NULL || PyList_Append(spans, span) < 0) {
            Py_XDECREF(span);
            return FAIL;
        }
        Py_DECREF(span);
    }
    return take(s, ']');
}

enum { SEEN_TYPE = 1, SEEN_OBS = 2, SEEN_REWARD = 4, SEEN_DONE = 8, SEEN_INFO = 16 };

static int key_is(const unsigned char *name, Py_ssize_t length, const char *word) {
    return (size_t)length == strlen(word) && memcmp(name, word, (size_t)length) == 0;
}

/* The whole reply. Returns OK, DECLINE or FAIL. */
static int reply(Scan *s, const Plan *plan, int first, float *reward, npy_bool *done, const unsigned char *body,
                 PyObject *spans) {
    const char *expected = first ? "reset" : "step";
    int seen = 0;
    if (!take(s, '{')) return DECLINE;
    if (take(s, '}')) return DECLINE;
    do {
        const unsigned char *name;
        Py_ssize_t length;
        int escaped, field = 0, result;
        if (!string(s, &name, &length, &escaped) || escaped || !take(s, ':')) return DECLINE;
        if (key_is(name, length, "type")) field = SEEN_TYPE;
        else if (key_is(name, length, "obs")) field = SEEN_OBS;
        else if (key_is(name, length, "reward")) field = SEEN_REWARD;
        else if (key_is(name, length, "done")) field = SEEN_DONE;
        else if (key_is(name, length, "info")) field = SEEN_INFO;
        if (field & seen) return DECLINE; /* a key twice: the Python way keeps the last one */
        seen |= field;
        if (field == SEEN_TYPE) {
            const unsigned char *text;
            Py_ssize_t text_length;
            result = string(s, &text, &text_length, &escaped) && !escaped && key_is(text, text_length, expected);
        } else if (field == SEEN_OBS)
            result = observations(s, plan);
        else if (field == SEEN_REWARD && !first)
            result = rewards(s, plan->n_agents, reward);
        else if (field == SEEN_DONE && !first)
            result = flags(s, plan->n_agents, done);
        else if (field == SEEN_INFO && !first)
            result = infos(s, plan->n_agents, body, spans);
        else
            result = skip_value(s);
        if (result != OK) return result;
    } while (take(s, ','));
    if (!take(s, '}') || peek(s) != -1) return DECLINE;
    int needed = first ? SEEN_TYPE | SEEN_OBS : SEEN_TYPE | SEEN_OBS | SEEN_REWARD | SEEN_DONE;
    return (seen & needed) == needed;
}

static void plan_free(Plan *plan) {
    for (int g = 0; g < plan->n_groups; g++)
        for (int k = 0; k < plan->groups[g].n_keys; k++) Py_XDECREF(plan->groups[g].keys[k].array);
    if (plan->groups) PyMem_Free(plan->groups[0].keys);
    PyMem_Free(plan->groups);
}

/* The plan from its Python form, with a fresh array per key: (agent_group: bytes of int32, agent_row: bytes
 * of int32, groups: tuple of (rows, keys: tuple of (name: bytes, kind, size))). */
static int plan_read(PyObject *spec, Plan *plan) {
    PyObject *groups;
    Py_buffer group_of, row_of;
    memset(plan, 0, sizeof *plan);
    if (!PyArg_ParseTuple(spec, "y*y*O!", &group_of, &row_of, &PyTuple_Type, &groups)) return FAIL;
    plan->agent_group = group_of.buf;
    plan->agent_row = row_of.buf;
    plan->n_agents = group_of.len / (Py_ssize_t)sizeof(int32_t);
    PyBuffer_Release(&group_of); /* the plan's bytes objects outlive the call: the caller holds them */
    PyBuffer_Release(&row_of);
    Py_ssize_t n_groups = PyTuple_GET_SIZE(groups), total = 0;
    if (row_of.len != group_of.len || n_groups == 0 || n_groups > 1024) goto bad;
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        PyObject *group = PyTuple_GET_ITEM(groups, g);
        if (!PyTuple_Check(group) || PyTuple_GET_SIZE(group) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(group, 1))) goto bad;
        total += PyTuple_GET_SIZE(PyTuple_GET_ITEM(group, 1));
    }
    plan->groups = PyMem_Calloc((size_t)n_groups, sizeof(Group));
    Key *keys = PyMem_Calloc((size_t)(total ? total : 1), sizeof(Key));
    if (plan->groups == NULL || keys == NULL) {
        PyMem_Free(plan->groups);
        PyMem_Free(keys);
        plan->groups = NULL;
        PyErr_NoMemory();
        return FAIL;
    }
    plan->groups[0].keys = keys;
    plan->n_groups = (int)n_groups;
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        PyObject *group = PyTuple_GET_ITEM(groups, g), *group_keys = PyTuple_GET_ITEM(group, 1);
        Group *out = &plan->groups[g];
        out->rows = PyLong_AsSsize_t(PyTuple_GET_ITEM(group, 0));
        out->keys = keys;
        out->n_keys = (int)PyTuple_GET_SIZE(group_keys);
        keys += out->n_keys;
        if (out->rows < 0 || out->n_keys > 64) goto bad;
        for (int k = 0; k < out->n_keys; k++) {
            Key *key = &out->keys[k];
            PyObject *name;
            int kind;
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(group_keys, k), "O!in", &PyBytes_Type, &name, &kind, &key->size)) {
                plan_free(plan);
                return FAIL;
            }
            key->name = PyBytes_AS_STRING(name);
            key->name_length = PyBytes_GET_SIZE(name);
            key->kind = kind;
            if ((kind != KIND_FLOATS && kind != KIND_HEX) || key->size < 0) goto bad;
            npy_intp dims[2] = {out->rows, key->size};
            key->array = (PyArrayObject *)PyArray_SimpleNew(2, dims, kind == KIND_HEX ? NPY_UINT8 : NPY_FLOAT32);
            if (key->array == NULL) {
                plan_free(plan);
                return FAIL;
            }
        }
    }
    for (Py_ssize_t i = 0; i < plan->n_agents; i++) {
        int32_t g = plan->agent_group[i], row = plan->agent_row[i];
        if (g < 0 || g >= plan->n_groups || row < 0 || row >= plan->groups[g].rows) goto bad;
    }
    return OK;
bad:
    plan_free(plan);
    PyErr_SetString(PyExc_ValueError, "read_step: malformed plan");
    return FAIL;
}

/* read_step(body, first, plan, max_values, max_nesting) -> None or (observations: one list of arrays per
 * group in key order, reward: float32 (n,) or None, done: bool (n,) or None, info spans). */
static PyObject *wire_read_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "read_step(body, first, plan, max_values, max_nesting)");
        return NULL;
    }
    Py_buffer body;
    if (PyObject_GetBuffer(args[0], &body, PyBUF_SIMPLE) < 0) return NULL;
    int first = PyObject_IsTrue(args[1]);
    Py_ssize_t max_values = PyLong_AsSsize_t(args[3]), max_nesting = PyLong_AsSsize_t(args[4]);
    Plan plan;
    PyObject *result = NULL, *reward = NULL, *done = NULL, *spans = NULL, *observed = NULL;
    if (first < 0 || PyErr_Occurred() || plan_read(args[2], &plan) != OK) {
        PyBuffer_Release(&body);
        return NULL;
    }
    npy_intp n = plan.n_agents;
    spans = PyList_New(0);
    if (!first) {
        reward = PyArray_SimpleNew(1, &n, NPY_FLOAT32);
        done = PyArray_ZEROS(1, &n, NPY_BOOL, 0);
    }
    if (spans == NULL || (!first && (reward == NULL || done == NULL))) goto end;
    Scan scan = {(const unsigned char *)body.buf, (const unsigned char *)body.buf + body.len, 0, 0, (int)max_nesting};
    int outcome = reply(&scan, &plan, first, reward ? PyArray_DATA((PyArrayObject *)reward) : NULL,
                        done ? PyArray_DATA((PyArrayObject *)done) : NULL, (const unsigned char *)body.buf, spans);
    if (outcome == FAIL) goto end;
    if (outcome == DECLINE || (body.len > max_values && scan.marks > max_values)) {
        result = Py_NewRef(Py_None);
        goto end;
    }
    observed = PyList_New(plan.n_groups);
    for (int g = 0; observed && g < plan.n_groups; g++) {
        PyObject *arrays = PyList_New(plan.groups[g].n_keys);
        if (arrays == NULL) {
            Py_CLEAR(observed);
            break;
        }
        for (int k = 0; k < plan.groups[g].n_keys; k++)
            PyList_SET_ITEM(arrays, k, Py_NewRef((PyObject *)plan.groups[g].keys[k].array));
        PyList_SET_ITEM(observed, g, arrays);
    }
    if (observed)
        result = PyTuple_Pack(4, observed, reward ? reward : Py_None, done ? done : Py_None, spans);
end:
    Py_XDECREF(observed);
    Py_XDECREF(reward);
    Py_XDECREF(done);
    Py_XDECREF(spans);
    plan_free(&plan);
    PyBuffer_Release(&body);
    return result;
}

/* --- writing ---------------------------------------------------------------------------------------- */

typedef struct {
    char *data;
    Py_ssize_t length, capacity;
    int overflow; /* set instead of writing past capacity: the bound computed before writing was wrong */
} Out;

static inline void put(Out *out, const char *text, Py_ssize_t n) {
    if (out->length + n > out->capacity) {
        out->overflow = 1;
        return;
    }
    memcpy(out->data + out->length, text, (size_t)n);
    out->length += n;
}

/* The frame's header once its body is written; NULL with SystemError if the bound was wrong. */
static PyObject *finish_frame(PyObject **frame, Out *out) {
    if (out->overflow) {
        PyErr_SetString(PyExc_SystemError, "_wire.c: a frame outgrew its computed bound");
        return NULL;
    }
    uint32_t body_length = (uint32_t)(out->length - 4);
    memcpy(out->data, &body_length, 4);
    if (_PyBytes_Resize(frame, out->length) < 0) return NULL;
    PyObject *done = *frame;
    *frame = NULL;
    return done;
}

#define PUT_TEXT(out, literal) put((out), (literal), (Py_ssize_t)sizeof(literal) - 1)
#define MAX_FLOAT_TEXT 32 /* float.__repr__ is at most 24 characters: -2.2250738585072014e-308 */
#define MAX_INT_TEXT 21

typedef unsigned __int128 u128;
static u128 POW10_WIDE[24];    /* 10^i, filled by the module's init */
static uint64_t POW10_U64[18]; /* the same, up to 10^17 */

/* Whether D (the value in units of 2^-(s+31) of its 17-digit scale, as q and the remainder r below 2^s)
 * rounds from the candidate c (within 12 units of q): |c - D| within the half-gap on that side. */
static inline int rounds_to(uint64_t c, uint64_t q, uint64_t r, int s, u128 above, u128 below, u128 *distance) {
    u128 unit = (u128)1 << (s + 31), rest = (u128)r << 31;
    if (c > q) {
        if (c - q > 12) return 0;
        *distance = (u128)(c - q) * unit - rest;
        return *distance <= above;
    }
    if (q - c > 12) return 0;
    *distance = (u128)(q - c) * unit + rest;
    return *distance <= below;
}

/* q mod 10^e, each divisor a constant the compiler turns into a multiplication */
static inline uint64_t remainder_pow10(uint64_t q, int e) {
    switch (e) {
    case 1: return q % 10ULL;
    case 2: return q % 100ULL;
    case 3: return q % 1000ULL;
    case 4: return q % 10000ULL;
    case 5: return q % 100000ULL;
    case 6: return q % 1000000ULL;
    case 7: return q % 10000000ULL;
    case 8: return q % 100000000ULL;
    case 9: return q % 1000000000ULL;
    case 10: return q % 10000000000ULL;
    case 11: return q % 100000000000ULL;
    case 12: return q % 1000000000000ULL;
    case 13: return q % 10000000000000ULL;
    case 14: return q % 100000000000000ULL;
    case 15: return q % 1000000000000000ULL;
    default: return q % 10000000000000000ULL;
    }
}

/* float.__repr__ of a float32 value widened to double (what the hub's actions are) with 1e-4 <= |value| < 1e7:
 * the shortest decimal that reads back as the value, the closest one if several, written as repr writes it
 * (no exponent in this range). 0 for any other value, or a tie, which PyOS_double_to_string then writes.
 *
 * value = m / 2^s exactly (m of 24 bits); scaled to 17 significant digits it is D = q + r / 2^s, and a double
 * with m's 53-bit mantissa m * 2^29 (even: both ends round to it) reads back from anything within half its
 * gap, h = 10^(16-k) / 2^(s+30) of these units (0.55 to 11.1; half that below a power of two). A j-digit
 * decimal is a multiple of 10^(17-j) there; if one of j digits is within reach, so is one of j + 1. */
static int repr_float32(double value, char *text) {
    double magnitude = fabs(value);
    if (!(magnitude >= 1e-4 && magnitude < 1e7) || (double)(float)magnitude != magnitude) return 0;
    int binary_exponent;
    double fraction = frexp(magnitude, &binary_exponent);
    uint64_t m = (uint64_t)ldexp(fraction, 24);
    int s = 24 - binary_exponent;
    int k = (int)floor((binary_exponent - 1) * 0.30102999566398120); /* log10 of 2^(e-1): k or one below */
    u128 x;
    for (int tries = 0;; tries++) { /* the guess of k may be one off */
        if (tries > 2 || k < -5 || k > 7 || s < 0 || s > 40) return 0;
        x = (u128)m * POW10_WIDE[16 - k];
        if (x < ((u128)POW10_U64[16] << s)) k--;
        else if (x >= ((u128)POW10_U64[17] << s)) k++;
        else break;
    }
    if (k < -4) return 0; /* below 1e-4: repr writes an exponent */
    uint64_t q = (uint64_t)(x >> s), r = (uint64_t)(x & (((u128)1 << s) - 1));
    u128 above = 2 * POW10_WIDE[16 - k], below = m == (1ULL << 23) ? above / 2 : above, d_low = 0, d_high = 0;
    /* 17 digits: the nearest integer, always within reach (h > 1/2) */
    u128 half = (u128)1 << (s + 30), rest = (u128)r << 31;
    if (s > 0 && rest == half) return 0;
    uint64_t best = rest > half ? q + 1 : q;
    int digits = 17;
    for (int j = 16; j >= 1; j--) {
        uint64_t step = POW10_U64[17 - j], low = q - remainder_pow10(q, 17 - j), high = low + step;
        int fits_low = rounds_to(low, q, r, s, above, below, &d_low);
        int fits_high = rounds_to(high, q, r, s, above, below, &d_high);
        if (!fits_low && !fits_high) break;
        if (fits_low && fits_high && d_low == d_high) return 0;
        best = fits_low && (!fits_high || d_low < d_high) ? low : high;
        digits = j;
    }
    uint64_t lead = best / POW10_U64[17 - digits];
    int point = k + 1; /* digits before the decimal point */
    if (lead == POW10_U64[digits]) { /* rounded up to the next power of ten */
        lead = 1;
        digits = 1;
        point++;
    }
    char figures[20];
    for (int i = digits - 1; i >= 0; i--, lead /= 10) figures[i] = (char)('0' + lead % 10);
    int n = 0;
    if (value < 0) text[n++] = '-';
    if (point <= 0) {
        text[n++] = '0';
        text[n++] = '.';
        for (int i = 0; i < -point; i++) text[n++] = '0';
        for (int i = 0; i < digits; i++) text[n++] = figures[i];
    } else if (point >= digits) {
        for (int i = 0; i < digits; i++) text[n++] = figures[i];
        for (int i = digits; i < point; i++) text[n++] = '0';
        text[n++] = '.';
        text[n++] = '0';
    } else {
        for (int i = 0; i < point; i++) text[n++] = figures[i];
        text[n++] = '.';
        for (int i = point; i < digits; i++) text[n++] = figures[i];
    }
    return n;
}

/* float.__repr__ of a finite value (json.dumps' text for it); FAIL on memory, DECLINE for NaN or infinities
 * (which json.dumps would write as NaN/Infinity: the Python way). */
static int put_repr(Out *out, double value) {
    if (!isfinite(value)) return DECLINE;
    if (value == 0.0) {
        if (signbit(value)) PUT_TEXT(out, "-0.0");
        else PUT_TEXT(out, "0.0");
        return OK;
    }
    char quick[MAX_FLOAT_TEXT];
    int length = repr_float32(value, quick);
    if (length) {
        put(out, quick, length);
        return OK;
    }
    char *text = PyOS_double_to_string(value, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (text == NULL) return FAIL;
    put(out, text, (Py_ssize_t)strlen(text));
    PyMem_Free(text);
    return OK;
}

/* As wire.encode_actions writes a continuous action: NaN as 0, infinities as +-1, then float.__repr__. */
static int put_float(Out *out, double value) {
    if (isnan(value)) value = 0.0;
    else if (isinf(value)) value = value > 0 ? 1.0 : -1.0;
    return put_repr(out, value);
}

static const char ACTION_HEAD[] = "{\"type\": \"action\", \"action\": [";

/* One group's action arrays, checked for what the writer reads: C-contiguous, float32/float64 (continuous,
 * rows x width) or int32/int64 (discrete, rows). */
typedef struct {
    PyObject *prefixes; /* tuple of bytes: '"key": ' */
    const char *kinds;  /* b"c" or b"d" per key */
    PyArrayObject **arrays;
    Py_ssize_t *widths, rows, n_keys;
} Columns;

/* write_actions(agent_group, agent_row, groups) -> frame bytes, or None: groups is a tuple of (rows, prefixes,
 * kinds, widths, arrays), the arrays in key order. */
static PyObject *wire_write_actions(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "write_actions(agent_group, agent_row, groups)");
        return NULL;
    }
    Py_buffer group_of, row_of;
    if (PyObject_GetBuffer(args[0], &group_of, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &row_of, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&group_of);
        return NULL;
    }
    PyObject *result = NULL, *frame = NULL, *groups = args[2];
    Py_ssize_t n_groups = PyTuple_GET_SIZE(groups), n_agents = group_of.len / (Py_ssize_t)sizeof(int32_t);
    const int32_t *agent_group = group_of.buf, *agent_row = row_of.buf;
    Columns *columns = PyMem_Calloc((size_t)(n_groups ? n_groups : 1), sizeof(Columns));
    Py_ssize_t bound = 4 + (Py_ssize_t)sizeof ACTION_HEAD + 2;
    int declined = 0;
    if (columns == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    for (Py_ssize_t g = 0; g < n_groups && !declined; g++) {
        Columns *c = &columns[g];
        PyObject *kinds, *widths, *arrays;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(groups, g), "nO!O!O!O!", &c->rows, &PyTuple_Type, &c->prefixes,
                              &PyBytes_Type, &kinds, &PyTuple_Type, &widths, &PyTuple_Type, &arrays))
            goto end;
        c->n_keys = PyTuple_GET_SIZE(c->prefixes);
        c->kinds = PyBytes_AS_STRING(kinds);
        if (PyBytes_GET_SIZE(kinds) != c->n_keys || PyTuple_GET_SIZE(widths) != c->n_keys ||
            PyTuple_GET_SIZE(arrays) != c->n_keys) {
            PyErr_SetString(PyExc_ValueError, "write_actions: malformed group");
            goto end;
        }
        c->arrays = (PyArrayObject **)&PyTuple_GET_ITEM(arrays, 0);
        c->widths = PyMem_Calloc((size_t)(c->n_keys ? c->n_keys : 1), sizeof(Py_ssize_t));
        if (c->widths == NULL) {
            PyErr_NoMemory();
            goto end;
        }
        Py_ssize_t row_bound = 4;
        for (Py_ssize_t k = 0; k < c->n_keys; k++) {
            PyObject *prefix = PyTuple_GET_ITEM(c->prefixes, k), *item = PyTuple_GET_ITEM(arrays, k);
            c->widths[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(widths, k));
            if (!PyBytes_Check(prefix) || c->widths[k] < 0) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "write_actions: malformed key");
                goto end;
            }
            int continuous = c->kinds[k] == 'c', type = PyArray_Check(item) ? PyArray_TYPE((PyArrayObject *)item) : -1;
            PyArrayObject *array = (PyArrayObject *)item;
            if (type < 0 || !PyArray_IS_C_CONTIGUOUS(array) || PyArray_SIZE(array) != c->rows * (continuous ? c->widths[k] : 1) ||
                (continuous ? (type != NPY_FLOAT32 && type != NPY_FLOAT64) : (type != NPY_INT32 && type != NPY_INT64))) {
                declined = 1; /* not what this writer reads: the Python way */
                break;
            }
            row_bound += PyBytes_GET_SIZE(prefix) + 2 + (continuous ? 2 + c->widths[k] * (MAX_FLOAT_TEXT + 2) : MAX_INT_TEXT);
        }
        bound += c->rows * (row_bound + 2);
    }
    if (declined) {
        result = Py_NewRef(Py_None);
        goto end;
    }
    for (Py_ssize_t i = 0; i < n_agents; i++)
        if (agent_group[i] < 0 || agent_group[i] >= n_groups || agent_row[i] < 0 ||
            agent_row[i] >= columns[agent_group[i]].rows) {
            PyErr_SetString(PyExc_ValueError, "write_actions: agent outside its group");
            goto end;
        }
    frame = PyBytes_FromStringAndSize(NULL, bound);
    if (frame == NULL) goto end;
    Out out = {PyBytes_AS_STRING(frame), 4, bound, 0};
    PUT_TEXT(&out, ACTION_HEAD);
    for (Py_ssize_t i = 0; i < n_agents; i++) {
        const Columns *c = &columns[agent_group[i]];
        Py_ssize_t row = agent_row[i];
        if (i) PUT_TEXT(&out, ", ");
        PUT_TEXT(&out, "{");
        for (Py_ssize_t k = 0; k < c->n_keys; k++) {
            PyObject *prefix = PyTuple_GET_ITEM(c->prefixes, k);
            const PyArrayObject *array = c->arrays[k];
            int type = PyArray_TYPE(array);
            if (k) PUT_TEXT(&out, ", ");
            put(&out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix));
            if (c->kinds[k] != 'c') {
                long long value = type == NPY_INT32 ? ((const int32_t *)PyArray_DATA((PyArrayObject *)array))[row]
                                                    : ((const int64_t *)PyArray_DATA((PyArrayObject *)array))[row];
                char text[MAX_INT_TEXT + 4];
                int n = PyOS_snprintf(text, sizeof text, "%lld", value);
                put(&out, text, n);
                continue;
            }
            Py_ssize_t width = c->widths[k];
            PUT_TEXT(&out, "[");
            for (Py_ssize_t j = 0; j < width; j++) {
                if (j) PUT_TEXT(&out, ", ");
                double value = type == NPY_FLOAT32
                                   ? (double)((const float *)PyArray_DATA((PyArrayObject *)array))[row * width + j]
                                   : ((const double *)PyArray_DATA((PyArrayObject *)array))[row * width + j];
                if (put_float(&out, value) != OK) goto end;
            }
            PUT_TEXT(&out, "]");
        }
        PUT_TEXT(&out, "}");
    }
    PUT_TEXT(&out, "]}");
    result = finish_frame(&frame, &out);
end:
    Py_XDECREF(frame);
    for (Py_ssize_t g = 0; columns && g < n_groups; g++) PyMem_Free(columns[g].widths);
    PyMem_Free(columns);
    PyBuffer_Release(&group_of);
    PyBuffer_Release(&row_of);
    return result;
}

static inline double float_at(PyArrayObject *array, Py_ssize_t i) {
    return PyArray_TYPE(array) == NPY_FLOAT32 ? (double)((const float *)PyArray_DATA(array))[i]
                                              : ((const double *)PyArray_DATA(array))[i];
}

static const char HEX_DIGITS[] = "0123456789abcdef";

/* One observation column of a batch for a godot_rl script: '"key": ', and how its rows are written. */
typedef struct {
    PyObject *prefix;
    char kind; /* 'f': a flat list of floats; 'x': an image's bytes as lowercase hex; 'i': one integer */
    Py_ssize_t width;
    PyArrayObject *array;
} Column;

/* write_reply(first, n, columns, reward, done, infos) -> the frame of a ``reset`` (first) or ``step`` reply to a
 * godot_rl script, byte for byte json.dumps' text of the dict wire.encode_rows and batch_reply build; or None
 * when a value is not one this writer writes. columns: tuple of (prefix, kind, width, array) in key order;
 * reward: float array (n); done: bool array (n); infos: dict row -> that row's info as json.dumps' bytes (rows
 * left out are {}). */
static PyObject *wire_write_reply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyTuple_Check(args[2]) || !PyDict_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "write_reply(first, n, columns, reward, done, infos)");
        return NULL;
    }
    int first = PyObject_IsTrue(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]), n_columns = PyTuple_GET_SIZE(args[2]);
    if (first < 0 || (n == -1 && PyErr_Occurred())) return NULL;
    PyObject *infos = args[5];
    PyArrayObject *reward = NULL, *done = NULL;
    if (!first) {
        if (!PyArray_Check(args[3]) || !PyArray_Check(args[4])) Py_RETURN_NONE;
        reward = (PyArrayObject *)args[3];
        done = (PyArrayObject *)args[4];
        int reward_type = PyArray_TYPE(reward);
        if (PyArray_SIZE(reward) != n || !PyArray_IS_C_CONTIGUOUS(reward) ||
            (reward_type != NPY_FLOAT32 && reward_type != NPY_FLOAT64) || PyArray_SIZE(done) != n ||
            !PyArray_IS_C_CONTIGUOUS(done) || PyArray_TYPE(done) != NPY_BOOL)
            Py_RETURN_NONE;
    }
    Column *columns = PyMem_Calloc((size_t)(n_columns ? n_columns : 1), sizeof(Column));
    if (columns == NULL) return PyErr_NoMemory();
    PyObject *result = NULL, *frame = NULL, **texts = NULL;
    Py_ssize_t row_bound = 4;
    for (Py_ssize_t k = 0; k < n_columns; k++) {
        Column *c = &columns[k];
        const char *kind;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(args[2], k), "O!snO", &PyBytes_Type, &c->prefix, &kind, &c->width,
                              &c->array))
            goto end;
        c->kind = kind[0];
        PyArrayObject *array = c->array;
        int type = PyArray_Check(array) ? PyArray_TYPE(array) : -1;
        int fits = type >= 0 && PyArray_IS_C_CONTIGUOUS(array) && c->width >= 0 &&
                   PyArray_SIZE(array) == n * (c->kind == 'i' ? 1 : c->width);
        if (c->kind == 'f') fits = fits && (type == NPY_FLOAT32 || type == NPY_FLOAT64);
        else if (c->kind == 'x') fits = fits && type == NPY_UINT8;
        else if (c->kind == 'i') fits = fits && (type == NPY_INT32 || type == NPY_INT64);
        else fits = 0;
        if (!fits) {
            result = Py_NewRef(Py_None);
            goto end;
        }
        row_bound += PyBytes_GET_SIZE(c->prefix) + 2 +
                     (c->kind == 'f' ? 2 + c->width * (MAX_FLOAT_TEXT + 2) : c->kind == 'x' ? 2 + 2 * c->width : MAX_INT_TEXT);
    }
    Py_ssize_t bound = 64 + n * (row_bound + 2 + 2 + MAX_FLOAT_TEXT + 2 + 7 + 4);
    texts = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(PyObject *)); /* per row its info's text, or NULL: {} */
    if (texts == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    PyObject *key, *value;
    Py_ssize_t position = 0;
    while (PyDict_Next(infos, &position, &key, &value)) {
        Py_ssize_t row = PyLong_AsSsize_t(key);
        if ((row == -1 && PyErr_Occurred()) || row < 0 || row >= n || !PyBytes_Check(value)) {
            PyErr_Clear();
            result = Py_NewRef(Py_None);
            goto end;
        }
        texts[row] = value; /* borrowed: the dict holds it for the call */
        bound += PyBytes_GET_SIZE(value);
    }
    frame = PyBytes_FromStringAndSize(NULL, bound);
    if (frame == NULL) goto end;
    Out out = {PyBytes_AS_STRING(frame), 4, bound, 0};
    if (first) PUT_TEXT(&out, "{\"type\": \"reset\", \"obs\": [");
    else PUT_TEXT(&out, "{\"type\": \"step\", \"obs\": [");
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i) PUT_TEXT(&out, ", ");
        PUT_TEXT(&out, "{");
        for (Py_ssize_t k = 0; k < n_columns; k++) {
            Column *c = &columns[k];
            if (k) PUT_TEXT(&out, ", ");
            put(&out, PyBytes_AS_STRING(c->prefix), PyBytes_GET_SIZE(c->prefix));
            if (c->kind == 'i') {
                long long v = PyArray_TYPE(c->array) == NPY_INT32 ? ((const int32_t *)PyArray_DATA(c->array))[i]
                                                                  : ((const int64_t *)PyArray_DATA(c->array))[i];
                char text[MAX_INT_TEXT + 4];
                put(&out, text, PyOS_snprintf(text, sizeof text, "%lld", v));
            } else if (c->kind == 'x') {
                const uint8_t *bytes = (const uint8_t *)PyArray_DATA(c->array) + i * c->width;
                if (out.length + 2 + 2 * c->width > out.capacity) {
                    out.overflow = 1;
                    continue;
                }
                char *to = out.data + out.length;
                *to++ = '"';
                for (Py_ssize_t j = 0; j < c->width; j++) {
                    *to++ = HEX_DIGITS[bytes[j] >> 4];
                    *to++ = HEX_DIGITS[bytes[j] & 15];
                }
                *to++ = '"';
                out.length = to - out.data;
            } else {
                PUT_TEXT(&out, "[");
                for (Py_ssize_t j = 0; j < c->width; j++) {
                    if (j) PUT_TEXT(&out, ", ");
                    int written = put_repr(&out, float_at(c->array, i * c->width + j));
                    if (written != OK) {
                        if (written == DECLINE) result = Py_NewRef(Py_None);
                        goto end;
                    }
                }
                PUT_TEXT(&out, "]");
            }
        }
        PUT_TEXT(&out, "}");
    }
    PUT_TEXT(&out, "]");
    if (!first) {
        PUT_TEXT(&out, ", \"reward\": [");
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i) PUT_TEXT(&out, ", ");
            int written = put_repr(&out, float_at(reward, i));
            if (written != OK) {
                if (written == DECLINE) result = Py_NewRef(Py_None);
                goto end;
            }
        }
        PUT_TEXT(&out, "], \"done\": [");
        const npy_bool *flags = (const npy_bool *)PyArray_DATA(done);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i) PUT_TEXT(&out, ", ");
            if (flags[i]) PUT_TEXT(&out, "true");
            else PUT_TEXT(&out, "false");
        }
        PUT_TEXT(&out, "]");
    }
    PUT_TEXT(&out, ", \"info\": [");
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i) PUT_TEXT(&out, ", ");
        if (texts[i] != NULL) put(&out, PyBytes_AS_STRING(texts[i]), PyBytes_GET_SIZE(texts[i]));
        else PUT_TEXT(&out, "{}");
    }
    PUT_TEXT(&out, "]}");
    result = finish_frame(&frame, &out);
end:
    Py_XDECREF(frame);
    PyMem_Free(texts);
    PyMem_Free(columns);
    return result;
}

/* float_text(value): the text put_float writes for one value (for the tests). */
static PyObject *wire_float_text(PyObject *self, PyObject *arg) {
    double value = PyFloat_AsDouble(arg);
    if (value == -1.0 && PyErr_Occurred()) return NULL;
    char buffer[MAX_FLOAT_TEXT + 8];
    Out out = {buffer, 0, sizeof buffer, 0};
    if (put_float(&out, value) != OK) return NULL;
    return PyBytes_FromStringAndSize(buffer, out.length);
}

static PyMethodDef methods[] = {
    {"float_text", wire_float_text, METH_O, "float_text(value): a continuous action's text as the writer writes it."},
    {"write_reply", (PyCFunction)(void (*)(void))wire_write_reply, METH_FASTCALL,
     "write_reply(first, n, columns, reward, done, infos): a reset/step reply to a godot_rl script, or None."},
    {"read_step", (PyCFunction)(void (*)(void))wire_read_step, METH_FASTCALL,
     "read_step(body, first, plan, max_values, max_nesting): a plugin game's reply as arrays, or None."},
    {"write_actions", (PyCFunction)(void (*)(void))wire_write_actions, METH_FASTCALL,
     "write_actions(agent_group, agent_row, groups): the action request frame, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire(void) {
    import_array();
    POW10_WIDE[0] = 1;
    for (int i = 1; i < 24; i++) POW10_WIDE[i] = POW10_WIDE[i - 1] * 10;
    for (int i = 0; i < 18; i++) POW10_U64[i] = (uint64_t)POW10_WIDE[i];
    for (int c = 0; c < 256; c++)
        HEX[c] = (int16_t)(c >= '0' && c <= '9' ? c - '0'
                           : c >= 'a' && c <= 'f' ? c - 'a' + 10
                           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                  : -1);
    return PyModule_Create(&module);
}
