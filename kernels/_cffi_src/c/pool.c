/*
 * Page-aligned, power-of-two bucketed buffer pool with mlock.
 *
 * Buffers for tensors on the wire live here so the kernel and the socket see
 * stable, page-aligned (and, where RLIMIT_MEMLOCK allows, resident) memory.
 * The memlock limit is often tiny (8 MiB in default containers), so a buffer
 * that cannot be locked is still handed out, unlocked and counted, unless the
 * pool was created with require_mlock. A buffer is either leased or on a free
 * list, never both, and the state flips only under the pool mutex.
 *
 * Every entry point takes the pool mutex, so callers need no lock of their
 * own. Closing frees the free lists and refuses new leases, but the pool
 * object itself lives until its owner has called mg_pool_free (once nobody
 * can reach it any more) and its last leased buffer has come back; a call
 * racing with close or a late release therefore never touches freed memory.
 * Errors are reported through errno (see mg_pool_acquire).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>

#define MG_POOL_PAGE 4096u
#define MG_POOL_MIN_SHIFT 12
#define MG_POOL_BUCKETS 36 /* 4 KiB .. 128 TiB */

enum {
    MG_POOL_OK = 0,
    MG_POOL_ENOTLEASED = -4,
    MG_POOL_EBUSY = -5,
};

typedef struct mg_buffer {
    void *ptr;
    size_t capacity;
    int bucket;
    int locked;
    int leased;
    struct mg_buffer *next;
} mg_buffer;

typedef struct mg_pool_stats {
    uint64_t locked_bytes;
    uint64_t unlocked_bytes;
    uint64_t leased_bytes;
    uint64_t free_bytes;
    uint64_t leased_count;
    uint64_t free_count;
    uint64_t allocations;
    uint64_t reuses;
    uint64_t releases;
    uint64_t frees;
    uint64_t lock_failures;
    uint64_t memlock_limit;
} mg_pool_stats;

typedef struct mg_pool {
    pthread_mutex_t mu;
    size_t max_free;
    int require_mlock;
    int closed;
    int orphaned; /* mg_pool_free came while buffers were leased */
    mg_buffer *free_list[MG_POOL_BUCKETS];
    size_t free_len[MG_POOL_BUCKETS];
    mg_pool_stats st;
} mg_pool;

static int mg_bucket_of(size_t nbytes)
{
    int shift = MG_POOL_MIN_SHIFT;
    while (shift < MG_POOL_MIN_SHIFT + MG_POOL_BUCKETS && ((size_t)1 << shift) < nbytes)
        shift++;
    return shift - MG_POOL_MIN_SHIFT;
}

size_t mg_pool_bucket_size(size_t nbytes)
{
    int b = mg_bucket_of(nbytes);
    return b < MG_POOL_BUCKETS ? (size_t)1 << (b + MG_POOL_MIN_SHIFT) : 0;
}

mg_pool *mg_pool_create(size_t max_free_per_bucket, int require_mlock)
{
    mg_pool *p = calloc(1, sizeof *p);
    if (p == NULL)
        return NULL;
    pthread_mutex_init(&p->mu, NULL);
    p->max_free = max_free_per_bucket;
    p->require_mlock = require_mlock;
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        p->st.memlock_limit = rl.rlim_cur;
    else
        p->st.memlock_limit = UINT64_MAX;
    return p;
}

static void mg_buffer_free(mg_pool *p, mg_buffer *buf)
{
    if (buf->locked) {
        munlock(buf->ptr, buf->capacity);
        p->st.locked_bytes -= buf->capacity;
    } else {
        p->st.unlocked_bytes -= buf->capacity;
    }
    p->st.frees++;
    free(buf->ptr);
    free(buf);
}

/* Try to lock a fresh buffer; skip the syscall when our own count shows the
 * limit would be exceeded anyway (other locks in the process still make
 * mlock fail, which is handled the same way). */
static int mg_try_lock(mg_pool *p, mg_buffer *buf)
{
    if (p->st.locked_bytes + buf->capacity <= p->st.memlock_limit &&
        mlock(buf->ptr, buf->capacity) == 0)
        return 1;
    p->st.lock_failures++;
    return 0;
}

/* A leased buffer of at least nbytes, or NULL with errno set: EINVAL (larger
 * than the largest bucket), ENOMEM, EAGAIN (it could not be locked and the
 * pool requires locking) or EBADF (the pool is closed). */
mg_buffer *mg_pool_acquire(mg_pool *p, size_t nbytes)
{
    int b = mg_bucket_of(nbytes);
    if (b >= MG_POOL_BUCKETS) {
        errno = EINVAL;
        return NULL;
    }
    pthread_mutex_lock(&p->mu);
    if (p->closed) {
        pthread_mutex_unlock(&p->mu);
        errno = EBADF;
        return NULL;
    }
    mg_buffer *buf = p->free_list[b];
    if (buf != NULL) {
        p->free_list[b] = buf->next;
        p->free_len[b]--;
        p->st.free_bytes -= buf->capacity;
        p->st.free_count--;
        p->st.reuses++;
    } else {
        size_t cap = (size_t)1 << (b + MG_POOL_MIN_SHIFT);
        buf = calloc(1, sizeof *buf);
        if (buf == NULL || posix_memalign(&buf->ptr, MG_POOL_PAGE, cap) != 0) {
            free(buf);
            pthread_mutex_unlock(&p->mu);
            errno = ENOMEM;
            return NULL;
        }
        buf->capacity = cap;
        buf->bucket = b;
        buf->locked = mg_try_lock(p, buf);
        if (!buf->locked && p->require_mlock) {
            free(buf->ptr);
            free(buf);
            pthread_mutex_unlock(&p->mu);
            errno = EAGAIN;
            return NULL;
        }
        if (buf->locked)
            p->st.locked_bytes += cap;
        else
            p->st.unlocked_bytes += cap;
        p->st.allocations++;
    }
    buf->next = NULL;
    buf->leased = 1;
    p->st.leased_bytes += buf->capacity;
    p->st.leased_count++;
    pthread_mutex_unlock(&p->mu);
    return buf;
}

static void mg_pool_destroy(mg_pool *p)
{
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int mg_pool_release(mg_pool *p, mg_buffer *buf)
{
    pthread_mutex_lock(&p->mu);
    if (!buf->leased) {
        pthread_mutex_unlock(&p->mu);
        return MG_POOL_ENOTLEASED;
    }
    buf->leased = 0;
    p->st.leased_bytes -= buf->capacity;
    p->st.leased_count--;
    p->st.releases++;
    int b = buf->bucket;
    if (p->orphaned) {
        mg_buffer_free(p, buf);
        if (p->st.leased_count == 0) {
            pthread_mutex_unlock(&p->mu);
            mg_pool_destroy(p);
            return MG_POOL_OK;
        }
    } else if (p->free_len[b] < p->max_free) {
        buf->next = p->free_list[b];
        p->free_list[b] = buf;
        p->free_len[b]++;
        p->st.free_bytes += buf->capacity;
        p->st.free_count++;
    } else {
        mg_buffer_free(p, buf);
    }
    pthread_mutex_unlock(&p->mu);
    return MG_POOL_OK;
}

void mg_pool_get_stats(mg_pool *p, mg_pool_stats *out)
{
    pthread_mutex_lock(&p->mu);
    *out = p->st;
    pthread_mutex_unlock(&p->mu);
}

static void mg_pool_drain(mg_pool *p)
{
    for (int b = 0; b < MG_POOL_BUCKETS; b++) {
        while (p->free_list[b] != NULL) {
            mg_buffer *buf = p->free_list[b];
            p->free_list[b] = buf->next;
            mg_buffer_free(p, buf);
        }
        p->free_len[b] = 0;
    }
}

/* Frees the free lists and refuses further leases; refuses while buffers are
 * still leased, since their memory may be in use by a kernel or a transport. */
int mg_pool_close(mg_pool *p)
{
    pthread_mutex_lock(&p->mu);
    if (p->st.leased_count != 0) {
        pthread_mutex_unlock(&p->mu);
        return MG_POOL_EBUSY;
    }
    mg_pool_drain(p);
    p->closed = 1;
    pthread_mutex_unlock(&p->mu);
    return MG_POOL_OK;
}

/* Frees the pool object and its free lists once no buffer is leased. With
 * buffers still out (finalizers run in any order when a reference cycle is
 * collected, so the owner may go before the buffers' owners), the pool stays
 * until the last of them is released, and that release frees it. */
void mg_pool_free(mg_pool *p)
{
    pthread_mutex_lock(&p->mu);
    mg_pool_drain(p);
    p->closed = 1;
    if (p->st.leased_count != 0) {
        p->orphaned = 1;
        pthread_mutex_unlock(&p->mu);
        return;
    }
    pthread_mutex_unlock(&p->mu);
    mg_pool_destroy(p);
}
