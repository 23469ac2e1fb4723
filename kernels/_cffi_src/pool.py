"""Declarations for c/pool.c: the page-aligned, mlocked buffer pool."""

INCLUDES = ""

TYPES = """
#define MG_POOL_OK ...
#define MG_POOL_ENOTLEASED ...
#define MG_POOL_EBUSY ...

typedef struct mg_buffer {
    void *ptr;
    size_t capacity;
    int locked;
    ...;
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

typedef struct mg_pool mg_pool;
"""

FUNCTIONS = """
size_t mg_pool_bucket_size(size_t nbytes);
mg_pool *mg_pool_create(size_t max_free_per_bucket, int require_mlock);
mg_buffer *mg_pool_acquire(mg_pool *p, size_t nbytes);
int mg_pool_release(mg_pool *p, mg_buffer *buf);
void mg_pool_get_stats(mg_pool *p, mg_pool_stats *out);
int mg_pool_close(mg_pool *p);
void mg_pool_free(mg_pool *p);
"""
