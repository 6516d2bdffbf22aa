/* The repeat of a blocking call, compiled: engine.cache's check and run in C.
 *
 * engine.cache remembers a plain blocking call as an Entry: its schedule bound to
 * persistent requests, and the signature of its arguments.  A repeat that matches the
 * signature runs the entry's steps: start requests, wait for them, call the reductions
 * and copies.  In Python that check and the mpi4py calls cost about a microsecond above
 * MPI's own time; here they cost tens of nanoseconds (docs/performance.md).
 *
 * This file adds no behaviour.  repeat() takes a hit only where engine.cache's Python
 * repeat would take the same one, and runs the same steps (MPI_Start and MPI_Wait on
 * the same requests, in the same order, and the same Python callables, with the same
 * floating-point state); anything else -- no entry, a field that differs or is only
 * equal (not the same object), an epoch that moved, an operation in flight -- is handed
 * to the Python repeat unchanged.  So every rule of a hit lives in engine/cache.py
 * (Entry.matches); this is a stricter copy of it that answers "certainly the same call"
 * or "ask Python".
 *
 * Built by engine.native with the MPI library's compiler wrapper (mpicc) against the
 * library this process runs, and NumPy's headers for the array fields it reads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <mpi.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>

enum { START = 0, WAIT = 1, CALL = 2, TIMED = 3 };

/* A timed wait first tests its requests this long, then hands them to its Python wait
   (executor.timed_waitall: the spin, the timeout, the progress rule).  A latency-bound
   message completes well within it; MPI_Testall changes no request until all are done,
   so the Python wait takes them over unchanged. */
#define TIMED_SPIN_S 50e-6

typedef struct {
    int kind, n;
    MPI_Request *reqs; /* START, WAIT: one persistent request; TIMED: those it waits for
                          (a persistent request's handle does not change) */
    PyObject *call;    /* CALL: a ready callable (a reduction, a copy); TIMED: its wait */
} Step;

/* What the hit reads, set once when the entry is made (engine.cache._entry). */
typedef struct {
    PyObject_HEAD
    PyObject *comm, *rb, *ra, *c, *d, *t;  /* the call's objects (rb, ra: weak references) */
    PyObject *db, *da;                      /* the arrays' dtype objects */
    PyObject *epoch;                        /* core.config.EPOCH[0] the entry holds for */
    PyObject *ctx;                          /* its context: the call counter (ctx.seq) */
    PyObject *keep;                         /* the request objects and callables */
    int flat, live;
    int nb, na;                             /* not flat: ndim, then shape and strides */
    npy_intp *lay_b, *lay_a;
    void *addr_b, *addr_a;                  /* the arrays' data addresses */
    Step *steps;
    Py_ssize_t nsteps, failed_at;           /* failed_at: the step that raised, or -1 */
} Hit;

/* engine.cache's objects, handed over once by setup(). */
static struct {
    PyObject *last, *slow, *failed, *in_flight, *epoch, *in_place, *exception;
    PyTypeObject *ndarray;
    PyObject *seq, *hit, *one;
    long long hits;
} g;

static PyTypeObject HitType;

/* Whether the weak reference ``ref`` (None for MPI.IN_PLACE) refers to ``obj``. */
static int refers_to(PyObject *ref, PyObject *obj)
{
    if (ref == Py_None)
        return obj == g.in_place;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *target;
    if (PyWeakref_GetRef(ref, &target) != 1)
        return 0;
    Py_DECREF(target);
    return target == obj;
#else
    return PyWeakref_GET_OBJECT(ref) == obj;
#endif
}

/* Entry.matches for one array: its dtype object and data address, then, flat, C
   contiguity (and writeability: ``out``), or else the same shape and strides. */
static int same_layout(PyObject *obj, PyObject *dtype, void *addr, int flat, int writeable,
                       int nd, const npy_intp *lay)
{
    if (!PyObject_TypeCheck(obj, g.ndarray))
        return 0;
    PyArrayObject *arr = (PyArrayObject *)obj;
    if ((PyObject *)PyArray_DESCR(arr) != dtype)
        return 0;
    npy_intp size = 1;  /* (an empty array's address is taken as 0, as engine.cache does) */
    for (int i = 0; i < PyArray_NDIM(arr); i++)
        size *= PyArray_DIMS(arr)[i];
    if ((size ? PyArray_DATA(arr) : NULL) != addr)
        return 0;
    int flags = PyArray_FLAGS(arr);
    if (writeable && !(flags & NPY_ARRAY_WRITEABLE))
        return 0;
    if (flat)
        return (flags & NPY_ARRAY_C_CONTIGUOUS) != 0;
    if (PyArray_NDIM(arr) != nd)
        return 0;
    const npy_intp *shape = PyArray_DIMS(arr), *strides = PyArray_STRIDES(arr);
    for (int i = 0; i < nd; i++)
        if (shape[i] != lay[i] || strides[i] != lay[nd + i])
            return 0;
    return 1;
}

static int matches(Hit *h, PyObject *comm, PyObject *a, PyObject *b, PyObject *c,
                   PyObject *d, PyObject *t)
{
    if (!(h->live && h->comm == comm && h->c == c && h->d == d && h->t == t
          && refers_to(h->rb, b) && refers_to(h->ra, a)
          && PyList_GET_ITEM(g.epoch, 0) == h->epoch))
        return 0;
    if (!same_layout(b, h->db, h->addr_b, h->flat, 1, h->nb, h->lay_b))
        return 0;
    if (a == g.in_place || a == b)  /* (a is b: the entry's call was in place too) */
        return 1;
    return same_layout(a, h->da, h->addr_a, h->flat, 0, h->na, h->lay_a);
}

/* mpi4py's error for an MPI error code: MPI.Exception(code). */
static void raise_mpi(int code)
{
    PyObject *exc = PyObject_CallFunction(g.exception, "i", code);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
}

/* The entry's steps in order.  MPI's own waits block with the interpreter released (as
   mpi4py's do): repeat() runs this only when no other operation is in flight.  A
   reduction or copy that reports a floating-point condition (RuntimeWarning,
   FloatingPointError) has written its IEEE result: it stands, as in engine.executor. */
static int run(Hit *h)
{
    Step *s = h->steps, *end = s + h->nsteps;
    h->failed_at = -1;
    while (s < end) {
        int err = MPI_SUCCESS, done = 1;
        if (s->kind == CALL || s->kind == TIMED) {
            if (s->kind == TIMED) {
                double until = MPI_Wtime() + TIMED_SPIN_S;
                Py_BEGIN_ALLOW_THREADS
                do
                    err = MPI_Testall(s->n, s->reqs, &done, MPI_STATUSES_IGNORE);
                while (err == MPI_SUCCESS && !done && MPI_Wtime() < until);
                Py_END_ALLOW_THREADS
            }
            if (err == MPI_SUCCESS && (s->kind == CALL || !done)) {
                PyObject *r = PyObject_CallNoArgs(s->call);
                if (r == NULL) {
                    if (!(PyErr_ExceptionMatches(PyExc_RuntimeWarning)
                          || PyErr_ExceptionMatches(PyExc_FloatingPointError))) {
                        h->failed_at = s - h->steps;
                        return -1;
                    }
                    PyErr_Clear();
                } else {
                    Py_DECREF(r);
                }
            }
            if (err == MPI_SUCCESS)
                s++;
        } else {
            Py_BEGIN_ALLOW_THREADS
            for (; s < end && (s->kind == START || s->kind == WAIT); s++) {
                err = s->kind == START ? MPI_Start(s->reqs) : MPI_Wait(s->reqs, MPI_STATUS_IGNORE);
                if (err != MPI_SUCCESS)
                    break;
            }
            Py_END_ALLOW_THREADS
        }
        if (err != MPI_SUCCESS) {
            /* (MPI_Wait of one request returns that request's own error) */
            h->failed_at = s - h->steps;
            raise_mpi(err);
            return -1;
        }
    }
    return 0;
}

/* repeat(comm, name, a, b, c=None, d=None, t=None): engine.cache.repeat. */
static PyObject *repeat(PyObject *mod, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames)
{
    if (g.slow == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mpicoll.engine._hit: setup() was not called");
        return NULL;
    }
    if (kwnames != NULL || nargs < 4 || nargs > 7)
        return PyObject_Vectorcall(g.slow, args, nargs, kwnames);
    PyObject *entry = PyDict_GetItemWithError(g.last, args[1]);
    if (entry == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return PyObject_Vectorcall(g.slow, args, nargs, NULL);
    }
    Py_INCREF(entry);
    PyObject *hit = PyObject_GetAttr(entry, g.hit);
    if (hit == NULL) {
        Py_DECREF(entry);
        return NULL;
    }
    Hit *h = (Hit *)hit;
    if (Py_TYPE(hit) != &HitType || PyList_GET_SIZE(g.in_flight) != 0
        || !matches(h, args[0], args[2], args[3], nargs > 4 ? args[4] : Py_None,
                    nargs > 5 ? args[5] : Py_None, nargs > 6 ? args[6] : Py_None)) {
        Py_DECREF(hit);
        Py_DECREF(entry);
        return PyObject_Vectorcall(g.slow, args, nargs, NULL);
    }
    /* ctx.seq += 1: every call counts (observe.calls, observe.check) */
    PyObject *seq = PyObject_GetAttr(h->ctx, g.seq), *next = NULL;
    if (seq != NULL) {
        next = PyNumber_Add(seq, g.one);
        Py_DECREF(seq);
    }
    if (next == NULL || PyObject_SetAttr(h->ctx, g.seq, next) < 0 || run(h) < 0) {
        /* interrupted (an MPI error, Ctrl-C): its requests may still be active, so the
           entry never runs again; engine.cache._failed forgets it and gives the error the
           caller sees (an MPI error named by its message, step and call) */
        Py_XDECREF(next);
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *r = PyObject_CallFunctionObjArgs(g.failed, entry, value ? value : Py_None,
                                                   NULL);
        if (r == NULL) {
            PyErr_WriteUnraisable(g.failed);
            PyErr_Restore(type, value, tb);
        } else if (PyExceptionInstance_Check(r) && r != value) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            PyErr_SetObject((PyObject *)Py_TYPE(r), r);
        } else {
            PyErr_Restore(type, value, tb);
        }
        Py_XDECREF(r);
        Py_DECREF(hit);
        Py_DECREF(entry);
        return NULL;
    }
    Py_DECREF(next);
    g.hits++;
    Py_DECREF(hit);
    Py_DECREF(entry);
    Py_RETURN_TRUE;
}

/* A layout tuple pair (shape, strides) -> ndim and one C array of both. */
static int layout(PyObject *shape, PyObject *strides, int *nd, npy_intp **lay)
{
    *nd = 0;
    *lay = NULL;
    if (shape == Py_None)
        return 0;
    if (!PyTuple_Check(shape) || !PyTuple_Check(strides)
        || PyTuple_GET_SIZE(shape) != PyTuple_GET_SIZE(strides)) {
        PyErr_SetString(PyExc_TypeError, "Hit: shape and strides must be tuples of one length");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(shape);
    *lay = PyMem_Malloc(sizeof(npy_intp) * (size_t)(2 * n + 1));
    if (*lay == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        (*lay)[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        (*lay)[n + i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, i));
    }
    if (PyErr_Occurred())
        return -1;
    *nd = (int)n;
    return 0;
}

/* The handles of mpi4py requests (one, or a sequence) into a new C array. */
static int handles(PyObject *obj, int many, Step *s)
{
    PyObject *seq = many ? PySequence_Tuple(obj) : PyTuple_Pack(1, obj);
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    s->reqs = PyMem_Calloc((size_t)n + 1, sizeof(MPI_Request));
    if (s->reqs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyObject_CallMethod(PyTuple_GET_ITEM(seq, i), "py2f", NULL);
        if (f == NULL) {
            Py_DECREF(seq);
            return -1;
        }
        s->reqs[i] = MPI_Request_f2c((MPI_Fint)PyLong_AsLong(f));
        Py_DECREF(f);
    }
    Py_DECREF(seq);
    s->n = (int)n;
    return PyErr_Occurred() ? -1 : 0;
}

/* Hit(comm, rb, ra, c, d, t, db, da, shape_b, strides_b, shape_a, strides_a, flat,
       address_b, address_a, epoch, ctx, program): ``program`` is a sequence of (kind,
   object) -- START or WAIT with an mpi4py persistent request, CALL with a callable
   taking no arguments, TIMED with (requests, the callable that waits for them under the
   call's timeout). */
static int hit_init(Hit *self, PyObject *args, PyObject *kwds)
{
    PyObject *comm, *rb, *ra, *c, *d, *t, *db, *da, *sb, *tb, *sa, *ta, *epoch, *ctx, *prog;
    PyObject *addr_b, *addr_a;
    int flat;
    if (self->steps != NULL || self->comm != NULL) {
        PyErr_SetString(PyExc_TypeError, "Hit: already set up");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOpOOOOO:Hit", &comm, &rb, &ra, &c, &d, &t, &db,
                          &da, &sb, &tb, &sa, &ta, &flat, &addr_b, &addr_a, &epoch, &ctx,
                          &prog))
        return -1;
    self->addr_b = PyLong_AsVoidPtr(addr_b);
    self->addr_a = PyLong_AsVoidPtr(addr_a);
    self->failed_at = -1;
    if (PyErr_Occurred())
        return -1;
    if (layout(sb, tb, &self->nb, &self->lay_b) < 0 || layout(sa, ta, &self->na, &self->lay_a) < 0)
        return -1;
    PyObject *items = PySequence_Tuple(prog);
    if (items == NULL)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    self->steps = PyMem_Calloc((size_t)n + 1, sizeof(Step));
    if (self->steps == NULL) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return -1;
    }
    self->nsteps = n;  /* (what dealloc frees; live stays 0 until the end) */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(items, i);
        int kind;
        PyObject *obj;
        if (!PyArg_ParseTuple(item, "iO:Hit step", &kind, &obj)) {
            Py_DECREF(items);
            return -1;
        }
        Step *s = &self->steps[i];
        s->kind = kind;
        int bad = 0;
        if (kind == CALL) {
            bad = !PyCallable_Check(obj);
            s->call = obj;  /* (kept alive by self->keep) */
        } else if (kind == START || kind == WAIT) {
            bad = handles(obj, 0, s) < 0;
        } else if (kind == TIMED) {
            bad = !PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2
                || !PyCallable_Check(PyTuple_GET_ITEM(obj, 1))
                || handles(PyTuple_GET_ITEM(obj, 0), 1, s) < 0;
            s->call = bad ? NULL : PyTuple_GET_ITEM(obj, 1);
        } else {
            bad = 1;
        }
        if (bad) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "Hit: step %zd: expected (START|WAIT, request), "
                             "(CALL, callable) or (TIMED, (requests, callable))", i);
            Py_DECREF(items);
            return -1;
        }
    }
    self->keep = items;
    self->flat = flat;
    self->live = 1;
#define KEEP(field, value) Py_INCREF(value); self->field = value
    KEEP(comm, comm); KEEP(rb, rb); KEEP(ra, ra); KEEP(c, c); KEEP(d, d); KEEP(t, t);
    KEEP(db, db); KEEP(da, da); KEEP(epoch, epoch); KEEP(ctx, ctx);
#undef KEEP
    return 0;
}

static int hit_traverse(Hit *self, visitproc visit, void *arg)
{
    Py_VISIT(self->comm); Py_VISIT(self->rb); Py_VISIT(self->ra); Py_VISIT(self->c);
    Py_VISIT(self->d); Py_VISIT(self->t); Py_VISIT(self->db); Py_VISIT(self->da);
    Py_VISIT(self->epoch); Py_VISIT(self->ctx); Py_VISIT(self->keep);
    return 0;
}

static int hit_clear(Hit *self)
{
    self->live = 0;  /* (its callables go: it must never run again) */
    Py_CLEAR(self->comm); Py_CLEAR(self->rb); Py_CLEAR(self->ra); Py_CLEAR(self->c);
    Py_CLEAR(self->d); Py_CLEAR(self->t); Py_CLEAR(self->db); Py_CLEAR(self->da);
    Py_CLEAR(self->epoch); Py_CLEAR(self->ctx); Py_CLEAR(self->keep);
    return 0;
}

static void hit_dealloc(Hit *self)
{
    PyObject_GC_UnTrack(self);
    hit_clear(self);
    for (Py_ssize_t i = 0; self->steps != NULL && i < self->nsteps; i++)
        PyMem_Free(self->steps[i].reqs);
    PyMem_Free(self->steps);
    PyMem_Free(self->lay_b);
    PyMem_Free(self->lay_a);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Hit.go(): run the steps (the Python repeat proved the hit: an entry found by its
   arguments rather than as its function's last). */
static PyObject *hit_go(Hit *self, PyObject *unused)
{
    if (!self->live) {
        PyErr_SetString(PyExc_RuntimeError, "Hit.go: its entry was released");
        return NULL;
    }
    if (run(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef hit_methods[] = {
    {"go", (PyCFunction)hit_go, METH_NOARGS, "run the program once (the caller proved the hit)"},
    {NULL}
};

static PyMemberDef hit_members[] = {
    {"live", T_INT, offsetof(Hit, live), 0, "0 once its entry is released: never runs again"},
    {"epoch", T_OBJECT_EX, offsetof(Hit, epoch), 0, "the options epoch it holds for"},
    {"failed_at", T_PYSSIZET, offsetof(Hit, failed_at), READONLY,
     "the step the last failed run raised at, or -1"},
    {NULL}
};

static PyTypeObject HitType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpicoll.engine._hit.Hit",
    .tp_doc = "An entry's signature and steps, for repeat() (see engine/cache.py)",
    .tp_basicsize = sizeof(Hit),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hit_init,
    .tp_dealloc = (destructor)hit_dealloc,
    .tp_traverse = (traverseproc)hit_traverse,
    .tp_clear = (inquiry)hit_clear,
    .tp_members = hit_members,
    .tp_methods = hit_methods,
};

/* setup(last, slow, failed, in_flight, epoch, in_place, ndarray, exception) */
static PyObject *setup(PyObject *mod, PyObject *args)
{
    PyObject *last, *slow, *failed, *in_flight, *epoch, *in_place, *ndarray, *exception;
    if (!PyArg_ParseTuple(args, "O!OOO!O!OO!O:setup", &PyDict_Type, &last, &slow, &failed,
                          &PyList_Type, &in_flight, &PyList_Type, &epoch, &in_place,
                          &PyType_Type, &ndarray, &exception))
        return NULL;
    if (PyList_GET_SIZE(epoch) != 1) {
        PyErr_SetString(PyExc_ValueError, "setup: epoch must be a list of one item");
        return NULL;
    }
#define SET(field, value) Py_INCREF(value); Py_XSETREF(g.field, value)
    SET(last, last); SET(slow, slow); SET(failed, failed); SET(in_flight, in_flight);
    SET(epoch, epoch); SET(in_place, in_place); SET(exception, exception);
#undef SET
    Py_INCREF(ndarray);
    Py_XSETREF(g.ndarray, (PyTypeObject *)ndarray);
    Py_RETURN_NONE;
}

static PyObject *library_version(PyObject *mod, PyObject *unused)
{
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);
    return PyUnicode_FromStringAndSize(text, len);
}

static PyObject *hits(PyObject *mod, PyObject *unused)
{
    return PyLong_FromLongLong(g.hits);
}

static PyMethodDef methods[] = {
    {"repeat", (PyCFunction)(void (*)(void))repeat, METH_FASTCALL | METH_KEYWORDS,
     "repeat(comm, name, a, b, c=None, d=None, t=None): engine.cache.repeat"},
    {"setup", setup, METH_VARARGS, "hand over engine.cache's tables (once)"},
    {"library_version", library_version, METH_NOARGS,
     "MPI_Get_library_version of the library this module was linked with"},
    {"hits", hits, METH_NOARGS, "how many repeats ran here (not handed to Python)"},
    {NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hit", "engine.cache's repeat, compiled (see engine/_hit.c)", -1,
    methods
};

PyMODINIT_FUNC PyInit__hit(void)
{
    if (PyType_Ready(&HitType) < 0)
        return NULL;
    g.seq = PyUnicode_InternFromString("seq");
    g.hit = PyUnicode_InternFromString("hit");
    g.one = PyLong_FromLong(1);
    if (g.seq == NULL || g.hit == NULL || g.one == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HitType);
    if (PyModule_AddObject(m, "Hit", (PyObject *)&HitType) < 0
        || PyModule_AddIntConstant(m, "START", START) < 0
        || PyModule_AddIntConstant(m, "WAIT", WAIT) < 0
        || PyModule_AddIntConstant(m, "CALL", CALL) < 0
        || PyModule_AddIntConstant(m, "TIMED", TIMED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
