/*
 * ucfs._fusewire: FUSE passthrough through a libfuse that predates it.
 *
 * With passthrough (Linux 6.9 and later) the kernel sends the reads and writes of a file opened in
 * that mode straight to a local "backing" file, here the staging file of a file being written: the
 * writer runs at the speed of the local disk instead of waiting for a round trip through this daemon
 * for every 1 MiB. The kernel offers it at FUSE_INIT; the daemon accepts it in its INIT reply, and
 * grants it per open in the OPEN or CREATE reply (FOPEN_PASSTHROUGH and a backing id that an ioctl on
 * /dev/fuse returned for the backing file).
 *
 * libfuse learned to say both in 3.16; Debian 12 ships 3.14, and pyfuse3 says neither. Both replies
 * are fixed-layout structs of the kernel ABI (include/uapi/linux/fuse.h), so this module adds the two
 * fields on the wire: it redirects libfuse's own calls of read() and writev() (its GOT entries, not
 * the process's) to wrappers that
 *   - on the way in, note the INIT request (whether the kernel offers passthrough) and the unique ids
 *     of OPEN and CREATE requests;
 *   - on the way out, set FUSE_PASSTHROUGH and max_stack_depth in the INIT reply when asked to, and
 *     set FOPEN_PASSTHROUGH and the backing id in the reply to an OPEN or CREATE whose file handle
 *     Python granted passthrough (grant(fh, backing_id)) before returning from its handler.
 * Any other message on any other descriptor passes through untouched, and a kernel that does not
 * offer passthrough is never told about it: the mount then works as it always did.
 *
 * Three more things ride on the same hooks, for reads:
 *   - larger read requests. libfuse asks the kernel for requests of up to 1 MiB (max_pages 256,
 *     sized for its own receive buffer, which only writes fill). A read request is small and its
 *     answer is written by us, so the INIT reply may ask for more (install's max_pages); the kernel
 *     grants up to its fs.fuse.max_pages_limit. An 8 MiB read costs one request instead of eight.
 *   - vectored read replies. pyfuse3 answers a read with one buffer, but a large read often spans
 *     the buffers of two ranged GETs. Instead of joining them (a copy, into fresh memory), Python
 *     hands the pieces to vector(), which returns a stand-in of the same length; when libfuse
 *     writes the reply with the stand-in as its data, the pieces go out in its place. The stand-in
 *     is address space that cannot be read (PROT_NONE): a reply that somehow carried it anyway
 *     fails with EFAULT instead of sending bytes that are not the file's.
 *   - no FLUSH at close. A handle that reads what the store holds has nothing to do when its file
 *     is closed, yet the kernel sends a FLUSH for every close() and the closing process waits for
 *     the answer. Python marks such a handle (grant(fh, NO_BACKING)) and its OPEN reply gets
 *     FOPEN_NOFLUSH (a kernel that predates the flag ignores it and flushes as before).
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <elf.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

/* The kernel ABI, as include/uapi/linux/fuse.h defines it (protocol 7.40 for passthrough). */
enum { OP_OPEN = 14, OP_INIT = 26, OP_CREATE = 35 };
#define INIT_EXT (1u << 30)           /* flags: flags2 is meaningful */
#define INIT2_PASSTHROUGH (1u << 5)   /* flags2: FUSE_PASSTHROUGH, bit 37 of the 64-bit flags */
#define INIT_MAX_PAGES (1u << 22)     /* flags: FUSE_MAX_PAGES, max_pages is meaningful */
#define FOPEN_NOFLUSH (1u << 5)
#define FOPEN_PASSTHROUGH (1u << 7)
#define NO_BACKING (-1) /* a grant of FOPEN_NOFLUSH alone, for a handle not in passthrough mode */

struct in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
struct init_in {
    uint32_t major, minor, max_readahead, flags, flags2;
};
struct init_out { /* only the part up to max_stack_depth; libfuse sends 64 bytes */
    uint32_t major, minor, max_readahead, flags;
    uint16_t max_background, congestion_threshold;
    uint32_t max_write, time_gran;
    uint16_t max_pages, map_alignment;
    uint32_t flags2, max_stack_depth;
};
struct open_out {
    uint64_t fh;
    uint32_t open_flags;
    int32_t backing_id;
};

/* Requests in flight are bounded by the kernel's queue and pyfuse3's tasks; this many OPEN/CREATE
 * requests awaiting their reply is far beyond either. */
#define PENDING_MAX 1024
#define GRANTS_MAX 4096

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int watched_fd = -1;
static int want;                 /* accept passthrough if the kernel offers it */
static int offered;              /* the kernel's INIT offered it */
static int negotiated;           /* our INIT reply accepted it */
static uint64_t init_unique;
static int init_seen;
static uint64_t pending[PENDING_MAX];
static int npending;
static struct { uint64_t fh; int32_t backing_id; } grants[GRANTS_MAX];
static int ngrants;
static unsigned long long n_patched_opens, n_noflush_opens, n_requests;
static unsigned want_max_pages;  /* ask for read requests of this many pages (0: as libfuse asks) */
static unsigned asked_max_pages; /* what our INIT reply asked for */

/* Vectored read replies (only ever used by the thread that runs the FUSE loop). */
#define VEC_MAX 64
#define VEC_SPAN ((size_t)64 << 20)
static char *vec_standin;        /* VEC_SPAN bytes of PROT_NONE address space */
static Py_buffer vec_parts[VEC_MAX];
static int vec_n;
static size_t vec_total;
static pthread_t vec_thread;
static unsigned long long n_vectored;

static ssize_t (*real_read)(int, void *, size_t) = read;
static ssize_t (*real_writev)(int, const struct iovec *, int) = writev;

static void note_request(const void *buf, ssize_t n)
{
    struct in_header h;
    if ((size_t)n < sizeof h)
        return;
    memcpy(&h, buf, sizeof h);
    __atomic_add_fetch(&n_requests, 1, __ATOMIC_RELAXED);
    if (h.opcode == OP_INIT && (size_t)n >= sizeof h + sizeof(struct init_in)) {
        struct init_in in;
        memcpy(&in, (const char *)buf + sizeof h, sizeof in);
        pthread_mutex_lock(&mu);
        init_unique = h.unique;
        init_seen = 1;
        offered = (in.flags & INIT_EXT) && (in.flags2 & INIT2_PASSTHROUGH);
        pthread_mutex_unlock(&mu);
    } else if (h.opcode == OP_OPEN || h.opcode == OP_CREATE) {
        pthread_mutex_lock(&mu);
        if (npending < PENDING_MAX)
            pending[npending++] = h.unique;
        pthread_mutex_unlock(&mu);
    }
}

static ssize_t wire_read(int fd, void *buf, size_t count)
{
    ssize_t n = real_read(fd, buf, count);
    if (fd == watched_fd && n > 0)
        note_request(buf, n);
    return n;
}

/* Whether unique is a pending OPEN/CREATE; forgets it either way once its reply goes out. */
static int take_pending(uint64_t unique)
{
    for (int i = 0; i < npending; i++) {
        if (pending[i] == unique) {
            pending[i] = pending[--npending];
            return 1;
        }
    }
    return 0;
}

static int take_grant(uint64_t fh, int32_t *backing_id)
{
    for (int i = 0; i < ngrants; i++) {
        if (grants[i].fh == fh) {
            *backing_id = grants[i].backing_id;
            grants[i] = grants[--ngrants];
            return 1;
        }
    }
    return 0;
}

/* Send a reply. pyfuse3 calls libfuse's fuse_reply_*() holding the GIL, and the writev() wakes the
 * process that waits for the answer, which on a busy host often takes this CPU at once: the event
 * loop is then descheduled inside the call with the GIL in hand, and every other thread of the daemon
 * (uploads, disk writes, reads from the store) waits for it. The reply touches no Python object, so
 * the GIL is let go for the system call, as os.writev() would. Called without the GIL (libfuse
 * answering on its own), it just writes. */
static ssize_t send_reply(int fd, const struct iovec *iov, int iovcnt)
{
    if (!PyGILState_Check())
        return real_writev(fd, iov, iovcnt);
    ssize_t n;
    int saved;
    Py_BEGIN_ALLOW_THREADS
    n = real_writev(fd, iov, iovcnt);
    saved = errno;
    Py_END_ALLOW_THREADS
    errno = saved;
    return n;
}

static void vec_clear(void)
{
    for (int i = 0; i < vec_n; i++)
        PyBuffer_Release(&vec_parts[i]);
    vec_n = 0;
    vec_total = 0;
}

/* A read reply whose data is the stand-in vector() returned: send the pieces instead. */
static int is_vectored(int fd, const struct iovec *iov, int iovcnt)
{
    return vec_n && fd == watched_fd && iovcnt == 2 && iov[1].iov_base == vec_standin
           && iov[1].iov_len == vec_total && pthread_equal(pthread_self(), vec_thread)
           && PyGILState_Check();
}

static ssize_t send_vectored(int fd, const struct iovec *iov)
{
    struct iovec v[1 + VEC_MAX];
    v[0] = iov[0];
    for (int i = 0; i < vec_n; i++) {
        v[i + 1].iov_base = vec_parts[i].buf;
        v[i + 1].iov_len = (size_t)vec_parts[i].len;
    }
    ssize_t n = send_reply(fd, v, vec_n + 1); /* lets the GIL go, and has it again on return */
    int saved = errno;
    vec_clear();
    n_vectored++;
    errno = saved;
    return n;
}

static ssize_t wire_writev(int fd, const struct iovec *iov, int iovcnt)
{
    struct out_header h;
    if (fd != watched_fd || iovcnt < 1 || iov[0].iov_len != sizeof h)
        return real_writev(fd, iov, iovcnt);
    if (is_vectored(fd, iov, iovcnt))
        return send_vectored(fd, iov);
    memcpy(&h, iov[0].iov_base, sizeof h);
    /* A reply with data is the header and one argument; an error reply is the header alone. */
    size_t arglen = iovcnt == 2 ? iov[1].iov_len : 0;
    char copy[256];
    int patch = 0;

    pthread_mutex_lock(&mu);
    if (init_seen && h.unique == init_unique && h.error == 0 && iovcnt == 2
            && arglen >= sizeof(struct init_out) && arglen <= sizeof copy) {
        init_seen = 0;
        struct init_out out;
        memcpy(copy, iov[1].iov_base, arglen);
        memcpy(&out, copy, sizeof out);
        if (want && offered) {
            out.flags |= INIT_EXT;
            out.flags2 |= INIT2_PASSTHROUGH;
            out.max_stack_depth = 1; /* backing files live on ordinary file systems */
            negotiated = 1;
            patch = 1;
        }
        /* libfuse sets FUSE_MAX_PAGES when the kernel offered it; only then is max_pages read. */
        if (want_max_pages && (out.flags & INIT_MAX_PAGES) && want_max_pages > out.max_pages) {
            out.max_pages = (uint16_t)want_max_pages;
            patch = 1;
        }
        asked_max_pages = (out.flags & INIT_MAX_PAGES) ? out.max_pages : 0;
        if (patch)
            memcpy(copy, &out, sizeof out);
    } else if (npending && take_pending(h.unique) && h.error == 0 && iovcnt == 2
               && arglen >= sizeof(struct open_out) && arglen <= sizeof copy) {
        /* OPEN replies with fuse_open_out alone; CREATE with fuse_entry_out followed by it. */
        struct open_out out;
        memcpy(copy, iov[1].iov_base, arglen);
        memcpy(&out, copy + arglen - sizeof out, sizeof out);
        int32_t id;
        if (!take_grant(out.fh, &id)) {
            /* an ordinary open */
        } else if (id == NO_BACKING) {
            out.open_flags |= FOPEN_NOFLUSH;
            memcpy(copy + arglen - sizeof out, &out, sizeof out);
            n_noflush_opens++;
            patch = 1;
        } else if (negotiated) {
            /* The kernel refuses passthrough beside any caching flag (pyfuse3 sets keep_cache by
             * default), and beside direct_io it would still send reads and writes here. */
            out.open_flags = (out.open_flags & FOPEN_NOFLUSH) | FOPEN_PASSTHROUGH;
            out.backing_id = id;
            memcpy(copy + arglen - sizeof out, &out, sizeof out);
            n_patched_opens++;
            patch = 1;
        }
    }
    pthread_mutex_unlock(&mu);
    if (!patch)
        return send_reply(fd, iov, iovcnt);
    struct iovec v[2] = {iov[0], {copy, arglen}};
    return send_reply(fd, v, 2);
}

/* -- redirecting libfuse's calls -------------------------------------------------------------- */

struct hook_result {
    int found_lib;
    int hooked;
    int error;
};

static int patch_slot(void **slot, void *fn, int relro)
{
    long page = sysconf(_SC_PAGESIZE);
    void *start = (void *)((uintptr_t)slot & ~(uintptr_t)(page - 1));
    /* After relocation the loader made the RELRO part of the GOT read-only: open it for this one
     * store, then close it again. Outside RELRO (lazy binding) the loader itself still writes it. */
    if (relro && mprotect(start, (size_t)page, PROT_READ | PROT_WRITE) != 0)
        return -1;
    __atomic_store_n(slot, fn, __ATOMIC_SEQ_CST);
    if (relro)
        mprotect(start, (size_t)page, PROT_READ);
    return 0;
}

static uintptr_t dyn_ptr(uintptr_t base, uintptr_t p)
{
    /* glibc relocates these entries of the dynamic section in place; other loaders may not. */
    return p < base ? p + base : p;
}

static int hook_lib(struct dl_phdr_info *info, size_t size, void *data)
{
    struct hook_result *res = data;
    (void)size;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libfuse3.so"))
        return 0;
    res->found_lib = 1;
    uintptr_t base = info->dlpi_addr;
    const ElfW(Dyn) *dyn = NULL;
    uintptr_t relro_lo = 0, relro_hi = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(base + ph->p_vaddr);
        else if (ph->p_type == PT_GNU_RELRO) {
            relro_lo = base + ph->p_vaddr;
            relro_hi = relro_lo + ph->p_memsz;
        }
    }
    if (!dyn)
        return 1;
    uintptr_t jmprel = 0, rela = 0, symtab = 0, strtab = 0;
    size_t jmprelsz = 0, relasz = 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_JMPREL: jmprel = dyn_ptr(base, dyn->d_un.d_ptr); break;
        case DT_PLTRELSZ: jmprelsz = dyn->d_un.d_val; break;
        case DT_RELA: rela = dyn_ptr(base, dyn->d_un.d_ptr); break;
        case DT_RELASZ: relasz = dyn->d_un.d_val; break;
        case DT_SYMTAB: symtab = dyn_ptr(base, dyn->d_un.d_ptr); break;
        case DT_STRTAB: strtab = dyn_ptr(base, dyn->d_un.d_ptr); break;
        }
    }
    if (!symtab || !strtab)
        return 1;
    /* Calls go through JUMP_SLOT entries (or GLOB_DAT ones in a -fno-plt build). */
    const struct { uintptr_t at; size_t size; } tables[2] = {{jmprel, jmprelsz}, {rela, relasz}};
    for (int t = 0; t < 2; t++) {
        const ElfW(Rela) *r = (const ElfW(Rela) *)tables[t].at;
        size_t n = r ? tables[t].size / sizeof *r : 0;
        for (size_t i = 0; i < n; i++) {
            const ElfW(Sym) *sym = (const ElfW(Sym) *)symtab + ELF64_R_SYM(r[i].r_info);
            const char *name = (const char *)strtab + sym->st_name;
            void *fn = NULL;
            if (strcmp(name, "read") == 0)
                fn = (void *)wire_read;
            else if (strcmp(name, "writev") == 0)
                fn = (void *)wire_writev;
            if (!fn)
                continue;
            uintptr_t slot = base + r[i].r_offset;
            if (patch_slot((void **)slot, fn, slot >= relro_lo && slot < relro_hi) != 0) {
                res->error = errno;
                return 1;
            }
            res->hooked++;
        }
    }
    return 1;
}

/* -- Python ------------------------------------------------------------------------------------ */

static int hooked;

static PyObject *py_install(PyObject *self, PyObject *args)
{
    int fd, w;
    unsigned max_pages = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "ip|I", &fd, &w, &max_pages))
        return NULL;
    if (max_pages > 65535) {
        PyErr_SetString(PyExc_ValueError, "max_pages must fit in 16 bits");
        return NULL;
    }
    if (!hooked) {
        struct hook_result res = {0, 0, 0};
        dl_iterate_phdr(hook_lib, &res);
        if (!res.found_lib) {
            PyErr_SetString(PyExc_RuntimeError, "libfuse3 is not loaded in this process");
            return NULL;
        }
        if (res.error) {
            errno = res.error;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (res.hooked < 2) {
            PyErr_SetString(PyExc_RuntimeError, "libfuse3 does not call read() and writev() through its GOT");
            return NULL;
        }
        hooked = 1;
    }
    pthread_mutex_lock(&mu);
    watched_fd = fd;
    want = w;
    want_max_pages = max_pages;
    pthread_mutex_unlock(&mu);
    Py_RETURN_NONE;
}

static PyObject *py_vector(PyObject *self, PyObject *args)
{
    PyObject *parts;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &parts))
        return NULL;
    if (!hooked) {
        PyErr_SetString(PyExc_RuntimeError, "install() first: only a hooked libfuse can send the pieces");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(parts);
    if (n < 1 || n > VEC_MAX) {
        PyErr_Format(PyExc_ValueError, "1 to %d pieces, not %zd", VEC_MAX, n);
        return NULL;
    }
    if (!vec_standin) {
        void *p = mmap(NULL, VEC_SPAN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            return PyErr_SetFromErrno(PyExc_OSError);
        vec_standin = p;
    }
    vec_clear(); /* pieces set for a reply that never went out (its handler failed after) */
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(parts, i), &vec_parts[i], PyBUF_SIMPLE) < 0) {
            vec_clear();
            return NULL;
        }
        vec_n = (int)i + 1;
        total += (size_t)vec_parts[i].len;
    }
    if (total > VEC_SPAN) {
        vec_clear();
        PyErr_Format(PyExc_ValueError, "pieces of %zu bytes in all, more than a reply holds", total);
        return NULL;
    }
    vec_total = total;
    vec_thread = pthread_self();
    return PyMemoryView_FromMemory(vec_standin, (Py_ssize_t)total, PyBUF_READ);
}

static PyObject *py_negotiated(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    return PyBool_FromLong(__atomic_load_n(&negotiated, __ATOMIC_RELAXED));
}

static PyObject *py_offered(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    return PyBool_FromLong(__atomic_load_n(&offered, __ATOMIC_RELAXED));
}

static PyObject *py_grant(PyObject *self, PyObject *args)
{
    unsigned long long fh;
    int id;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ki", &fh, &id))
        return NULL;
    pthread_mutex_lock(&mu);
    int ok = ngrants < GRANTS_MAX;
    if (ok) {
        grants[ngrants].fh = fh;
        grants[ngrants].backing_id = id;
        ngrants++;
    }
    pthread_mutex_unlock(&mu);
    return PyBool_FromLong(ok);
}

static PyObject *py_revoke(PyObject *self, PyObject *args)
{
    unsigned long long fh;
    int32_t id;
    (void)self;
    if (!PyArg_ParseTuple(args, "K", &fh))
        return NULL;
    pthread_mutex_lock(&mu);
    int had = take_grant(fh, &id);
    pthread_mutex_unlock(&mu);
    return PyBool_FromLong(had);
}

static PyObject *py_statistics(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    pthread_mutex_lock(&mu);
    PyObject *d = Py_BuildValue("{s:O,s:O,s:K,s:K,s:K,s:i,s:i,s:I,s:K}", "offered", offered ? Py_True : Py_False,
                                "negotiated", negotiated ? Py_True : Py_False, "opens", n_patched_opens,
                                "noflush_opens", n_noflush_opens,
                                "requests", n_requests, "grants_waiting", ngrants,
                                "opens_awaiting_reply", npending, "max_pages_asked", asked_max_pages,
                                "vectored_replies", n_vectored);
    pthread_mutex_unlock(&mu);
    return d;
}

static PyMethodDef methods[] = {
    {"install", py_install, METH_VARARGS,
     "install(fuse_fd, want, max_pages=0): watch libfuse's traffic on fuse_fd; accept passthrough if want "
     "and offered; ask for read requests of up to max_pages pages (0: what libfuse asks)."},
    {"vector", py_vector, METH_VARARGS,
     "vector(pieces): a stand-in to answer a read with; the pieces (a tuple of buffers) go out in its "
     "place. Only for the thread that runs the FUSE loop, for the reply it sends next."},
    {"offered", py_offered, METH_NOARGS, "Whether the kernel's INIT offered passthrough."},
    {"negotiated", py_negotiated, METH_NOARGS, "Whether the INIT reply accepted passthrough."},
    {"grant", py_grant, METH_VARARGS,
     "grant(fh, backing_id): the reply to the OPEN/CREATE returning fh opens it in passthrough mode; "
     "with backing_id -1, it asks the kernel to send no FLUSH when the handle is closed."},
    {"revoke", py_revoke, METH_VARARGS, "revoke(fh): forget a grant whose reply never went out."},
    {"statistics", py_statistics, METH_NOARGS, "Counters, for `ucfs status`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "ucfs._fusewire", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fusewire(void)
{
    return PyModule_Create(&module);
}
